"""A step's compute from the operations it runs: each kernel of the traced forward and backward costed by its
FLOPs and bytes on the device, not 6 x parameters x tokens at an assumed efficiency: on a GPU preset by a roofline
[ROOFLINE] (:mod:`zeroexp.formulas.time.rates`) of published rates (:class:`KernelRates`), on a calibrated machine by
the time its own microbenchmarks of each kind of operation took (:class:`MeasuredKernels`).

Each operation of the step (``zeroexp.plan.optrace``: the ATen calls one micro-batch dispatches, views left out, as
they launch no kernel) is one of three kinds:

- ``matmul`` (mm, addmm, bmm, baddbmm, convolutions, grouped matmuls): its FLOPs at the device's largest measured
  matmul rate (``matmul_flops``, the maximum achievable matmul FLOP/s of a published microbenchmark, not the
  datasheet's peak), or its bytes at HBM bandwidth where that takes longer (a skinny matmul is memory-bound);
- ``attention`` (scaled-dot-product attention's fused kernels, forward and backward): its FLOPs at the datasheet
  peak x ``attention_efficiency`` (FlashAttention's published share of the peak on the device; never above the matmul
  rate: in fp32 both run on CUDA cores), or its bytes at HBM bandwidth where longer;
- ``memory`` (everything else: elementwise, norms, softmax, copies, the loss): its bytes read and written at HBM
  bandwidth (``memory_Bps``).

Every kernel also pays ``launch_s``, the host's cost of launching it, where the GPU would otherwise wait: a kernel
takes the longer of its launch and its work (the host runs ahead of a busy GPU). The constants are a preset's
(``conf/network/<name>.yaml``, ``kernels:``), each citing its source; none is fitted to a training run.

Not modelled: kernels fused by a compiler (``torch.compile``: the step is costed eager), the L2 cache (every byte
from HBM), tensor-core shape quantisation (a matmul whose dimensions are not multiples of the tile runs below the
largest rate), what the dtype of each kernel is beyond the traced one (autocast's fp32 islands).

On a calibrated machine (``python -m zeroexp.calibrate``, ``compute.kernels``) the host runs each operation's dispatch
and its work one after the other: a call's dispatch is priced per operator apart (the calibration's operator stacks,
:class:`~zeroexp.formulas.time.rates.ComputeRate`'s ``*_s_per_op``), and :meth:`MeasuredKernels.seconds` gives an
operation's work beyond it: a matmul's from the times of ``torch.mm`` measured over a grid of (m, k, n) (its rate on a
CPU depends on each dimension, not on its FLOPs alone: measured on the 2-core host, 62 GFLOP/s at 128 x 128 x 128,
8.5 at 512 x 512 x 8 of the same FLOPs as 8 x 512 x 512 at 36), interpolated in the logarithms, less the smallest
call's (its dispatch); a memory-bound operation's from ``torch.add``'s time over a range of bytes moved (in the cache
and beyond it), less the smallest's.
"""

from __future__ import annotations

from collections import Counter
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["KINDS", "KernelRates", "MeasuredKernels", "OpCost", "op_seconds", "ops_seconds"]

#: The kinds of operation the step's compute is split into.
KINDS = ("matmul", "attention", "memory")


@dataclass(frozen=True)
class OpCost:
    """One kernel of the traced step: its ``kind`` (:data:`KINDS`), FLOPs and bytes read and written; a matmul's
    ``dims`` (batch, m, k, n: a batch of [m, k] x [k, n]) where its arguments give them (mm, addmm, bmm, baddbmm),
    else empty (a convolution, a grouped matmul: costed by its FLOPs alone)."""

    kind: str
    flops: int
    bytes: int
    dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class KernelRates:
    """A device's rates for the op-level compute (a preset's ``kernels`` node): ``matmul_flops`` (the largest
    measured matmul FLOP/s in the compute dtype), ``peak_flops`` (the datasheet's, for attention),
    ``attention_efficiency`` (FlashAttention's share of the peak), ``memory_Bps`` (HBM bandwidth), ``launch_s`` (a
    kernel launch)."""

    matmul_flops: float
    peak_flops: float
    attention_efficiency: float
    memory_Bps: float
    launch_s: float

    def seconds(self, op: OpCost) -> float:
        """One kernel's seconds (:func:`op_seconds`)."""
        return op_seconds(op, self)


