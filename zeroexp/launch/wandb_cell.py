"""A cell's W&B run, logged by the launching process once the cell's files are written (zeroexp.launch.epilogue).

One run per cell (``job_type=cell``, named by the cell, grouped by its sweep, tagged with its strategy), in the cell
directory (``<cell>/wandb/``; ``wandb sync <cell>/wandb/offline-run-*`` uploads an offline one): the cell's resolved
config; rank 0's loss per step (``train/loss_rank0`` per ``trainer/global_step``, the iterations probe's rows); the
summary flattened with ``/`` (the plan's parts included); the per-rank tables (``tables/rank_state``,
``tables/collectives``). The ranks import no W&B: their start-up and their timed steps carry none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from zeroexp.report.wandb_report import LOSS_KEY, STEP_KEY
from zeroexp.results.files import redact_obj

__all__ = ["log_cell_run"]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif not isinstance(v, list):
            out[key] = v
    return out


def log_cell_run(cfg: Any, cell: Path, run_info: dict[str, Any], summary: dict[str, Any]) -> None:
    """Log the cell's W&B run (``cfg.logger``: mode, project, entity) from its files and ``summary``; finish it."""
    import pandas as pd
    import wandb

    from zeroexp.report.wandb_run import staging_dir

    lg = cfg.logger
    run = wandb.init(project=lg.project, entity=lg.entity, name=run_info["cell_name"],
                     group=run_info.get("sweep") or "single", job_type="cell", dir=str(cell), mode=lg.mode,
                     config=redact_obj(OmegaConf.to_container(cfg, resolve=True)), tags=[cfg.strategy.name],
                     settings=wandb.Settings(console="off", silent=True, reinit="finish_previous"))
    try:
        iterations = cell / "iterations.csv"
        if iterations.exists():  # rank 0's loss per step, as Lightning's W&B logger logged it from the rank
            frame = pd.read_csv(iterations)
            for row in frame[frame["rank"] == 0].itertuples():
                run.log({LOSS_KEY: float(row.loss), STEP_KEY: int(row.step)})
        run.summary.update(_flatten(summary))
        tables = {f"tables/{p.stem}": wandb.Table(dataframe=pd.read_csv(p))
                  for p in (cell / "rank_state.csv", cell / "collectives.csv") if p.exists()}
        if tables:
            with staging_dir(Path(run.dir).parent / "staging"):
                run.log(tables)
    finally:
        run.finish()
