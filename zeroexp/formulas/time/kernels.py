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
and beyond it), less the smallest's. A CPU computes what a GPU streams: an operation of :data:`POINTWISE` (GELU, SiLU,
softmax, layer norm, and their backward) costs its own time over bytes moved (schema 11: measured on a 2-core host,
``gelu`` of 65,536 elements 40 us where ``torch.add`` moving its 512 KiB takes about 10), and the fused attention
kernel its own work per head at its sequence length and head dimension (``attention``: the CPU's flash kernel at
head dimension 16 ran at a ninth of the rate of a square matmul of its FLOPs); a pointwise operation less its
smallest call's time, the attention kernel its calls' slope over two head counts (their intercept is the call's own
cost).
"""

from __future__ import annotations

from collections import Counter
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

__all__ = ["KINDS", "POINTWISE", "ATTENTION", "ATTENTION_CALLS", "attention_name", "KernelRates", "MeasuredKernels",
           "OpCost", "op_seconds", "ops_seconds"]

#: The kinds of operation the step's compute is split into.
KINDS = ("matmul", "attention", "memory")
#: The ATen operations (their overload packets' names) of kind ``memory`` a calibration times on their own (schema 11,
#: ``compute.kernels.pointwise``): on a CPU their arithmetic (erf, exp, a row's reduction), not their bytes, sets their
#: time. Elsewhere (a GPU preset, an older calibration) they cost their bytes as every ``memory`` operation.
POINTWISE = ("gelu", "gelu_backward", "silu", "silu_backward", "_softmax", "_softmax_backward_data", "_log_softmax",
             "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward")
#: The names an attention kernel's :class:`OpCost` carries (forward or backward, causal or not: :func:`attention_name`)
#: where a calibration times the fused kernel at its shapes (schema 11, ``compute.kernels.attention``).
ATTENTION = ("attention_forward", "attention_backward")


def attention_name(backward: bool, causal: bool) -> str:
    """The name of a fused attention call (:data:`ATTENTION`, ``_causal`` appended where it is)."""
    return ATTENTION[int(backward)] + ("_causal" if causal else "")


#: Every attention call a calibration times: (its name, backward, causal).
ATTENTION_CALLS = tuple((attention_name(b, c), b, c) for b in (False, True) for c in (False, True))


@dataclass(frozen=True)
class OpCost:
    """One kernel of the traced step: its ``kind`` (:data:`KINDS`), FLOPs and bytes read and written; a matmul's
    ``dims`` (batch, m, k, n: a batch of [m, k] x [k, n]) where its arguments give them (mm, addmm, bmm, baddbmm),
    an attention kernel's (batch x heads, query length, key length, head dimension), else empty (a convolution, a
    grouped matmul: costed by its FLOPs alone); ``name``: an operation of :data:`POINTWISE` its ATen name, an
    attention kernel one of :data:`ATTENTION` (``_causal`` appended where it is), else empty."""

    kind: str
    flops: int
    bytes: int
    dims: tuple[int, ...] = ()
    name: str = ""


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
    #: schema 11: each operation of :data:`POINTWISE` timed, ``(name, bytes moved, seconds a call)``
    pointwise: tuple[tuple[str, tuple[int, ...], tuple[float, ...]], ...] = ()
    #: schema 11: the fused attention kernel over ``attention_seq`` x ``attention_dims`` (query and key length, head
    #: dimension) at each of the two batch x heads counts ``attention_heads``, ``attention_seconds[name][h][i][j]``
    #: a call (names of :data:`ATTENTION`, with ``_causal``)
    attention_heads: tuple[int, ...] = ()
    attention_seq: tuple[int, ...] = ()
    attention_dims: tuple[int, ...] = ()
    attention_seconds: tuple[tuple[str, tuple[tuple[tuple[float, ...], ...], ...]], ...] = ()

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
        """The work of one operation beyond its dispatch: an attention kernel the table times (schema 11) by its work
        per head (:meth:`_attention`); a matmul (an attention kernel without a table: its FLOPs as a square matmul's)
        by the grid (a batch as that many calls' work; without its dims as the cube of its FLOPs); a pointwise
        operation with a table by its own curve of bytes moved, anything else by ``torch.add``'s."""
        if op.kind == "attention" and len(op.dims) == 4 and op.name in dict(self.attention_seconds):
            return self._attention(op)
        if op.kind in ("matmul", "attention"):
            if op.kind == "matmul" and len(op.dims) == 4:
                batch, m, k, n = op.dims
            else:
                batch, side = 1, max(1, round((op.flops / 2) ** (1 / 3)))
                m = k = n = side
            smallest = self.matmul_seconds[0][0][0]
            return batch * max(0.0, self._matmul(m, k, n) - smallest)
        nbytes, seconds = next(((b, t) for name, b, t in self.pointwise if name == op.name),
                               (self.memory_bytes, self.memory_seconds))
        at = _interpolate([math.log(b) for b in nbytes], [math.log(s) for s in seconds], math.log(max(op.bytes, 1)))
        beyond = max(1.0, op.bytes / nbytes[-1])  # past the largest size: its bandwidth held
        return max(0.0, beyond * math.exp(at) - seconds[0])

    def _attention(self, op: OpCost) -> float:
        """A fused attention call beyond its dispatch: per head, the slope of the measured calls between the fewest
        and the most batch x heads measured (its intercept, the call's own cost, is dispatch: priced per operator
        apart; a slope noise makes negative is 0), at each measured sequence length and head dimension, interpolated
        in the logarithms at the call's (bilinear, at the grid's nearest within it), then scaled by the work's share
        (queries x keys x head dimension, against the square call at those nearest) and times its batch x heads."""
        heads, seq, keys, dim = op.dims
        grids = dict(self.attention_seconds)[op.name]
        spread = self.attention_heads[-1] - self.attention_heads[0]
        slopes = [[max((b - a) / spread, 1e-15) for a, b in zip(low, high)] for low, high in zip(grids[0], grids[-1])]
        near_s = min(max(seq, self.attention_seq[0]), self.attention_seq[-1])
        near_d = min(max(dim, self.attention_dims[0]), self.attention_dims[-1])
        logs_d = [math.log(x) for x in self.attention_dims]
        rows = [_interpolate(logs_d, [math.log(t) for t in row], math.log(near_d)) for row in slopes]
        per_head = math.exp(_interpolate([math.log(x) for x in self.attention_seq], rows, math.log(near_s)))
        return heads * per_head * (seq * keys * dim) / (near_s * near_s * near_d)


def ops_seconds(ops: Mapping[OpCost, int] | Iterable[OpCost], rates: KernelRates | MeasuredKernels
                ) -> dict[str, float]:
    """Seconds by kind over ``ops`` (each kernel with its count, or each once), and ``kernels``, their number."""
    counts = ops if isinstance(ops, Mapping) else Counter(ops)
    out = dict.fromkeys(KINDS, 0.0)
    for op, n in counts.items():
        out[op.kind] += n * rates.seconds(op)
    out["kernels"] = float(sum(counts.values()))
    return out