def op_seconds(op: OpCost, rates: KernelRates) -> float:
    """One kernel's seconds: its work by its kind (the roofline: the longer of its FLOPs at its rate and its bytes
    at HBM bandwidth), never below a launch."""
    moved = op.bytes / rates.memory_Bps
    if op.kind == "matmul":
        work = max(op.flops / rates.matmul_flops, moved)
    elif op.kind == "attention":  # its FLOPs are matmuls': never above the matmul rate
        work = max(op.flops / min(rates.peak_flops * rates.attention_efficiency, rates.matmul_flops), moved)
    else:
        work = moved
    return max(work, rates.launch_s)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``ys`` over increasing ``xs`` at ``x``, held at the ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


@dataclass(frozen=True)
class MeasuredKernels:
    """A calibrated machine's operation times (a calibration's ``compute.kernels``): ``torch.mm``'s seconds over the
    grid ``matmul_dims`` x ``matmul_dims`` x ``matmul_dims`` (``matmul_seconds[i][j][l]`` at m, k, n =
    dims[i], dims[j], dims[l]) and ``torch.add``'s over ``memory_bytes`` moved (two inputs and the output), each a
    call's whole time; :meth:`seconds` is an operation's work beyond the smallest call (its dispatch, priced per
    operator apart: ``*_fixed_s`` and ``*_s_per_op``, a forward's and a backward's, from the operator stacks)."""

    matmul_dims: tuple[int, ...]
    matmul_seconds: tuple[tuple[tuple[float, ...], ...], ...]
    memory_bytes: tuple[int, ...]
    memory_seconds: tuple[float, ...]
    #: a forward's and a backward's dispatch: a call's fixed seconds and seconds per operator (the operator stacks')
    forward_fixed_s: float = 0.0
    forward_s_per_op: float = 0.0
    backward_fixed_s: float = 0.0
    backward_s_per_op: float = 0.0

    def _matmul(self, m: int, k: int, n: int) -> float:
        """A call of [m, k] x [k, n]: trilinear in the logarithms of the dimensions and of the time; a dimension
        beyond the grid's largest scales the time by its share of the work (the rate held), below the smallest as
        the smallest."""
        logs = [math.log(d) for d in self.matmul_dims]
        scale, at = 1.0, []
        for d in (m, k, n):
            top = self.matmul_dims[-1]
            scale *= max(d, top) / top
            at.append(math.log(min(max(d, self.matmul_dims[0]), top)))
        bounds = []
        for x in at:
            i = max(1, min(len(logs) - 1, next((j for j, v in enumerate(logs) if v >= x), len(logs) - 1)))
            bounds.append((i - 1, i, 0.0 if logs[i] == logs[i - 1] else (x - logs[i - 1]) / (logs[i] - logs[i - 1])))
        total = 0.0
        for corner in range(8):
            weight, idx = 1.0, []
            for axis, (lo, hi, w) in enumerate(bounds):
                up = corner >> axis & 1
                weight *= w if up else 1 - w
                idx.append(hi if up else lo)
            if weight:
                total += weight * math.log(self.matmul_seconds[idx[0]][idx[1]][idx[2]])
        return scale * math.exp(total)

    def seconds(self, op: OpCost) -> float:
        """The work of one operation beyond its dispatch: a matmul (an attention kernel: its FLOPs as a square
        matmul's, as the CPU's flash kernel tiles them) by the grid (a batch as that many calls' work; without its
        dims as the cube of its FLOPs), anything else by its bytes moved."""
        if op.kind in ("matmul", "attention"):
            if len(op.dims) == 4:
                batch, m, k, n = op.dims
            else:
                batch, side = 1, max(1, round((op.flops / 2) ** (1 / 3)))
                m = k = n = side
            smallest = self.matmul_seconds[0][0][0]
            return batch * max(0.0, self._matmul(m, k, n) - smallest)
        at = _interpolate([math.log(b) for b in self.memory_bytes], [math.log(s) for s in self.memory_seconds],
                          math.log(max(op.bytes, 1)))
        beyond = max(1.0, op.bytes / self.memory_bytes[-1])  # past the largest size: its bandwidth held
        return max(0.0, beyond * math.exp(at) - self.memory_seconds[0])


def ops_seconds(ops: Mapping[OpCost, int] | Iterable[OpCost], rates: KernelRates | MeasuredKernels
                ) -> dict[str, float]:
    """Seconds by kind over ``ops`` (each kernel with its count, or each once), and ``kernels``, their number."""
    counts = ops if isinstance(ops, Mapping) else Counter(ops)
    out = dict.fromkeys(KINDS, 0.0)
    for op, n in counts.items():
        out[op.kind] += n * rates.seconds(op)
    out["kernels"] = float(sum(counts.values()))
    return out
