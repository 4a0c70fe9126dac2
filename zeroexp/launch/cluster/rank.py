"""One rank of a cell started by torchrun or SLURM (``launcher=torchrun|slurm``), writing one shared cell directory.

zeroexp's local launcher starts, watches and reaps every rank itself (zeroexp/launch/local.py). Here torchrun or SLURM
started each rank, on any node, and every rank runs :func:`run_external_rank` on the same Hydra config, so all
compute the same cell directory (the cell's name and the job's id, no clock: conf/launcher/). Then:

1. every rank validates the config and reads its place (:mod:`zeroexp.launch.cluster.env`); a ``world_size`` other than
   the launcher's is refused before the rendezvous;
2. the process group is initialised (``env://``) and every rank's host, pid, node and local rank gathered;
3. rank 0 prepares the directory (``resume=true``: a cell already ok is skipped; else an earlier attempt is
   cleared) and writes ``manifest.json``; its decision is broadcast;
4. every rank runs :func:`zeroexp.rank.worker.run_rank`, its output in ``logs/rank<r>.log``; rank 0 writes
   ``summary.json`` and marks the manifest ``ok``.

A rank that raises, or that torchrun ends with SIGTERM after a peer failed, writes ``.ranks/rank<r>.error.json``
and, while the manifest still says ``running``, marks it ``failed`` with its error (the first failure wins). A
rank killed outright (SIGKILL, the OOM killer) cannot write anything: torchrun's error summary or SLURM's job
state says what happened, and the manifest stays ``running``. The cell directory must be on a file system that
every node sees.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import shutil
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from zeroexp.cell.identity import cell_axes, cell_id, cell_name
from zeroexp.launch.cluster.env import RankEnv, detect
from zeroexp.config.schemas import ConfigError, validate, without_strategy_extras
from zeroexp.errors import one_line
from zeroexp.results.files import host, read_json, utc_now, write_json
from zeroexp.launch.runner import CellResult, device_and_backend, manifest_config, mark_partial, new_manifest

__all__ = ["run_external_rank"]


class Terminated(Exception):
    """SIGTERM: torchrun (or SLURM) ends the remaining ranks once one has failed."""


def _check(cfg: DictConfig, multirun: bool) -> RankEnv:
    launcher = str(cfg.launcher.name)
    if launcher == "torchrun" and multirun:
        raise ConfigError("launcher", launcher, "local or slurm for a --multirun sweep",
                          why="a torchrun job runs one cell: start one torchrun per cell")
    if launcher == "slurm" and not multirun:
        raise ConfigError("launcher", launcher, "local or torchrun for a single run",
                          why="Hydra's submitit launcher submits the SLURM jobs of a --multirun: add --multirun")
    env = detect(launcher)
    if env.world_size != int(cfg.world_size):
        raise ConfigError("world_size", cfg.world_size, f"{env.world_size}, the number of ranks {launcher} started",
                          why=f"{launcher} started {env.nodes} node(s) x {env.local_world_size} rank(s)")
    return env


def run_external_rank(cfg: DictConfig, cell_dir: Path, overrides: Sequence[str] = (), sweep: str | None = None,
                      explicit_keys: Sequence[str] = (), multirun: bool = False) -> CellResult | None:
    """Run this process's rank of the cell in ``cell_dir``; rank 0's result (None on other ranks that finished).

    Raises ``ConfigError`` before the rendezvous for a config or an environment that cannot run.
    """
    import torch
    import torch.distributed as dist

    cell = validate(cfg, tuple(explicit_keys))
    cfg = without_strategy_extras(cfg)  # keys a sweep set for other strategies: they do not apply to this cell
    env = _check(cfg, multirun)
    env.export()
    cell_dir = Path(cell_dir).resolve()
    device, backend = device_and_backend(cfg, env.local_world_size)
    cell = dataclasses.replace(cell, device=device, backend=backend)  # this node's ranks, as the environment says
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=float(cfg.timeout.collective_s)))
    me = {"rank": env.rank, "pid": os.getpid(), "host": host(), "node_rank": env.node_rank,
          "local_rank": env.local_rank}
    ranks: list[Any] = [None] * env.world_size
    dist.all_gather_object(ranks, me)
    resolved = manifest_config(cfg)
    from zeroexp.rank.faults import ENV as FAULT_ENV

    run_info = {"cell": cell_axes(cfg), "cell_id": cell_id(cfg), "cell_name": cell_name(cfg), "sweep": sweep,
                "fault": os.environ.get(FAULT_ENV)}
    decision: list[Any] = [None]
    if env.rank == 0:
        decision = [_prepare(cfg, cell_dir, multirun)]
        if decision[0] == "run":
            launch = {"launcher": env.launcher, "nodes": env.nodes, "ranks_per_node": env.local_world_size,
                      "job_id": env.job_id, "rendezvous": f"{env.master_addr}:{env.master_port}"}
            manifest = new_manifest(cfg, resolved, run_info, overrides, sweep, device, backend, launch)
            manifest["ranks"] = [{**r, "exitcode": None} for r in ranks]
            write_json(cell_dir / "manifest.json", manifest)
    dist.broadcast_object_list(decision, src=0)
    if decision[0] == "skip":
        dist.destroy_process_group()
        return CellResult(cell_dir, "skipped", None, None) if env.rank == 0 else None
    return _run(cfg, cell, resolved, cell_dir, run_info, env)


def _prepare(cfg: DictConfig, cell_dir: Path, multirun: bool) -> str:
    """Rank 0: ``skip`` a cell already ok (``resume=true`` in a sweep), else clear an earlier attempt: ``run``."""
    manifest = cell_dir / "manifest.json"
    if multirun and cfg.resume and manifest.exists() and read_json(manifest).get("status") == "ok":
        return "skip"
    cell_dir.mkdir(parents=True, exist_ok=True)
    if manifest.exists():  # as zeroexp.cli.run does for the local launcher: keep only Hydra's log
        for p in cell_dir.iterdir():
            if p.name != "zeroexp.log":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    return "run"


def _run(cfg: DictConfig, cell: Any, resolved: dict[str, Any], cell_dir: Path, run_info: dict[str, Any],
         env: RankEnv) -> CellResult | None:
    import torch.distributed as dist

    from zeroexp.rank.worker import RANKS_DIR, rank_log, run_rank

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated(f"rank {env.rank} was stopped by SIGTERM ({env.launcher} ends the other ranks when one fails)")

    previous = signal.signal(signal.SIGTERM, terminated)
    log = f"logs/rank{env.rank}.log"
    try:
        with rank_log(cell_dir / log):
            try:
                run_rank(resolved, cell_dir, run_info, cell)
            except BaseException:
                traceback.print_exc()
                raise
    except BaseException as e:  # noqa: BLE001 - recorded, then reported as a failed cell (exit code 1)
        cause = "signal" if isinstance(e, Terminated) else "exception"
        text = one_line(str(e), 2000)  # one line, tensor reprs removed: no parameter's values; the rest: the log
        message = text if isinstance(e, Terminated) else f"rank {env.rank}: {type(e).__name__}: {text} (log: {log})"
        error = {"rank": env.rank, "cause": cause, "message": message, "log": log}
        write_json(cell_dir / RANKS_DIR / f"rank{env.rank}.error.json",
                   {"rank": env.rank, "cause": cause, "type": type(e).__name__, "message": text,
                    "traceback": traceback.format_exc()[-8000:]})
        _record_failure(cell_dir, error)
        if dist.is_initialized():
            dist.destroy_process_group()
        print(f"zeroexp: {message[:500]} (see {cell_dir / log})", file=sys.stderr)
        return CellResult(cell_dir, "failed", error, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if env.rank != 0:
        return None
    return _record_success(cfg, cell, cell_dir, run_info)


def _record_success(cfg: DictConfig, cell: Any, cell_dir: Path, run_info: dict[str, Any]) -> CellResult:
    """Rank 0, after every rank passed run_rank's last barrier (the others gone): the cell's epilogue (its plan,
    ``summary.json``, its W&B run: zeroexp.launch.epilogue), then the manifest says ``ok``."""
    from zeroexp.launch.epilogue import epilogue_error

    manifest = read_json(cell_dir / "manifest.json")
    error = epilogue_error(cfg, cell, cell_dir, run_info, rank=0, log="logs/rank0.log")
    summary_path = cell_dir / "summary.json"
    if error is not None:
        _record_failure(cell_dir, error)
        return CellResult(cell_dir, "failed", error, None)
    for r in manifest["ranks"]:
        r["exitcode"] = 0  # every rank finished its work (its process's exit code is the launcher's to report)
    manifest.update(status="ok", ended_at=utc_now(), duration_s=_since(manifest["started_at"]))
    write_json(cell_dir / "manifest.json", manifest)
    return CellResult(cell_dir, "ok", None, read_json(summary_path))


def _record_failure(cell_dir: Path, error: dict[str, Any]) -> None:
    """Mark the manifest ``failed`` with ``error`` unless a rank already did (or rank 0 never wrote it)."""
    path = cell_dir / "manifest.json"
    if not path.exists():
        return
    manifest = read_json(path)
    if manifest.get("status") != "running":
        return
    try:
        partial = mark_partial(cell_dir, "failed", error)
    except OSError:  # another failing rank is renaming them at the same moment
        partial = []
    manifest.update(status="failed", error=error, ended_at=utc_now(), duration_s=_since(manifest["started_at"]),
                    partial_files=partial)
    write_json(path, manifest)


def _since(started_at: str) -> float:
    return round((_dt.datetime.now(_dt.timezone.utc) - _dt.datetime.fromisoformat(started_at)).total_seconds(), 3)
