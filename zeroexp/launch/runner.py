"""Run one cell: validate, write the manifest, launch the ranks, record the outcome.

This is the Python API the CLI and the tests share::

    from zeroexp.launch.runner import run_cell
    result = run_cell(cfg, Path("outputs/my_cell"))
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from zeroexp.cell.identity import cell_axes, cell_id, cell_name
from zeroexp.config.schemas import validate, without_strategy_extras
from zeroexp.errors import Interrupted
if TYPE_CHECKING:
    from zeroexp.cell.resolved import Cell
from zeroexp.results.files import SCHEMA_VERSION, git_commit, host, read_json, utc_now, versions, write_json

__all__ = ["CellResult", "device_and_backend", "mark_partial", "new_manifest", "run_cell", "stop_on_signals",
           "STOP_SIGNALS"]

#: Signals that end a cell as Ctrl-C does: SIGTERM (``kill``, SLURM's scancel / time limit) and SIGHUP (the
#: terminal went away). SIGINT keeps Python's own KeyboardInterrupt.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP raise :class:`~zeroexp.errors.Interrupted` (a KeyboardInterrupt) in the main
    thread, so the launcher reaps every rank and the runner records the cell ``failed`` naming the signal, as for
    Ctrl-C. A repeat of either signal while that cleanup runs is ignored (it must finish: no rank may be left).
    Nested uses and other threads than the main one do nothing; the previous handlers are restored on exit."""
    if threading.current_thread() is not threading.main_thread() or \
            getattr(signal.getsignal(signal.SIGTERM), "_zeroexp", False):
        yield
        return
    raised = []

    def handler(signum: int, frame: Any) -> None:
        if raised:  # already stopping
            return
        raised.append(signum)
        raise Interrupted(signum)

    handler._zeroexp = True  # type: ignore[attr-defined]
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    # A signal mask is inherited through fork and exec: a parent that happened to block these (e.g. while it
    # spawned a helper process) would leave the run, its forkserver and its ranks deaf to them. Unblocked here, for
    # this thread and every process started from it; the caller's mask is restored on exit.
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *STOP_SIGNALS})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for s, h in previous.items():
            signal.signal(s, h)


@dataclass
class CellResult:
    cell_dir: Path
    status: str  # ok | failed | skipped
    error: dict[str, Any] | None
    summary: dict[str, Any] | None


def device_and_backend(cfg: DictConfig, local_world_size: int | None = None) -> tuple[str, str]:
    """``device=auto``: CUDA when there is a GPU for each rank of this node (``local_world_size``, default all)."""
    from zeroexp.devices import ranks_get_a_gpu

    if cfg.get("dry_run"):  # zeroexp.rank.dryrun: one CPU process, fake process group, FakeTensorMode
        return "cpu", "fake"
    return ("cuda", "nccl") if ranks_get_a_gpu(cfg, local_world_size or int(cfg.world_size)) else ("cpu", "gloo")


def manifest_config(cfg: DictConfig) -> dict[str, Any]:
    """The config a cell's manifest records (``config``): resolved, without Hydra's node or the keys a sweep set for
    other strategies."""
    resolved = OmegaConf.to_container(without_strategy_extras(cfg), resolve=True)
    assert isinstance(resolved, dict)
    resolved.pop("hydra", None)
    return resolved


