"""Run one cell: validate, write the manifest, launch the ranks, record the outcome.

This is the Python API the CLI and the tests share::

    from zeroexp.runner import run_cell
    result = run_cell(cfg, Path("outputs/my_cell"))
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from zeroexp.cell import cell_axes, cell_id, cell_name
from zeroexp.config import validate
from zeroexp.results import git_commit, host, read_json, utc_now, versions, write_json

__all__ = ["CellResult", "run_cell"]


@dataclass
class CellResult:
    cell_dir: Path
    status: str  # ok | failed | skipped
    error: dict[str, Any] | None
    summary: dict[str, Any] | None


def _device_and_backend(cfg: DictConfig) -> tuple[str, str]:
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()
                                and torch.cuda.device_count() >= cfg.world_size):
        return "cuda", "nccl"
    return "cpu", "gloo"


def run_cell(cfg: DictConfig, cell_dir: Path, overrides: Sequence[str] = (), sweep: str | None = None,
             explicit_keys: Sequence[str] = ()) -> CellResult:
    """Validate ``cfg`` (raises ``ConfigError`` before anything is written), then run the cell in ``cell_dir``."""
    validate(cfg, tuple(explicit_keys))
    cell_dir = Path(cell_dir).resolve()
    cell_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    resolved.pop("hydra", None)
    device, backend = _device_and_backend(cfg)
    run_info = {"cell": cell_axes(cfg), "cell_id": cell_id(cfg), "cell_name": cell_name(cfg), "sweep": sweep}
    manifest: dict[str, Any] = {
        "status": "running", "error": None, "cell": run_info["cell"], "cell_id": run_info["cell_id"],
        "cell_name": run_info["cell_name"], "sweep": sweep, "config": resolved, "overrides": list(overrides),
        "world_size": int(cfg.world_size), "device_type": device, "backend": backend, "launcher": "local",
        "host": host(), "versions": versions(), "git": git_commit(), "started_at": utc_now(), "ended_at": None,
        "duration_s": None,
    }
    write_json(cell_dir / "manifest.json", manifest)
    t0 = time.monotonic()
    from zeroexp.launch import launch_local

    try:
        launched = launch_local(resolved, cell_dir, run_info)
        error = launched.error
        summary_path = cell_dir / "summary.json"
        if error is None and not summary_path.exists():
            error = {"rank": 0, "cause": "missing", "message": "ranks exited cleanly but summary.json was not written"}
    except KeyboardInterrupt:
        error = {"rank": None, "cause": "interrupted", "message": "interrupted by the user (Ctrl-C)"}
        _finish(manifest, cell_dir, "failed", error, t0)
        raise
    status = "ok" if error is None else "failed"
    _finish(manifest, cell_dir, status, error, t0)
    summary = read_json(cell_dir / "summary.json") if status == "ok" else None
    return CellResult(cell_dir=cell_dir, status=status, error=error, summary=summary)


def _finish(manifest: dict[str, Any], cell_dir: Path, status: str, error: Any, t0: float) -> None:
    manifest.update(status=status, error=error, ended_at=utc_now(), duration_s=round(time.monotonic() - t0, 3))
    summary_path = cell_dir / "summary.json"
    if status != "ok" and summary_path.exists():  # never leave a summary that claims ok for a failed cell
        summary = read_json(summary_path)
        summary.update(status=status, error=error)
        write_json(summary_path, summary)
    write_json(cell_dir / "manifest.json", manifest)
