"""The one writer of what a cell's ranks measured: the probes' tables and the measured summary.

Rank 0 of a trained cell (zeroexp.rank.worker.finalize) and a dry run (zeroexp.rank.dryrun) each gather their
sections their own way (every rank's files; one played rank) and hand them here, so both leave the same files in the
same order. The plan (``summary.json["plan"]``) is not the ranks': the launching process adds it once they are done
and writes ``summary.json`` (zeroexp.launch.epilogue), from ``.ranks/measured.json``, which this writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from zeroexp.results.files import SCHEMA_VERSION, write_csv, write_json

__all__ = ["RANKS_DIR", "MEASURED", "summary_head", "write_measured"]

#: Where the ranks leave their records in the cell directory (``rank<r>.json``, errors, :data:`MEASURED`).
RANKS_DIR = ".ranks"
#: The measured summary and what the plan needs beside it (the live groups; why a dry run's measurement is the
#: planner's own), for the launching process: ``{"summary": ..., "live_groups": ..., "itself": ...}``.
MEASURED = "measured.json"


def summary_head(run_info: dict[str, Any], world_size: int, steps: int, mode: str | None = None,
                 **fields: Any) -> dict[str, Any]:
    """The fields every ``summary.json`` starts with (docs/results.md; ``mode`` only where not a trained cell), then
    ``fields`` in order."""
    head = {"schema_version": SCHEMA_VERSION, "status": "ok", **({"mode": mode} if mode else {})}
    return {**head, "cell": run_info["cell"], "cell_id": run_info["cell_id"], "world_size": world_size, "steps": steps,
            **fields}


def write_measured(cell_dir: Path, summary: dict[str, Any], tables: Mapping[str, Any],
                   live_groups: dict[str, Any] | None = None, itself: str | None = None) -> dict[str, Any]:
    """Write each table (``name.csv`` -> a DataFrame) and :data:`MEASURED` (``live_groups``: the groups rank 0's
    adapter read, which the plan compares with its own; ``itself``: why the measurement is the planner's own model, a
    derived dry run); return the summary."""
    for name, frame in tables.items():
        write_csv(cell_dir / name, frame)
    write_json(cell_dir / RANKS_DIR / MEASURED, {"summary": summary, "live_groups": live_groups, "itself": itself})
    return summary
