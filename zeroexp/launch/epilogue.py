"""A cell's last step, in the launching process once its ranks are done: the plan beside the measurement.

The ranks write what they measured (their tables, and rank 0's measured summary: ``.ranks/measured.json``,
zeroexp.rank.summary); :func:`finish_cell` then computes ``summary.json["plan"]`` (zeroexp.plan.check.cell.plan_section)
from the cell validation resolved (zeroexp.cell.resolved.Cell: its row, knobs and model shape) and those records,
writes ``summary.json`` whole, and logs the cell's W&B run (zeroexp.launch.wandb_cell). It runs in the local launcher
(zeroexp.launch.runner) and, for a torchrun or SLURM cell, in rank 0's process after its last barrier
(zeroexp.launch.cluster.rank), every other rank gone: no rank waits while the plan is computed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroexp.results.files import read_json, write_json

__all__ = ["finish_cell", "epilogue_error"]


def finish_cell(cfg: Any, cell: Any, cell_dir: Path, run_info: dict[str, Any]) -> dict[str, Any]:
    """Add the plan to the measured summary of ``cell_dir``, write ``summary.json``, log the W&B run
    (``logger=wandb``); return the summary. ``cell``: the :class:`~zeroexp.cell.resolved.Cell`. Raises
    ``FileNotFoundError`` when rank 0 left no measured summary."""
    from zeroexp.cell.memo import invocation_memo
    from zeroexp.plan.check.cell import plan_section
    from zeroexp.rank.summary import MEASURED, RANKS_DIR

    measured = read_json(Path(cell_dir) / RANKS_DIR / MEASURED)
    summary = measured["summary"]
    with invocation_memo():  # the shapes and traces the plan's parts share
        summary["plan"] = plan_section(cell, Path(cell_dir), summary, itself=measured.get("itself"),
                                       live_groups=measured.get("live_groups"))
    write_json(Path(cell_dir) / "summary.json", summary)
    if cfg.logger.name == "wandb":
        from zeroexp.launch.wandb_cell import log_cell_run

        log_cell_run(cfg, Path(cell_dir), run_info, summary)
    return summary


def epilogue_error(cfg: Any, cell: Any, cell_dir: Path, run_info: dict[str, Any], rank: int | None,
                   log: str | None) -> dict[str, Any] | None:
    """:func:`finish_cell`, its failure as the cell's error record (None: done): ``missing`` where rank 0 left no
    measured summary (``log``: where to look), ``epilogue`` where the plan, ``summary.json`` or the W&B run failed
    (``rank``: the process that ran it; None: the launching process)."""
    from zeroexp.errors import one_line
    from zeroexp.rank.summary import MEASURED, RANKS_DIR

    if not (Path(cell_dir) / RANKS_DIR / MEASURED).exists():
        return {"rank": 0, "cause": "missing", "message": "ranks finished but rank 0 wrote no measured summary "
                f"({RANKS_DIR}/{MEASURED}): summary.json was not written", **({"log": log} if log else {})}
    try:
        finish_cell(cfg, cell, cell_dir, run_info)
    except Exception as e:  # noqa: BLE001 - recorded as the cell's failure, as a rank's exception is
        return {"rank": rank, "cause": "epilogue", "log": None,
                "message": f"after the ranks: {type(e).__name__}: {one_line(str(e), 2000)}"}
    return None
