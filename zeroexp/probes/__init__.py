"""Probes: independent measurements taken on every rank as Lightning callbacks.

Each probe keeps rank-local records while the cell trains, returns them as a JSON-able dict
(:meth:`Probe.rank_result`), and turns the records of all ranks into one :class:`ProbeReport`
(a ``summary.json`` section, per-rank tables written as CSV files, and flat metrics for W&B).
Probes never import strategy adapters; the runner hands them what the adapter knows.

:data:`REGISTRY` lists every probe, in the order of their sections in ``summary.json``; the schedule, the run,
the dry run, the digest and the report loop over it (each probe class declares its part: ``zeroexp.probes.base``).
"""

from zeroexp.probes.base import Probe, ProbeReport, RunContext, Steps, as_callback
from zeroexp.probes.iterations import IterationsProbe
from zeroexp.probes.state import StateProbe
from zeroexp.probes.collectives import CollectivesProbe
from zeroexp.probes.memory import MemoryProbe
from zeroexp.probes.timing import TimingProbe
from zeroexp.probes.equivalence import EquivalenceProbe
from zeroexp.probes.grad_norm import GradNormProbe
from zeroexp.probes.checkpoint import CheckpointProbe

__all__ = ["Probe", "ProbeReport", "RunContext", "Steps", "as_callback", "REGISTRY", "registry", "IterationsProbe",
           "StateProbe", "CollectivesProbe", "MemoryProbe", "TimingProbe", "EquivalenceProbe",
           "GradNormProbe", "CheckpointProbe",
           "default_probes", "probes_for", "absent_in_dry_run"]


#: Every probe, in the order their sections appear in ``summary.json``; the checkpoint probe last (its
#: ``on_train_end`` runs after the equivalence probe's).
REGISTRY: tuple[type[Probe], ...] = (IterationsProbe, StateProbe, CollectivesProbe, MemoryProbe, TimingProbe,
                                     EquivalenceProbe, GradNormProbe, CheckpointProbe)


def registry() -> list[type[Probe]]:
    """Every registered probe (:data:`REGISTRY`)."""
    return list(REGISTRY)


def default_probes() -> list[type[Probe]]:
    """The probes every cell runs (``Probe.always``), in ``summary.json`` order."""
    return [p for p in REGISTRY if p.always]


def probes_for(cell) -> list[type[Probe]]:
    """The probes of this cell, in ``summary.json`` order: each registered probe whose :meth:`Probe.runs` says
    so (the checkpoint probe with ``checkpoint`` other than ``none``)."""
    return [p for p in REGISTRY if p.runs(cell)]


def absent_in_dry_run(cell=None) -> dict[str, str]:
    """``{probe: why}`` for the probes of a cell (default: :func:`default_probes`) that a dry run leaves out."""
    probes = default_probes() if cell is None else probes_for(cell)
    return {p.name: p.dry_run_absent for p in probes if p.dry_run_absent}
