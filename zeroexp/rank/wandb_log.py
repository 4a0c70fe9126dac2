"""A cell's W&B (or CSV) logger and what rank 0 logs into it at the end, shared by a trained run
(``zeroexp.rank.worker``) and a dry run (``zeroexp.rank.dryrun``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from zeroexp.results.files import redact_obj

__all__ = ["make_logger", "log_summary"]


def make_logger(cfg: Any, cell: Path, run_info: dict) -> Any:
    """The cell's Lightning logger for ``cfg.logger`` (W&B, CSV), or False for ``logger=none``."""
    lg = cfg.logger
    if lg.name == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        extra = {"mode": "disabled"} if lg.mode == "disabled" else {}
        return WandbLogger(
            project=lg.project, entity=lg.entity, name=run_info["cell_name"], group=run_info.get("sweep") or "single",
            job_type="cell", save_dir=str(cell), offline=lg.mode == "offline",
            config=redact_obj(OmegaConf.to_container(cfg, resolve=True)), tags=[cfg.strategy.name], **extra,
        )
    if lg.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(cell), name="csv", version="")
    return False


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif not isinstance(v, list):
            out[key] = v
    return out


def log_summary(logger: Any, summary: dict[str, Any], cell: Path) -> None:
    """Rank 0, once the cell's files are written: the summary (flattened) and the per-rank tables into the
    W&B run of ``logger``; then finish the run."""
    import pandas as pd
    import wandb

    from zeroexp.report.wandb_run import staging_dir

    run = logger.experiment
    run.summary.update(_flatten(summary))
    # Per-rank tables (tables/rank_state, tables/collectives); their artifact copies stay in the run's directory.
    tables = {f"tables/{p.stem}": wandb.Table(dataframe=pd.read_csv(p))
              for p in (cell / "rank_state.csv", cell / "collectives.csv") if p.exists()}
    if tables:
        with staging_dir(Path(run.dir).parent / "staging"):
            run.log(tables)
    wandb.finish()
