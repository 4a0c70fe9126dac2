"""``python -m zeroexp``: compose a cell with Hydra, run it, print its directory last."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from zeroexp.cell import cell_name
from zeroexp.config import ConfigError, register_schemas

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def register() -> None:
    """Register zeroexp's schemas and the ``zx_cell_name`` resolver (used in Hydra's output paths)."""
    register_schemas()
    if not OmegaConf.has_resolver("zx_cell_name"):
        OmegaConf.register_new_resolver("zx_cell_name", lambda *, _root_: cell_name(_root_))


def _explicit_keys(overrides: list[str]) -> tuple[str, ...]:
    keys = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        keys.append(key)
    return tuple(keys)


_TASK_STARTED = False


def task(cfg: DictConfig) -> None:
    """Hydra's task function: one cell per call (one call per job of a ``--multirun`` sweep)."""
    global _TASK_STARTED
    _TASK_STARTED = True
    from rich.console import Console

    from zeroexp.runner import run_cell

    console = Console(stderr=False, highlight=False)
    hc = HydraConfig.get()
    cell_dir = Path(hc.runtime.output_dir)
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    sweep = Path(hc.sweep.dir).name if multirun else None
    if multirun and (cell_dir / "manifest.json").exists():
        console.print(f"[yellow]skip[/] {cell_dir.name}: this cell already ran in this sweep "
                      f"(overrides {' '.join(overrides)} give the same cell)")
        return
    try:
        result = run_cell(cfg, cell_dir, overrides=overrides, sweep=sweep,
                          explicit_keys=() if multirun else _explicit_keys(overrides))
    except ConfigError as e:
        if not any(cell_dir.iterdir()) or {p.name for p in cell_dir.iterdir()} <= {"zeroexp.log"}:
            shutil.rmtree(cell_dir, ignore_errors=True)
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    colour = "green" if result.status == "ok" else "red"
    line = f"[{colour}]{result.status}[/] {cell_dir.name}"
    if result.summary is not None:
        line += f"  final_loss={result.summary['final_loss']:.6g}"
    if result.error:
        line += f"  error: {result.error['message']}"
    console.print(line)
    print(cell_dir)


def main() -> None:
    """Console entry point (``python -m zeroexp`` and ``zeroexp``)."""
    register()
    try:
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(task)()
    except SystemExit as e:
        # Hydra reports a composition error (unknown option, mistyped value, unknown key) and exits 1
        # before any task ran: that is bad input, which zeroexp reports with exit code 2.
        if e.code == 1 and not _TASK_STARTED:
            sys.exit(2)
        raise
