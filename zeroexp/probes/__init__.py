"""Probes: independent measurements taken on every rank as Lightning callbacks.

Each probe keeps rank-local records while the cell trains, returns them as a JSON-able dict
(:meth:`Probe.rank_result`), and turns the records of all ranks into one :class:`ProbeReport`
(a ``summary.json`` section, per-rank tables written as CSV files, and flat metrics for W&B).
Probes never import strategy adapters; the runner hands them what the adapter knows.
"""

from zeroexp.probes.base import Probe, ProbeReport, RunContext
from zeroexp.probes.iterations import IterationsProbe
from zeroexp.probes.state import StateProbe
from zeroexp.probes.collectives import CollectivesProbe
from zeroexp.probes.memory import MemoryProbe
from zeroexp.probes.timing import TimingProbe
from zeroexp.probes.equivalence import EquivalenceProbe
from zeroexp.probes.checkpoint import CheckpointProbe

__all__ = ["Probe", "ProbeReport", "RunContext", "IterationsProbe", "StateProbe", "CollectivesProbe", "MemoryProbe",
           "TimingProbe", "EquivalenceProbe", "CheckpointProbe", "default_probes", "probes_for"]


def default_probes() -> list[type[Probe]]:
    """The probes every cell runs, in the order their sections appear in ``summary.json``."""
    return [IterationsProbe, StateProbe, CollectivesProbe, MemoryProbe, TimingProbe, EquivalenceProbe]


def probes_for(cfg) -> list[type[Probe]]:
    """The probes of this cell: :func:`default_probes`, then the checkpoint probe with ``checkpoint`` other than
    ``none`` (last: its ``on_train_end`` runs after the equivalence probe's)."""
    extra = [CheckpointProbe] if cfg.get("checkpoint") is not None and cfg.checkpoint.name != "none" else []
    return default_probes() + extra
