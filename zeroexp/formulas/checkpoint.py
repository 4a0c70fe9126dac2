"""What a checkpoint of the training state holds and what each rank writes (``checkpoint=full|sharded``).

The state a checkpoint holds, by name (torch's state-dict layout, which every strategy's ``full`` checkpoint and the
``sharded`` one of DDP, FSDP1, FSDP2 and hybrids write; zeroexp.strategies._checkpoint):

- every trainable parameter's fp32 value (the master where the strategy keeps one: every precision of every strategy
  here trains fp32 masters, ``precision.master_dtype``), a parameter shared by two modules once (torch.save and
  torch.distributed.checkpoint store one storage once; a full checkpoint writes the one tensor under both names);
- every frozen parameter and buffer as the strategy holds it (``Groups.frozen`` at its at-rest dtype, ``Groups.buffers``
  in the dtype the row casts them to), but a buffer the state dict leaves out (``persistent=False``);
- AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32) and ``step`` (a 4-byte fp32 scalar tensor, torch.optim.AdamW with
  ``capturable=False``) of every parameter a step gave a gradient (``Groups.ungraded`` have none).

``full``: rank 0 gathers all of it and writes one file; the other ranks write nothing. ``sharded``, torch's layout
(torch.distributed.checkpoint): each item is written once over all ranks (a sharded tensor's shards by their ranks,
a replicated one by one rank that ``dedup_save_plans`` picks, the least loaded): the ranks together write the same
bytes as a full checkpoint, about 1/N each. ZeroRedundancyOptimizer's ``sharded`` (a layout of its own): rank 0
writes the module's state dict, each rank the optimizer state of the parameters it owns. DeepSpeed's ``sharded``
(its own files): each rank its padded flat partitions as it holds them (:func:`_deepspeed`). Bytes are the tensors'
payload: what the files hold besides (zip records, pickled structure, DCP's metadata) is serialization.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from zeroexp.formulas.checkpoint_peak import CheckpointPeaks
from zeroexp.formulas.device import DeviceSemantics
from zeroexp.formulas.families.base import StateLayout
from zeroexp.formulas.layout import MASTER_BYTES, MOMENT_BYTES, STEP_BYTES
from zeroexp.formulas.shapes import Groups, ModelShape, PlanKnobs

__all__ = ["StatePayload", "state_payload", "written_bytes", "alias_bytes", "checkpoint_peaks"]


@dataclass(frozen=True)
class StatePayload:
    """The tensors' bytes a checkpoint holds, by part."""

    params: int
    frozen: int
    buffers: int
    moments: int
    steps: int

    @property
    def total(self) -> int:
        return self.params + self.frozen + self.buffers + self.moments + self.steps

    def record(self) -> dict[str, int]:
        return {"params": self.params, "frozen": self.frozen, "buffers": self.buffers, "moments": self.moments,
                "steps": self.steps, "total": self.total}


def state_payload(layout: StateLayout, groups: Groups, itemsize: int, shape: ModelShape | None = None
                  ) -> StatePayload:
    """The state a checkpoint of ``layout`` over ``groups`` holds (module docstring), in bytes by part; ``shape``: the
    model's (the buffers its state dict leaves out, ``ModelShape.unsaved_buffers``; None: every buffer saved)."""
    idle = set(groups.ungraded)
    unsaved = set(shape.unsaved_buffers) if shape is not None else set()
    stepped = [k for i, k in enumerate(groups.numels) if i not in idle]
    return StatePayload(params=MASTER_BYTES * sum(groups.numels),
                        frozen=layout.at_rest_bytes(itemsize) * sum(groups.frozen),
                        buffers=sum(b for i, (_, b) in enumerate(groups.buffers) if i not in unsaved),
                        moments=MOMENT_BYTES * sum(stepped),
                        steps=STEP_BYTES * len(stepped))


def alias_bytes(layout: StateLayout, shape: ModelShape, itemsize: int) -> int:
    """The bytes of the parameters' names beyond their first (``ModelShape.aliases``), each its parameter's value
    again: what a writer that stores each state-dict name's tensor of its own writes twice."""
    trains = shape.trains or (True,) * len(shape.params)
    return sum(k * shape.numels[i] * (MASTER_BYTES if trains[i] else layout.at_rest_bytes(itemsize))
               for i, k in shape.aliases)


def written_bytes(layout: StateLayout, groups: Groups, itemsize: int, kind: str, shape: ModelShape | None = None,
                  knobs: PlanKnobs = PlanKnobs()) -> dict[str, object] | None:
    """What the ranks write for a ``kind`` checkpoint: ``layout`` (``full``; sharded: as the family writes it),
    ``total`` (all ranks), ``ranks`` (each rank's bytes; None
    where DCP's de-duplication picks the rank of a replicated item at run time: then only the total is exact),
    ``state`` (:meth:`StatePayload.record`) and ``aliases`` (a tied parameter's value again, once per name beyond its
    first: torch.distributed.checkpoint writes each name's item; a full checkpoint where the family gathers each name
    apart, ``Family.gathers_each_name``); None where not modelled. ``sharded``: as the row's family writes it
    (``Family.sharded_written``). ``shape``: the model's (its aliases; None: none)."""
    n = groups.world_size
    state = state_payload(layout, groups, itemsize, shape)
    again = 0 if shape is None else alias_bytes(layout, shape, itemsize)
    if kind == "full":
        total = state.total + (again if layout.family.gathers_each_name else 0)
        return {"layout": "full", "total": total, "ranks": [total] + [0] * (n - 1), "state": state.record(),
                "aliases": total - state.total}
    return layout.family.sharded_written(layout, groups, itemsize, knobs, state, again)


def checkpoint_peaks(layout: StateLayout, groups: Groups, itemsize: int, kind: str, shape: ModelShape,
                     device: DeviceSemantics, knobs: PlanKnobs = PlanKnobs()) -> CheckpointPeaks | None:
    """What a ``kind`` checkpoint's save and load hold on each rank above what it held before
    (zeroexp.formulas.checkpoint_peak, as the row's family answers it, ``Family.checkpoint_peaks``); None: not
    modelled. ``device``: where the ranks run (on the CPU, the host's bytes are the tracked device's)."""
    full = written_bytes(layout, groups, itemsize, "full", shape, knobs)
    peaks = layout.family.checkpoint_peaks(layout, groups, shape, itemsize, kind, device, int(full["total"]),
                                           state_payload(layout, groups, itemsize, shape), knobs)
    if peaks is None or device.name == "cpu":
        return peaks
    # on an accelerator every figure is a lower bound until a GPU cell has measured the family's terms there
    return replace(peaks, **{ph: replace(p, exact=(False,) * len(p.ranks), unsized=(*p.unsized, "accelerator"))
                             for ph, p in (("save", peaks.save), ("load", peaks.load))})