def new_manifest(cfg: DictConfig, resolved: dict[str, Any], run_info: dict[str, Any], overrides: Sequence[str],
                 sweep: str | None, device: str, backend: str, launch: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a cell starting now (``running``); ``launch``: ``launcher``, ``nodes``, ``ranks_per_node``,
    ``job_id`` (docs/results.md)."""
    return {
        "schema_version": SCHEMA_VERSION, "status": "running", "mode": "dry_run" if cfg.get("dry_run") else "run",
        "error": None,
        "cell": run_info["cell"], "cell_id": run_info["cell_id"],
        "cell_name": run_info["cell_name"], "sweep": sweep, "config": resolved, "overrides": list(overrides),
        "world_size": int(cfg.world_size), "device_type": device, "backend": backend, **launch,
        "host": host(), "versions": versions(), "git": git_commit(), "started_at": utc_now(), "ended_at": None,
        "duration_s": None, "ranks": None, "partial_files": [],
    }


def run_cell(cfg: DictConfig, cell_dir: Path, overrides: Sequence[str] = (), sweep: str | None = None,
             explicit_keys: Sequence[str] = (), progress: bool = False) -> CellResult:
    """Validate ``cfg`` (raises ``ConfigError`` before anything is written), then run the cell in ``cell_dir``.

    ``progress``: show rank 0's progress on stderr while the ranks train (``zeroexp.launch.progress``; the CLI's
    runs)."""
    cell = validate(cfg, tuple(explicit_keys), before_torch=_preload_wandb if cfg.logger.name == "wandb" else None)
    with stop_on_signals():
        return _run_valid_cell(cfg, cell, cell_dir, overrides, sweep, progress)


def _run_valid_cell(cfg: DictConfig, cell: Cell, cell_dir: Path, overrides: Sequence[str], sweep: str | None,
                    progress: bool) -> CellResult:
    cfg = without_strategy_extras(cfg)  # keys a sweep set for other strategies: they do not apply to this cell
    if cfg.get("launcher") is not None and cfg.launcher.name != "local":
        from zeroexp.config.schemas import ConfigError

        raise ConfigError("launcher", cfg.launcher.name, "local", why="run_cell starts the ranks itself; a torchrun "
                          "or SLURM rank runs through python -m zeroexp (zeroexp.launch.cluster)")
    cell_dir = Path(cell_dir).resolve()
    cell_dir.mkdir(parents=True, exist_ok=True)
    resolved = manifest_config(cfg)
    device, backend = device_and_backend(cfg)
    from zeroexp.rank.faults import ENV as FAULT_ENV

    run_info = {"cell": cell_axes(cfg), "cell_id": cell_id(cfg), "cell_name": cell_name(cfg), "sweep": sweep,
                "fault": os.environ.get(FAULT_ENV)}
    manifest = new_manifest(cfg, resolved, run_info, overrides, sweep, device, backend,
                            {"launcher": "local", "nodes": 1, "ranks_per_node": int(cfg.world_size), "job_id": None})
    write_json(cell_dir / "manifest.json", manifest)
    t0 = time.monotonic()
    from zeroexp.launch.local import launch_local, local_rank_entry
    from zeroexp.launch.progress import watch_progress

    if progress and cell.shape is not None:  # the command line's cell: what it will hold, before its ranks start
        from zeroexp.config.resources import prelaunch_line

        print(prelaunch_line(cfg, cell.shape), file=sys.stderr, flush=True)
    try:
        def started(pids: list[int | None]) -> None:
            manifest["ranks"] = [{"rank": r, "pid": pid, "exitcode": None} for r, pid in enumerate(pids)]
            write_json(cell_dir / "manifest.json", manifest)

        for attempt in range(3):
            with watch_progress(cell_dir, run_info["cell_name"]) if progress and not cfg.get("dry_run") \
                    else nullcontext():
                launched = launch_local(resolved, cell_dir, run_info, local_rank_entry, on_started=started,
                                        cell=cell)
            # The free port can be taken by another process between probing and binding: retry that alone.
            if not (launched.error and "address already in use" in launched.error["message"].lower()):
                break
            shutil.rmtree(cell_dir / ".ranks", ignore_errors=True)
        error = launched.error
        manifest["ranks"] = [{"rank": r, "pid": pid, "exitcode": code}
                             for r, (pid, code) in enumerate(zip(launched.pids, launched.exitcodes))]
        if error is None:
            from zeroexp.launch.epilogue import epilogue_error  # the plan, summary.json, the W&B run

            error = epilogue_error(cfg, cell, cell_dir, run_info, rank=None, log=None)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (stop_on_signals): every rank is reaped by now
        name = e.signal_name if isinstance(e, Interrupted) else "SIGINT"
        how = "by the user (Ctrl-C, SIGINT)" if name == "SIGINT" else f"by {name}"
        error = {"rank": None, "cause": "interrupted", "signal": name, "log": None,
                 "message": f"interrupted {how}: every rank was stopped"}
        _finish(manifest, cell_dir, "failed", error, t0)
        raise
    status = "ok" if error is None else "failed"
    _finish(manifest, cell_dir, status, error, t0)
    summary = read_json(cell_dir / "summary.json") if status == "ok" else None
    return CellResult(cell_dir=cell_dir, status=status, error=error, summary=summary)


def _preload_wandb() -> None:
    """The cell's W&B run starts here after the ranks (zeroexp.launch.wandb_cell): its imports, before torch's."""
    try:
        import zeroexp.launch.wandb_preload  # noqa: F401
    except ImportError:
        pass


def _finish(manifest: dict[str, Any], cell_dir: Path, status: str, error: Any, t0: float) -> None:
    manifest.update(status=status, error=error, ended_at=utc_now(), duration_s=round(time.monotonic() - t0, 3))
    if status != "ok":
        manifest["partial_files"] = mark_partial(cell_dir, status, error)
    write_json(cell_dir / "manifest.json", manifest)


def mark_partial(cell_dir: Path, status: str, error: Any) -> list[str]:
    """Rename the result files of a cell that did not finish to ``<name>.partial``: no reader takes them for
    results, and a ``summary.json`` never claims ``ok`` for a failed cell."""
    marked = []
    for path in sorted([*cell_dir.glob("*.csv"), *cell_dir.glob("summary.json")]):
        if path.name == "summary.json":
            summary = read_json(path)
            summary.update(status=status, error=error)
            write_json(path, summary)
        target = path.with_name(path.name + ".partial")
        os.replace(path, target)
        marked.append(target.name)
    return marked
