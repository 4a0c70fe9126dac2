"""What a step costs beyond the bare forward, backward and AdamW and beyond its collectives: the framework's own
work, from calibrated primitives applied through the groups.

A calibration (``python -m zeroexp.calibrate``, apart from the cells) measures each primitive once
(:class:`FrameworkCost`); this module says how many of each a step of a row makes, read off the same groups the
peak model and the collectives check use. Nothing here is fitted to a cell or a strategy's step time.

- **The loop** (every row): the training loop's own per-step work (Lightning's hooks, closure), measured on a
  trivial model as the loop's step less the same model's bare step; a cell's ``self.log`` of the loss runs only under
  ``logger=csv`` (``Cell.logs_loss``) and is not in this term.
- **Per collective call of a wrapper** (its hooks, bookkeeping, handoffs to the backend's thread, and the passes
  over the call's bytes it makes beyond the call itself): measured as the wrapper's step less the bare step less
  its calls timed alone, divided by its calls, on two models of 8 square Linear units: a tiny one (16 x 16, where
  compute and bytes are negligible: the per-call cost) and a wide one (512 x 512, 1 MiB a unit: with the tiny one,
  the cost per byte of the call's payload). DDP per bucket (``torch/nn/parallel/distributed.py``, reducer.cpp: the
  gradients copied into the bucket, divided, copied back), ZeroRedundancyOptimizer per broadcast
  (``torch/distributed/optim/zero_redundancy_optimizer.py``), FSDP1 per all_gather or reduce_scatter
  (``torch/distributed/fsdp/_runtime_utils.py``), apart with ``use_orig_params=True`` (``fsdp1_orig_call``: each
  gather and reshard also sets every original parameter's view). A call of ``S`` bytes costs ``<path>_s + S x
  <path>_s_per_byte``. Measured on the 2-core host (AMD EPYC, N=2, gloo, 2026-12-01): DDP's extra beyond the
  bare step and one lone all_reduce was ~0 on the tiny model and 5.1 ms for an 8 MiB bucket, 11.3-12.2 ms for an
  18 MiB one (0.6 ns a byte at both); FSDP1's per call 0.7-0.8 ms tiny, 1.0-1.1 ms at 0.25-2.25 MiB units (before
  each call's waking and floor are taken out).
- **FSDP2** (``torch/distributed/fsdp/_fully_shard/``): per all_gather or reduce_scatter of a unit, its pre- and
  post-forward and -backward hooks and the copy-in / copy-out of the unit's parameters and gradients into and out of
  the collective's flat buffer (``_fsdp_collectives.py``: ``foreach_all_gather``, ``foreach_all_gather_copy_out``,
  ``foreach_reduce``), ``fsdp2_call_s`` per call + ``fsdp2_call_s_per_byte`` per byte of its payload, measured as
  FSDP1's on the same two models (net of the optimizer's DTensor cost below); and AdamW's step over DTensor
  parameters, ``dtensor_param_step_s`` per parameter beyond the same step over plain tensors of the same shapes (each
  of the step's per-parameter ops goes through DTensor's dispatch: sharding propagation, then the local op), measured
  as the rank's thread CPU time of the two steps side by side on 64 small parameters.
- **DeepSpeed's ZeRO engine** (stages 1 and 2: ``deepspeed/runtime/zero/stage_1_and_2.py``'s
  ``DeepSpeedZeroOptimizer``), per step: its backward hooks filling the contiguous gradient buffer, the reduction's
  bookkeeping, the gradient norm's pass, the fp32 partition's step and its copy back before the all-gather,
  ``deepspeed_step_s`` + the model's fp32 parameter bytes x ``deepspeed_step_s_per_byte``, measured as the wrappers'
  (the engine's step less the bare step less its collectives, recorded on a warm step and replayed alone) on the same
  two models (:mod:`zeroexp.calibrate.deepspeed_engine`). Measured on the 2-core host (N=2, 2026-12-07): the tiny
  model's DeepSpeed step 6.3 ms beside the bare step's 1.3 and its three calls (the gradients' all_reduce, a 4-byte
  all_reduce, the parameters' all_gather); the wide one's 65 ms beside 21.
- **Copies between warm buffers**, per byte: FSDP1 concatenates each unit's per-parameter gradients into its
  unsharded gradient in backward (the views' ``SplitWithSizesBackward``, a new tensor) and pre-divides it in place
  (``_div_if_needed``): two passes over the unit; zeroexp's ZeRO-2 zeroes each bucket's flat gradient
  (``torch.zeros_like`` at its first ready gradient) and autograd accumulates every gradient into it: two passes.
  Measured beside a warm copy (2-core host, N=2, 8 x 768^2, torch profiler): FSDP1's concatenation ran at
  0.1-0.2 ns a byte, a warm copy's rate, while a fresh 64 MiB mapping filled at 1.5-3 ns a byte: glibc reuses its
  heap for these sizes, so no page-fault term. The wide FSDP1 measurement is taken net of these copies (they are
  this term, not its per-byte cost). DDP's bucket copies are in its per-byte cost, not here.

The calibration's compute (bare forward, backward, AdamW with ``zero_grad(set_to_none=True)``) already contains
autograd's fresh parameter gradients; its collectives write into warm output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroexp.formulas.layout import Groups, StateLayout

__all__ = ["FrameworkCost", "FrameworkTime", "framework_time", "PER_CALL_PATHS", "SCHEMA_7_TERMS"]

#: The wrappers whose per-call cost the calibration measures, by the groups that say how many calls a step makes.
PER_CALL_PATHS = ("ddp_bucket", "zro_broadcast", "fsdp1_call", "fsdp1_orig_call", "fsdp2_call")
#: The calibrated terms a calibration before schema 7 lacks (read as 0: FSDP2's own costs).
SCHEMA_7_TERMS = ("fsdp2_call_s", "fsdp2_call_s_per_byte", "dtensor_param_step_s")


@dataclass(frozen=True)
class FrameworkCost:
    """Calibrated primitives (seconds): ``loop_s`` per step; per call of each path of :data:`PER_CALL_PATHS`, and
    per byte of that call's payload (``<path>_s_per_byte``, 0 in calibrations before schema 6); ``copy_s_per_byte``
    between warm buffers; ``dtensor_param_step_s`` per DTensor parameter of AdamW's step (FSDP2's terms: 0 in
    calibrations before schema 7)."""

    loop_s: float = 0.0
    ddp_bucket_s: float = 0.0
    zro_broadcast_s: float = 0.0
    fsdp1_call_s: float = 0.0
    copy_s_per_byte: float = 0.0
    ddp_bucket_s_per_byte: float = 0.0
    zro_broadcast_s_per_byte: float = 0.0
    fsdp1_call_s_per_byte: float = 0.0
    fsdp2_call_s: float = 0.0
    fsdp2_call_s_per_byte: float = 0.0
    dtensor_param_step_s: float = 0.0
    #: FSDP1 keeping its original parameters (``use_orig_params=True``: each gather and reshard also points every
    #: original parameter at its view, ``_flat_param.py``'s ``_use_unsharded_views`` / ``_use_sharded_views``);
    #: None: not calibrated (a calibration before it: such a cell is timed with the flat parameters' cost and says so)
    fsdp1_orig_call_s: float | None = None
    fsdp1_orig_call_s_per_byte: float | None = None
    #: DeepSpeed's ZeRO engine (stages 1 and 2) a step beyond its collectives, and per byte of the model's fp32
    #: parameters; None: not calibrated (before schema 10, or DeepSpeed not installed where it was made)
    deepspeed_step_s: float | None = None
    deepspeed_step_s_per_byte: float | None = None

    def call_s(self, path: str, nbytes: float) -> float:
        """One call of ``path`` (:data:`PER_CALL_PATHS`) with a payload of ``nbytes``."""
        return (getattr(self, f"{path}_s") or 0.0) + nbytes * (getattr(self, f"{path}_s_per_byte") or 0.0)


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


def framework_time(layout: StateLayout, groups: Groups, itemsize: int, cost: FrameworkCost,
                   orig_params: bool = False) -> FrameworkTime:
    """The framework's seconds of one step of ``layout`` over ``groups`` (the module's terms), placed in the phase
    where they run: the loop after the optimizer; DDP's bucket calls in backward; ZeroRedundancyOptimizer's
    broadcasts after the step; FSDP1's forward gathers in forward, its backward gathers, reduce_scatters and gradient
    copies in backward; FSDP2's calls likewise (its copy-in / copy-out in its per-byte cost) and its DTensor
    parameters' optimizer step after backward; ZeRO-2's bucket copies in backward. ``orig_params``: FSDP1 keeps its
    original parameters (``use_orig_params=True``), its calls at that path's cost."""
    terms: dict[str, float] = {"loop": cost.loop_s}
    f = b = 0.0
    o = cost.loop_s
    notes: list[str] = []
    df, db, do = layout.family.framework_terms(layout, groups, itemsize, cost, orig_params, terms, notes)
    f, b, o = f + df, b + db, o + do
    return FrameworkTime(f, b, o, terms, tuple(notes))
