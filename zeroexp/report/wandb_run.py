"""The sweep's own W&B run: the report tables as ``wandb.Table``, the plots as ``wandb.Image``, the HTML report
in a panel and, with the other report files, as an artifact.

Its files land in ``<sweep>/wandb/`` (``wandb sync <sweep>/wandb/offline-run-*`` uploads it) and the staged
artifact files inside that run's directory, so that a sweep directory holds everything it needs to be synced.
The mode comes from the cells' logger config (``logger=wandb``, ``logger.mode=offline|online|disabled``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pandas as pd

from zeroexp.results.cells import column
from zeroexp.results.format import missing

if TYPE_CHECKING:
    from zeroexp.report.model import Report

__all__ = ["MODES", "wandb_settings", "log_sweep_run", "staging_dir"]

#: ``auto`` follows the cells' logger config; ``none`` makes no run.
MODES = ("auto", "offline", "online", "disabled", "none")


def wandb_settings(cells: pd.DataFrame, mode: str = "auto") -> dict[str, Any] | None:
    """``{"mode", "project", "entity"}`` for the sweep run, or None when there is to be no run.

    With ``mode="auto"``: the first cell that logged with ``logger=wandb`` gives mode, project and entity; a
    sweep whose cells used ``logger=none`` or ``csv`` gets no run. ``disabled`` and ``none`` give no run.
    """
    if mode not in MODES:
        raise ValueError(f"wandb mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode in ("none", "disabled"):
        return None
    wandb_cells = cells[column(cells, "config.logger.name") == "wandb"]
    first = wandb_cells.iloc[0] if len(wandb_cells) else None
    if first is None and mode == "auto":
        return None
    get = (lambda k, d=None: d if first is None or missing(first.get(k)) else first.get(k))
    chosen = get("config.logger.mode", "offline") if mode == "auto" else mode
    if chosen == "disabled":
        return None
    return {"mode": chosen, "project": get("config.logger.project", "zeroexp"), "entity": get("config.logger.entity")}


@contextlib.contextmanager
def staging_dir(path: Path) -> Iterator[None]:
    """Stage W&B artifact files under ``path`` (``WANDB_DATA_DIR``) for the duration, not in the home directory."""
    old = os.environ.get("WANDB_DATA_DIR")
    os.environ["WANDB_DATA_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WANDB_DATA_DIR", None)
        else:
            os.environ["WANDB_DATA_DIR"] = old


def _clear_previous(wandb_dir: Path) -> None:
    """A report is rebuilt whole: the report runs of an earlier build of this sweep are replaced."""
    for old in wandb_dir.glob("offline-run-*"):
        shutil.rmtree(old, ignore_errors=True)


def log_sweep_run(report: Report, settings: dict[str, Any]) -> Path:
    """Create the sweep's run, log the report into it, finish it; return the run's directory."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    sweep = report.sweep_dir.name
    _clear_previous(report.sweep_dir / "wandb")
    (report.sweep_dir / "wandb").mkdir(exist_ok=True)
    counts = column(report.cells, "status").value_counts()
    run = wandb.init(dir=str(report.sweep_dir), mode=settings["mode"], project=settings["project"],
                     entity=settings["entity"], group=sweep, job_type="report", name=f"report-{sweep}",
                     config={"sweep": sweep, "sweep_dir": str(report.sweep_dir), "cells": len(report.cells),
                             **{f"cells_{s}": int(counts.get(s, 0)) for s in ("ok", "failed", "refused", "skipped")}},
                     settings=wandb.Settings(console="off", silent=True))
    run_dir = Path(run.dir).parent
    with staging_dir(run_dir / "staging"):
        data: dict[str, Any] = {f"report/{t.key}": wandb.Table(dataframe=t.display().astype(str))
                                for t in report.tables if len(t.raw)}
        data.update({f"plots/{Path(name).stem.removeprefix('report_')}": wandb.Image(str(report.sweep_dir / name),
                                                                                       caption=caption)
                     for name, caption, _ in report.plots})
        data["report/html"] = wandb.Html((report.sweep_dir / "report.html").read_text(encoding="utf-8"), inject=False)
        run.log(data)
        run.summary.update({"verdicts": "\n".join(report.verdicts.lines),
                            "failures": "\n".join(report.verdicts.failures) or "none",
                            "winners": "\n".join(report.winners.lines),
                            "all_passed": report.verdicts.ok})
        artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9._-]", "_", f"report-{sweep}"), type="report",
                                  description=f"zeroexp sweep report of {sweep}")
        for path in report.files:
            artifact.add_file(str(path))
        run.log_artifact(artifact)
    run.finish()
    return run_dir
