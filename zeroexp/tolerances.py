"""Numerical tolerances of the equivalence check (``zeroexp.probes.equivalence``); no torch import, so the
report can name them."""

from __future__ import annotations

__all__ = ["FLOOR_FACTOR", "THRESHOLDS"]

#: max_abs_err allowed per precision. fp32: different reduction orders (all-reduce vs one process, sharded
#: vs whole-tensor AdamW) move weights by a few ulps per step; 1e-5 is far above that and far below any real
#: divergence (a changed batch moves weights by ~lr = 1e-3). A precision missing here: errors reported, SKIP.
#: bf16 / fp16 (fp32 master, low-precision forward and backward) against the fp32 reference: rounding (8 / 11
#: significand bits) flips Adam's lr-sized steps on gradients within the noise, so the drift grows with the
#: steps. Measured with zero1/zero2 at lr 1e-3: mlp (N=2-4, 10-30 steps) bf16 1.5e-3 to 2.1e-3, fp16 2.7e-4 to
#: 7.3e-4; gpt (N=2) bf16 6.8e-3 (10 steps) and 1.2e-2 (30), fp16 3.0e-3 and 5.2e-3. Sized for cells of up to
#: about 30 steps; they catch a divergence, not an error of one step (about lr).
THRESHOLDS: dict[str, float] = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 1e-2}
#: The bound is at least this many times the reduction-order floor (the distance between the reference and the
#: same reference with data parallelism's arithmetic): a correct sharded run's error is of the floor's kind and
#: size, a divergence is above it. The floor is not always a few ulps: AdamW's first update is lr * g/(|g| + eps),
#: so where a gradient is near zero a rounding difference moves the weight by a fraction of lr. Measured on the
#: reference gpt (fp32, lr 1e-3): N=2 and N=4 floors 6e-9 after 1 step, ~2e-6 after 10; N=3 (1/3 is inexact)
#: 3.9e-5 from the first step on. At N=3, 60 steps: ddp 4.6e-5, fsdp_full 3.1e-5 from the reference, and ddp with
#: one rank's batch changed at step 40: 1.2e-3, above the bound 3.9e-4 (FAIL).
FLOOR_FACTOR = 10.0
