"""The probe interface and the one result schema every probe writes.

A probe is a plug-in: besides measuring (Lightning's callback hooks, run in a rank as :func:`as_callback`;
:meth:`Probe.rank_result`, :meth:`Probe.aggregate`) its class declares the steps it needs (:attr:`Probe.steps`, from
which ``zeroexp.cell.schedule.Schedule`` is assembled; a registered probe's is its entry of
``zeroexp.cell.schedule.PROBE_STEPS``, which the launching process reads without importing the probes), whether and
when it runs (:meth:`Probe.runs`), why it is absent from a dry run (:attr:`Probe.dry_run_absent`), its line in the
terminal digest (:meth:`Probe.digest_line`) and its section of the sweep report (:meth:`Probe.report_table`). The run,
the dry run, the digest and the report loop over ``zeroexp.probes.registry()``: a new probe is one module plus its test,
and one entry there (and one in ``PROBE_STEPS`` if it needs steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig

from zeroexp._lib.callbacks import as_callback
from zeroexp.cell.schedule import Steps

__all__ = ["Probe", "ProbeReport", "RunContext", "Steps", "as_callback"]


@dataclass(frozen=True)
class RunContext:
    """What a probe may know about the cell besides the model: config, rank, device, the adapter."""

    cfg: DictConfig
    rank: int
    world_size: int
    device: torch.device
    adapter: Any  # zeroexp.strategies.StrategyAdapter; typed loosely so probes do not import adapters
    schedule: Any  # zeroexp.cell.schedule.Schedule (which imports the probe registry)
    #: zeroexp.plan.check.expect.Expectation: the one expectation model for this cell (state factors, collectives)
    expect: Any = None
    #: zeroexp.cell.resolved.Cell: the cell as validation resolved it (what a probe reads of its settings)
    cell: Any = None


@dataclass
class ProbeReport:
    """A probe's contribution to the cell directory.

    ``section`` becomes ``summary.json[<probe name>]`` (omitted when empty); ``tables`` maps a file name in
    the cell directory to a pandas DataFrame with one row per rank (and per step or kind); ``top_level``
    holds the few fields that ``summary.json`` carries at its top level (``final_loss``).
    """

    section: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)


class Probe:
    """Base class: a measurement with Lightning's callback hooks (``setup``, ``on_train_batch_start``, ...), a
    rank-local result and an all-rank aggregation. A rank runs it as a Lightning callback
    (:func:`zeroexp._lib.callbacks.as_callback`); the class itself does not import Lightning, so the launching process
    reads its digest line and report section (the digest after a cell, the sweep report) without importing Lightning (4
    to 5 s on this 2-core host, after the cell had finished)."""

    name: ClassVar[str]
    #: The steps this probe owns or reads (:class:`Steps`), or None: it needs no step of its own.
    steps: ClassVar[Steps | None] = None
    #: Why this probe's section is absent from a dry run (``summary.json["dry_run"]["absent"]``); None: it runs
    #: in a traced dry run too, on the played rank 0.
    dry_run_absent: ClassVar[str | None] = None
    #: Where its digest line and report section sit among the others (ascending; the planner's ``plan``
    #: section is 70); ``report_order`` defaults to ``order``.
    order: ClassVar[int] = 100
    report_order: ClassVar[int | None] = None
    #: Every cell runs it; False for a probe that :meth:`runs` only when its config asks for it.
    always: ClassVar[bool] = True

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def sync_device(self) -> None:
        """Wait for the rank's device (CUDA kernels are asynchronous) before reading a clock; no-op on CPU."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    def rank_result(self) -> dict[str, Any]:
        """This rank's records, JSON-able; written to ``.ranks/rank<r>.json`` under the probe's name."""
        raise NotImplementedError

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cell: Any) -> ProbeReport:
        """Combine the ``rank_result`` of every rank (index = rank) into the cell's report (``cell``: the
        :class:`~zeroexp.cell.resolved.Cell`)."""
        raise NotImplementedError

    @classmethod
    def runs(cls, cell: Any) -> bool:
        """Whether this cell runs the probe: every cell when :attr:`always`; override it for a condition."""
        return cls.always

    @classmethod
    def in_dry_run(cls, cell: Any) -> bool:
        """Whether a traced dry run runs the probe on its played rank 0: every probe not absent from it."""
        return not cls.dry_run_absent

    @classmethod
    def derived(cls, ctx: RunContext, groups: Any) -> list[dict[str, Any]] | None:
        """Every rank's result as the one expectation model derives it from ``groups`` (a derived dry run: the
        strategy is not traced); None: the probe has no derived record (its section is absent)."""
        return None

    @classmethod
    def dry_report(cls, results: list[dict[str, Any]], cell: Any, source: str) -> ProbeReport | None:
        """The probe's report in a dry run (``source``: ``traced``, ``results`` the played rank 0's; ``derived``,
        every rank's from :meth:`derived`); None: absent, for the reason :attr:`dry_run_absent` gives."""
        return None

    @staticmethod
    def digest_line(section: dict[str, Any]) -> str | None:
        """What the probe found, in one line of the terminal digest, from its ``summary.json`` section; None: no
        line. A probe sets it to its line function: ``digest_line = staticmethod(state_line)``."""
        return None

    @staticmethod
    def report_table(ok: Any) -> Any:
        """Its section of the sweep report (a ``zeroexp.results.section.ReportTable``) over the finished cells
        (a DataFrame of ``zeroexp.results.files.load_sweep`` rows); None: no section. A probe sets it to its table
        function: ``report_table = staticmethod(state_table)``."""
        return None

