"""What a checkpoint's save and load hold above what the rank held when each began (``checkpoint=full|sharded``).

The terms torch's state-dict API and torch.distributed.checkpoint allocate (torch/distributed/checkpoint/state_dict.py,
_state_dict_utils.py; the families that model their own, :meth:`Family.checkpoint_peaks`):

- **the zero step** (``_init_optim_state``): a load first gives every trainable parameter a zero gradient and steps
  AdamW at lr 0, so the optimizer holds its state before it is overwritten: the rank's gradients, both moments of
  every trainable parameter (one no step graded too), each parameter's ``step`` and AdamW's temporaries
  (zeroexp.formulas.peak.adamw, the device's update path); the gradients are freed after it.
- **a full load** reads the whole file on every rank (``torch.load``: every tensor of it, the tied names a family
  gathered apart included) and hands it to ``set_state_dict``: each tensor the rank holds is made from it
  (``_distribute_state_dict``: ``distribute_tensor`` for a DTensor, ``.to(device)`` otherwise, a no-op for a CPU
  tensor on the CPU) and kept until the load ends, the moments beside the zero step's until the optimizer takes them.
- **a full save** makes the state whole on rank 0 (``full_state_dict=True, cpu_offload=True``): a DTensor gathered
  into a new tensor (padded like the shards, a view into it where padding was cut), a local tensor copied to the
  host where it is not there already; zeroexp then copies each view into a tensor of its own size before torch.save
  (zeroexp.strategies._checkpoint.compact).
- **a sharded save** writes each rank's tensors where they lie: no state is copied on the CPU. A sharded load fills
  the zero step's tensors in place (``torch.distributed.checkpoint.load``), after the zero step: its peak is the zero
  step's, or the moments beside DCP's planning objects where those are larger (a model with few trainable elements).

Not sized (a prediction that leaves them out is a lower bound: ``exact`` False for the rank and phase): the pickled
save plans and metadata torch.distributed.checkpoint exchanges (``gather_object``, ``scatter_object_list``,
``broadcast_object_list``), the transients of gathering one tensor on the ranks that do not keep it (its padded
input, the backend's staging), the host staging of a device tensor DCP writes or reads.

Device and host: on the CPU every term is the tracked device's (what the checkpoint probe measures); on an
accelerator (``DeviceSemantics.name == "cuda"``) ``ranks`` are the device's bytes and ``host`` the host memory each rank
holds at the phase's peak (computed only: the probe measures the device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from zeroexp.formulas.device import DeviceSemantics
from zeroexp.formulas.layout import MASTER_BYTES, STEP_BYTES
from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.allocator import counted, counted_sum

__all__ = ["PhasePeak", "CheckpointPeaks", "ZeroStep", "zero_step", "step_bytes", "full_load", "phase", "UNSIZED"]

#: What a lower bound leaves out, by code (module docstring).
UNSIZED = {
    "dcp_objects": "torch.distributed.checkpoint's pickled save plans and metadata",
    "dcp_copies": "torch.distributed.checkpoint's copy of each tensor it writes that is a view into a larger storage",
    "gather_transients": "the transients of gathering one tensor on a rank that does not keep it (its padded input, "
                         "the backend's staging)",
    "flat_state": "FSDP1's own copies while it makes its optimizer state whole or sharded (all-gathered flat moments)",
    "engine_state": "what DeepSpeed allocates beside the state it gathers or reads (its bookkeeping, the other "
                 "moments of a parameter, the fresh engine's state)",
    "objects": "the pickled optimizer state ZeroRedundancyOptimizer broadcasts, beyond its tensors' bytes",
    "uneven_chunk": "one padded chunk more, measured on an FSDP2 full load where a parameter's rows do not divide "
                    "over the shard group: an allocation not found yet",
    "accelerator": "the terms on an accelerator: no GPU cell has measured them yet",
}


@dataclass(frozen=True)
class PhasePeak:
    """One phase (save or load) of one checkpoint kind: per rank, the bytes above the phase's start on the tracked
    device (``ranks``), the host bytes held at its peak (``host``; None on the CPU, where they are in ``ranks``),
    whether every allocation is sized (``exact``; else a lower bound, ``unsized`` naming what it leaves out:
    :data:`UNSIZED`'s codes) and rank 0's terms by name."""

    ranks: tuple[int, ...]
    exact: tuple[bool, ...]
    host: tuple[int, ...] | None = None
    unsized: tuple[str, ...] = ()
    terms: dict[str, int] = field(default_factory=dict)

    def record(self) -> dict[str, object]:
        return {"rank_bytes": list(self.ranks), "exact": list(self.exact),
                "host_rank_bytes": None if self.host is None else list(self.host),
                "unsized": [UNSIZED[c] for c in self.unsized], "rank0_terms": dict(self.terms)}


@dataclass(frozen=True)
class CheckpointPeaks:
    """Save and load of one kind."""

    kind: str
    save: PhasePeak
    load: PhasePeak

    def record(self) -> dict[str, object]:
        return {"kind": self.kind, "save": self.save.record(), "load": self.load.record()}


@dataclass(frozen=True)
class ZeroStep:
    """The zero step's terms on one rank (module docstring), bytes."""

    grads: int
    moments: int
    steps: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.grads + self.moments + self.steps + self.temporaries

    def terms(self) -> dict[str, int]:
        return {"grads": self.grads, "moments": self.moments, "steps": self.steps, "temporaries": self.temporaries}


def step_bytes(device: DeviceSemantics) -> int:
    """What one AdamW ``step`` adds to the tracked device: a 4-byte scalar on the CPU; on an accelerator a host scalar
    but where the update is fused (torch/optim/adam.py ``_init_group``: ``capturable`` or ``fused`` keep it on the
    parameter's device)."""
    return counted(STEP_BYTES, device.block) if device.name == "cpu" or device.foreach == "fused" else 0


@functools.lru_cache(maxsize=256)
def zero_step(numels: tuple[int, ...], device: DeviceSemantics) -> ZeroStep:
    """The zero step over the rank's trainable tensors (``numels``: each one's local elements, fp32 masters), each
    with its ``step`` (:func:`step_bytes`)."""
    b = device.block
    return ZeroStep(grads=counted_sum((k * MASTER_BYTES for k in numels), b),
                    moments=2 * counted_sum((k * MASTER_BYTES for k in numels), b),
                    steps=step_bytes(device) * len(numels),
                    temporaries=adamw_temporaries(numels, MASTER_BYTES, device.foreach, b))


def full_load(file: int, made: int, zs: ZeroStep, moments_in: int) -> dict[str, int]:
    """A full load's terms on one rank (module docstring): the file read whole (``file``: its tensors' bytes; 0 where
    it sits on the host apart from the tracked device), the tensors made from it for the model (``made``: kept to the
    load's end), then the larger of the zero step (its gradients freed after it) and its moments beside those made for
    the optimizer (``moments_in``); the steps throughout."""
    optim = max(zs.grads + zs.moments + zs.temporaries, zs.moments + moments_in)
    return {"file": file, "model_made": made, "zero_step_or_moments": optim, "steps": zs.steps}


def phase(ranks: list[dict[str, int]], exact: list[bool], host: list[int] | None = None,
          unsized: tuple[str, ...] = ()) -> PhasePeak:
    """A :class:`PhasePeak` from each rank's terms (their sum is the rank's bytes)."""
    return PhasePeak(ranks=tuple(sum(t.values()) for t in ranks), exact=tuple(exact),
                     host=None if host is None else tuple(host), unsized=unsized, terms=dict(ranks[0]))
