"""Hydra callback for ``--multirun``: a table of every cell of the sweep at its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    """Prints one row per cell directory of the sweep (status, final loss, error)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.console import Console
        from rich.table import Table

        from zeroexp.results import read_json

        sweep_dir = Path(config.hydra.sweep.dir)
        table = Table(title=f"zeroexp sweep {sweep_dir}")
        for col in ("cell", "status", "final_loss", "error"):
            table.add_column(col)
        for manifest_path in sorted(sweep_dir.glob("*/manifest.json")):
            m = read_json(manifest_path)
            summary_path = manifest_path.with_name("summary.json")
            loss = read_json(summary_path).get("final_loss") if summary_path.exists() else None
            err = (m.get("error") or {}).get("message", "") if isinstance(m.get("error"), dict) else ""
            table.add_row(manifest_path.parent.name, m["status"], "" if loss is None else f"{loss:.6g}", err)
        Console().print(table)
        print(sweep_dir)
