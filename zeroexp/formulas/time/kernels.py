"""A GPU step's compute from the operations it runs: each kernel of the traced forward and backward costed by its
FLOPs and bytes on the device (a roofline [ROOFLINE], :mod:`zeroexp.formulas.time.rates`), not 6 x parameters x
tokens at an assumed efficiency.

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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["KINDS", "KernelRates", "OpCost", "op_seconds", "ops_seconds"]

#: The kinds of operation the step's compute is split into.
KINDS = ("matmul", "attention", "memory")


@dataclass(frozen=True)
class OpCost:
    """One kernel of the traced step: its ``kind`` (:data:`KINDS`), FLOPs and bytes read and written."""

    kind: str
    flops: int
    bytes: int


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


def ops_seconds(ops: Mapping[OpCost, int] | Iterable[OpCost], rates: KernelRates) -> dict[str, float]:
    """Seconds by kind over ``ops`` (each kernel with its count, or each once), and ``kernels``, their number."""
    counts = ops if isinstance(ops, Mapping) else Counter(ops)
    out = dict.fromkeys(KINDS, 0.0)
    for op, n in counts.items():
        out[op.kind] += n * op_seconds(op, rates)
    out["kernels"] = float(sum(counts.values()))
    return out
