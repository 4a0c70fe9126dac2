"""The one writer of a cell's results: the probes' tables, the planner's prediction beside them, ``summary.json``.

Rank 0 of a trained cell (zeroexp.rank.worker.finalize) and a dry run (zeroexp.rank.dryrun) each gather their
sections their own way (every rank's files; one played rank) and hand them here, so both leave the same files in the
same order with the same ``plan`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from zeroexp.cell.resolved import Cell
from zeroexp.results.files import SCHEMA_VERSION, write_csv, write_json

__all__ = ["summary_head", "write_summary"]


def summary_head(run_info: dict[str, Any], world_size: int, steps: int, mode: str | None = None,
                 **fields: Any) -> dict[str, Any]:
    """The fields every ``summary.json`` starts with (docs/results.md; ``mode`` only where not a trained cell), then
    ``fields`` in order."""
    head = {"schema_version": SCHEMA_VERSION, "status": "ok", **({"mode": mode} if mode else {})}
    return {**head, "cell": run_info["cell"], "cell_id": run_info["cell_id"], "world_size": world_size, "steps": steps,
            **fields}


def write_summary(cell_dir: Path, cell: Cell, summary: dict[str, Any], tables: Mapping[str, Any],
                  live_groups: dict[str, Any] | None = None, itself: str | None = None) -> dict[str, Any]:
    """Write each table (``name.csv`` -> a DataFrame) and ``summary.json`` with its ``plan`` section (the planner's
    prediction for this cell against the measured sections, zeroexp.plan.check.cell.plan_section; ``itself``: why the
    measurement is the planner's own model, a derived dry run); return the summary."""
    from zeroexp.plan.check.cell import plan_section

    for name, frame in tables.items():
        write_csv(cell_dir / name, frame)
    summary["plan"] = plan_section(cell, cell_dir, summary, itself=itself, live_groups=live_groups)
    write_json(cell_dir / "summary.json", summary)
    return summary
