"""What a step costs beyond the bare forward, backward and AdamW and beyond its collectives: the framework's own
work, from calibrated primitives applied through the groups.

A calibration (``python -m zeroexp.calibrate``, apart from the cells) measures each primitive once
(:class:`FrameworkCost`); this module says how many of each a step of a row makes, read off the same groups the
peak model and the collectives check use. Nothing here is fitted to a cell or a strategy's step time.

- **The loop** (every row): the training loop's own per-step work (Lightning's hooks, closure, ``self.log``),
  measured on a trivial model as the loop's step less the same model's bare step.
- **Per collective call of a wrapper** (its hooks, bookkeeping and handoffs to the backend's thread): measured on a
  tiny model (8 units of 16 x 16), where compute and bytes are negligible, as the wrapper's step less the bare step
  less its calls timed alone, divided by its calls: DDP per bucket (``torch/nn/parallel/distributed.py``,
  reducer.cpp), ZeroRedundancyOptimizer per broadcast (``torch/distributed/optim/zero_redundancy_optimizer.py``),
  FSDP1 per all_gather or reduce_scatter (``torch/distributed/fsdp/_runtime_utils.py``).
- **Copies between warm buffers**, per byte: FSDP1 concatenates each unit's per-parameter gradients into its
  unsharded gradient in backward (the views' ``SplitWithSizesBackward``, a new tensor) and pre-divides it in place
  (``_div_if_needed``): two passes over the unit; zeroexp's ZeRO-2 zeroes each bucket's flat gradient
  (``torch.zeros_like`` at its first ready gradient) and autograd accumulates every gradient into it: two passes.
  Measured beside a warm copy (2-core host, N=2, 8 x 768^2, torch profiler): FSDP1's concatenation ran at
  0.1-0.2 ns a byte, a warm copy's rate, while a fresh 64 MiB mapping filled at 1.5-3 ns a byte: glibc reuses its
  heap for these sizes, so no page-fault term. DDP's bucket copies are not a term: a bare DDP backward measured
  the bare backward plus one lone all_reduce of the gradients (19.5 ms = 4.7 + 14.8).

The calibration's compute (bare forward, backward, AdamW with ``zero_grad(set_to_none=True)``) already contains
autograd's fresh parameter gradients; its collectives write into warm output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroexp.formulas.layout import Groups, StateLayout

__all__ = ["FrameworkCost", "FrameworkTime", "framework_time", "PER_CALL_PATHS"]

#: The wrappers whose per-call cost the calibration measures, by the groups that say how many calls a step makes.
PER_CALL_PATHS = ("ddp_bucket", "zro_broadcast", "fsdp1_call")


@dataclass(frozen=True)
class FrameworkCost:
    """Calibrated primitives (seconds): ``loop_s`` per step; per call of each path of :data:`PER_CALL_PATHS`;
    ``copy_s_per_byte`` between warm buffers."""

    loop_s: float = 0.0
    ddp_bucket_s: float = 0.0
    zro_broadcast_s: float = 0.0
    fsdp1_call_s: float = 0.0
    copy_s_per_byte: float = 0.0


@dataclass(frozen=True)
class FrameworkTime:
    """A step's framework seconds by the compute phase they fall in, each term by name, and what is not modelled."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    terms: dict = field(default_factory=dict)
    notes: tuple = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def framework_time(layout: StateLayout, groups: Groups, itemsize: int, cost: FrameworkCost) -> FrameworkTime:
    """The framework's seconds of one step of ``layout`` over ``groups`` (the module's terms), placed in the phase
    where they run: the loop after the optimizer; DDP's bucket calls in backward; ZeroRedundancyOptimizer's
    broadcasts after the step; FSDP1's forward gathers in forward, its backward gathers, reduce_scatters and gradient
    copies in backward; ZeRO-2's bucket copies in backward."""
    terms: dict[str, float] = {"loop": cost.loop_s}
    f = b = 0.0
    o = cost.loop_s
    notes: list[str] = []
    kind = layout.groups
    if kind in ("none", "owners") and groups.buckets:
        terms["ddp_bucket_calls"] = cost.ddp_bucket_s * len(groups.buckets)
        b += terms["ddp_bucket_calls"]
        if groups.broadcasts:
            terms["zro_broadcast_calls"] = cost.zro_broadcast_s * len(groups.broadcasts)
            o += terms["zro_broadcast_calls"]
    elif kind == "units" and groups.units:
        units = groups.units
        backward_gathers = sum(1 for u in units if u.gathers >= 2)
        terms["fsdp1_forward_calls"] = cost.fsdp1_call_s * len(units)
        f += terms["fsdp1_forward_calls"]
        terms["fsdp1_backward_calls"] = cost.fsdp1_call_s * (backward_gathers + len(units))
        terms["fsdp1_gradient_copies"] = 2 * sum(u.numel for u in units) * itemsize * cost.copy_s_per_byte
        b += terms["fsdp1_backward_calls"] + terms["fsdp1_gradient_copies"]
    elif kind == "buckets" and groups.shards:
        if "grad" in layout.sharded:  # ZeRO-2: the bucket's flat gradient is zeroed anew and accumulated into
            terms["bucket_copies"] = 2 * sum(sh.numel for sh in groups.shards) * itemsize * cost.copy_s_per_byte
            b += terms["bucket_copies"]
        notes.append("zeroexp's ZeRO-1/2 hooks per bucket: no per-call cost calibrated")
    else:
        notes.append(f"groups {kind!r}: only the loop's cost is calibrated for this row")
    return FrameworkTime(f, b, o, terms, tuple(notes))
