"""Sweep reports: every cell of a sweep side by side, as Markdown, self-contained HTML, CSV/Parquet, PNG plots
and a W&B run.

``python -m zeroexp.report SWEEP_DIR`` writes, in the sweep directory: ``report.md``, ``report.html``,
``report.csv`` and ``report.parquet`` (the joined rows of :func:`zeroexp.results.files.load_sweep`, ladder order),
``report_*.png``, and, when the cells logged to W&B, the sweep's own run under ``wandb/``; ``--wandb-report``
also builds the sweep's W&B Report (:mod:`zeroexp.report.wandb_report`). Every ``--multirun``
ends with the same report (``zeroexp.cli.sweep.SweepSummary``). The contract is in ``docs/results.md``.
"""

from __future__ import annotations

import datetime as _dt
import io
import json
import traceback
from pathlib import Path

import pandas as pd

from zeroexp.results.cells import column, order_cells
from zeroexp.results.format import missing
from zeroexp.report.model import Report
from zeroexp.report.tables import build_tables
from zeroexp.report.verdicts import verdicts
from zeroexp.report.winners import winners

__all__ = ["Report", "build_report", "write_report", "report_after_sweep"]


def _environment(cells: pd.DataFrame) -> str:
    def values(key: str) -> str:
        found = sorted({str(v) for v in column(cells, key) if not missing(v)})
        return "/".join(found) or "?"

    commit = values("git.commit")[:10]
    dirty = " (dirty)" if any(not missing(v) and bool(v) for v in column(cells, "git.dirty")) else ""
    return (f"torch {values('versions.torch')}, lightning {values('versions.lightning')}, "
            f"{values('device_type')} ({values('backend')}), host {values('host')}, git {commit}{dirty}")


def build_report(sweep_dir: Path | str) -> Report:
    """Read every cell of ``sweep_dir`` and build the tables, verdicts and what won (nothing is written)."""
    from zeroexp.results.files import load_sweep

    sweep_dir = Path(sweep_dir).resolve()
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"no sweep directory {sweep_dir}")
    cells = order_cells(load_sweep(sweep_dir))
    return Report(sweep_dir=sweep_dir, cells=cells, tables=build_tables(cells), verdicts=verdicts(cells),
                  generated_at=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  environment=_environment(cells), winners=winners(cells))


def _flat_rows(cells: pd.DataFrame) -> pd.DataFrame:
    """Lists and dicts as JSON text; object columns of mixed scalar types as text (Parquet needs one type)."""
    out = cells.copy()
    for name in out.columns:
        if out[name].dtype != object:
            continue
        vals = [json.dumps(v) if isinstance(v, (list, dict)) else v for v in out[name]]
        kinds = {type(v) for v in vals if not missing(v)}
        out[name] = [v if missing(v) or len(kinds) <= 1 else str(v) for v in vals]
    return out


def write_report(sweep_dir: Path | str, wandb_mode: str = "auto") -> Report:
    """Build the report of ``sweep_dir`` and write its files there; log the sweep's W&B run (see
    :func:`zeroexp.report.wandb_run.wandb_settings` for ``wandb_mode``). A W&B failure is kept in
    ``Report.wandb_error``: the files are written first and stay."""
    from zeroexp.report.plots import PLOTS
    from zeroexp.report.pages import to_html, to_markdown
    from zeroexp.report.wandb_run import log_sweep_run, wandb_settings
    from zeroexp.results.files import write_text

    report = build_report(sweep_dir)
    d = report.sweep_dir
    for name, (plot, caption, table_key) in PLOTS.items():
        (d / name).unlink(missing_ok=True)  # a plot with no data this time must not show an old one
        if plot(report.cells, d / name) is not None:
            report.plots.append((name, caption, table_key))
    rows = _flat_rows(report.cells)
    buf = io.StringIO()
    rows.to_csv(buf, index=False)
    write_text(d / "report.csv", buf.getvalue())
    rows.to_parquet(d / "report.parquet", index=False)
    write_text(d / "report.md", to_markdown(report))
    write_text(d / "report.html", to_html(report))
    report.files = [d / n for n in ("report.md", "report.html", "report.csv", "report.parquet")]
    report.files += [d / name for name, _, _ in report.plots]
    settings = wandb_settings(report.cells, wandb_mode)
    if settings is not None:
        try:
            report.wandb_run_dir = log_sweep_run(report, settings)
        except Exception as e:  # noqa: BLE001 - the report files are written; say what W&B did not get
            report.wandb_error = f"{type(e).__name__}: {e}"
    return report


def report_after_sweep(sweep_dir: Path | str) -> bool:
    """The end of every ``--multirun``: write the report, print where it is; never raise.

    A failure leaves the cells' results untouched; it is printed with the command that retries it, and its
    traceback is written to ``report.error.txt``. Returns False when the report or its W&B run failed.
    """
    from rich.console import Console

    console = Console(highlight=False)
    sweep_dir = Path(sweep_dir)
    try:
        report = write_report(sweep_dir)
    except Exception as e:  # noqa: BLE001 - a broken report must not lose the sweep's results
        (sweep_dir / "report.error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        console.print(f"[red]report failed:[/] {type(e).__name__}: {e}\n  the cells' results are intact in "
                      f"{sweep_dir}; traceback in {sweep_dir / 'report.error.txt'}; retry with "
                      f"python -m zeroexp.report {sweep_dir}")
        return False
    (sweep_dir / "report.error.txt").unlink(missing_ok=True)
    console.print(f"report: {report.sweep_dir / 'report.html'} (and report.md, report.csv, "
                  f"{len(report.plots)} plots)")
    for line in report.verdicts.failures:
        console.print(f"  [red]{line}[/]")
    if report.wandb_run_dir is not None:
        console.print(f"W&B sweep run: {report.wandb_run_dir}")
    if report.wandb_error:
        console.print(f"[red]W&B sweep run failed:[/] {report.wandb_error} (the report files are written)")
        return False
    return True
