"""The :class:`Report` of a sweep, the one object every renderer reads (Markdown, HTML, W&B).

A leaf of the report package: ``zeroexp.report`` builds it, ``zeroexp.report.pages`` and
``zeroexp.report.wandb_run`` read it, and none of them imports the package's ``__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from zeroexp.results.section import ReportTable
from zeroexp.report.verdicts import Verdicts
from zeroexp.report.winners import Winners

__all__ = ["Report"]


@dataclass
class Report:
    """A sweep's report: its cells (ladder order), tables, verdicts, what won, plots and the files written."""

    sweep_dir: Path
    cells: pd.DataFrame
    tables: list[ReportTable]
    verdicts: Verdicts
    generated_at: str
    environment: str
    winners: Winners = field(default_factory=Winners)
    plots: list[tuple[str, str, str]] = field(default_factory=list)  # (file name in sweep_dir, caption, table key)
    files: list[Path] = field(default_factory=list)
    wandb_run_dir: Path | None = None
    wandb_error: str | None = None

    def table(self, key: str) -> ReportTable:
        """The table named ``key`` (``state``, ``memory``, ``collectives``, ``timing``, ``equivalence``, ...)."""
        return next(t for t in self.tables if t.key == key)
