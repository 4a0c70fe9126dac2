"""precision (fp32 | bf16 | fp16) and offload (none | optimizer | full) as axes of every strategy, on 2 CPU ranks.

DDP and ZeroRedundancyOptimizer: autocast (fp32 state, low-precision matmuls); FSDP: ``MixedPrecision`` (fp32
shards, low-precision gathers and reduce_scatters); fp16 always with a dynamic loss scaler. zero1/zero2's own
mixed precision is tested in test_zero.py, DeepSpeed's in test_deepspeed.py.
"""

from __future__ import annotations

import pytest

from zeroexp.config import ConfigError, NotApplicableHere, validate
from zeroexp.probes.equivalence import THRESHOLDS

N2 = ("world_size=2",)


@pytest.mark.parametrize("strategy,precision", [("ddp", "bf16"), ("ddp", "fp16"), ("zro", "bf16"),
                                                ("fsdp_full", "bf16"), ("fsdp_grad_op", "fp16")])
def test_mixed_precision_cell_trains_with_fp32_state_and_its_threshold(cell, strategy, precision):
    res = cell(*N2, f"strategy={strategy}", f"precision={precision}")
    assert res.status == "ok", res.error
    s = res.summary
    st = s["state"]
    assert st["check"] == "PASS", st["reasons"]
    # Autocast and FSDP MixedPrecision keep the state at rest in fp32 (the fp32 parameters / shards are the master).
    assert {st["dtypes"][k] for k in ("param", "grad", "optim")} == {"float32"}
    if precision == "fp16":
        assert st["loss_scale"] is not None and st["loss_scale"] > 0
    else:
        assert st["loss_scale"] is None
    eq = s["equivalence"]
    assert eq["threshold"] == THRESHOLDS[precision] and eq["check"] == "PASS", eq
    if strategy.startswith("fsdp"):  # FSDP gathers and reduce-scatters in the low precision
        assert set(s["collectives"]["dtypes"].values()) <= {"bfloat16", "float16", "float32"}
        assert ("bfloat16" if precision == "bf16" else "float16") in s["collectives"]["dtypes"].values()


def test_fsdp_offload_is_refused_on_a_cpu_only_machine(compose):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: FSDP CPU offload runs here")
    with pytest.raises(NotApplicableHere, match="nowhere to offload"):
        validate(compose(*N2, "strategy=fsdp_full", "offload=full"))
    with pytest.raises(ConfigError, match="strategy=fsdp_full does not implement it"):
        validate(compose(*N2, "strategy=fsdp_full", "offload=optimizer"))
    with pytest.raises(ConfigError, match="offload"):
        validate(compose(*N2, "strategy=ddp", "offload=full"))
