"""The local launcher: start ``world_size`` rank processes for one cell, watch them, reap them.

Ranks are forked from a forkserver that has already imported torch and Lightning, so a cell pays the import
once per sweep, not once per rank. Ranks are handed the resolved config and the launcher's environment as
arguments and never read ``sys.argv`` (Lightning's own subprocess launcher replays argv, which under Hydra
``--multirun`` re-runs the whole sweep in every rank). Each cell rendezvous through a store this process serves on
a socket bound to 127.0.0.1 (:func:`loopback_store`), and gloo and NCCL use the loopback interface: nothing of a local
cell listens beyond loopback.

Failure handling: when a rank fails (exception, signal) the others get ``timeout.grace_s`` to exit and are
then killed. A rank that hangs makes its peers fail in a collective after ``timeout.collective_s``; the rank
still alive when its peers have failed is reported as the hung one. Past ``timeout.cell_s`` every rank is
killed. Every rank process is joined before :func:`launch_local` returns, also on Ctrl-C, SIGTERM and SIGHUP
(``zeroexp.launch.runner.stop_on_signals``), and what a rank that had to be stopped started (W&B's service and its
monitor, in sessions of their own) is ended with it (:func:`end_processes`). If this process is killed outright,
the forkserver and the ranks die with it (parent-death signals: ``zeroexp.rank.deathsig``, ``zeroexp.rank.worker``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

from zeroexp.errors import one_line
from zeroexp.results.files import read_json

__all__ = ["FORKSERVER_PRELOAD", "LaunchResult", "launch_local", "free_port", "start_forkserver", "rank_context",
           "runs_local_ranks", "start_forkserver_for", "NO_CELL_FLAGS"]

_CTX: Any = None
#: Seconds a stopped rank's leftover process (W&B's service) gets between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 0.5
#: What the ranks' forkserver imports before it forks a rank, in order: first zeroexp.rank.deathsig, which makes the
#: forkserver die with this process (each rank dies with the forkserver: zeroexp.rank.worker); then the ranks' module
#: and every strategy adapter, which a rank would otherwise import afresh in each cell; last what else a rank imports,
#: with the objects of every import frozen once for all ranks (zeroexp.launch.rank_preload). No W&B: the launching
#: process logs a cell's run (zeroexp.launch.wandb_cell).
FORKSERVER_PRELOAD = ("zeroexp.rank.deathsig", "zeroexp.rank.worker", "zeroexp.strategies._preload",
                      "zeroexp.launch.rank_preload")


def rank_context() -> Any:
    """The multiprocessing context every rank process of zeroexp starts from (cells, calibration): a forkserver,
    so a rank ends in ``os._exit``, never in the interpreter's teardown (where a spawned gloo rank sometimes aborts
    with SIGABRT), and imports torch once for all ranks."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # by name: imported there, not by this process
    return _CTX


def start_forkserver() -> None:
    """Start the ranks' forkserver now, without waiting for it: it imports torch, Lightning and the adapters (its
    preloads) while this process validates the cell (which imports Lightning too); the first rank's fork waits only
    for what is left. It starts no rank and writes nothing; a cell refused as bad input leaves it unused, and it
    exits with this process."""
    from multiprocessing import forkserver

    rank_context()
    forkserver.ensure_running()


def start_forkserver_for(argv: list[str]) -> None:
    """:func:`start_forkserver` first thing in ``python -m zeroexp`` when :func:`runs_local_ranks` says the command
    will fork ranks: its preloads (torch, Lightning, the adapters) then overlap this process's own imports, Hydra's
    compose and the validation of every job of a sweep, rather than waiting for the cell to be composed and
    validated (measured on the default cell and a 6-cell sweep: docs/benchmarks.md, start-up)."""
    if runs_local_ranks(argv):
        start_forkserver()


#: Hydra's command-line flags with which ``python -m zeroexp`` runs no cell: help, version, the composed config
#: (``--cfg``), ``--info``, shell completion.
NO_CELL_FLAGS = ("-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info", "-sc",
                 "--shell-completion", "--experimental-rerun")


def runs_local_ranks(argv: list[str]) -> bool:
    """Whether the command line ``argv`` (``sys.argv[1:]`` of ``python -m zeroexp``), read before Hydra composes it,
    runs cells whose ranks this process forks: no flag of :data:`NO_CELL_FLAGS`, and no ``launcher=`` other than
    ``local`` (torchrun and SLURM start the ranks themselves). A config that sets a launcher by other means
    (an ``experiment=``) is not seen here: the forkserver then starts and goes unused, which costs CPU, not results."""
    for arg in argv:
        if arg.split("=", 1)[0] in NO_CELL_FLAGS:  # --cfg job, --cfg=job
            return False
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "launcher" and value != "local":
            return False
    return True


def loopback_store(timeout_s: float) -> tuple[Any, int]:
    """The cell's rendezvous store, served by this (the launching) process on a socket bound to 127.0.0.1 only:
    the ranks connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's ranks do to its agent's),
    so nothing of a local cell listens beyond loopback. Returns the store (keep it until the ranks are done) and its
    port."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                          master_listen_fd=sock.detach())  # the store owns (and closes) the listening socket
    return store, port


def free_port() -> int:
    """A free TCP port on loopback (the rendezvous binds to 127.0.0.1 only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    ok: bool
    exitcodes: list[int | None]
    pids: list[int | None]
    error: dict[str, Any] | None  # {"rank", "cause", "message", "log"} of the first failure
    rank_errors: list[dict[str, Any]] = field(default_factory=list)  # every failed rank, in rank order


def _describe(rank: int, code: int | None, cell_dir: Path) -> dict[str, Any]:
    err_file = cell_dir / ".ranks" / f"rank{rank}.error.json"
    log = f"logs/rank{rank}.log"
    if err_file.exists():  # one line, tensor reprs removed (zeroexp.errors.one_line); the rest is in the log
        e = read_json(err_file)
        return {"rank": rank, "cause": "exception", "log": log,
                "message": f"rank {rank}: {e['type']}: {one_line(e['message'])} (log: {log})"}
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return {"rank": rank, "cause": "signal", "message": f"rank {rank} was killed by {name} (log: {log})",
                "log": log}
    return {"rank": rank, "cause": "exit", "message": f"rank {rank} exited with code {code} (log: {log})", "log": log}


def _root_cause(failed: list[int], procs: list[Any], cell_dir: Path) -> dict[str, Any]:
    """Of the ranks that have failed by now, the one that failed first: its peers' errors (a closed connection,
    a collective timeout) are consequences. A rank killed by a signal is a root cause; among ranks that raised,
    the earliest exception wins."""
    def order(r: int) -> tuple[int, float]:
        code = procs[r].exitcode
        if code is not None and code < 0:
            return (0, 0.0)
        err = cell_dir / ".ranks" / f"rank{r}.error.json"
        stamp = read_json(err).get("time") if err.exists() else None
        return (1, stamp if stamp is not None else float("inf"))

    first = min(failed, key=order)
    return _describe(first, procs[first].exitcode, cell_dir)


def descendants(pids: list[int | None]) -> list[Any]:
    """Every live process below ``pids`` (psutil processes): what ranks that are being stopped started, W&B's service
    and its system monitor among them (each in a session of its own, watching its rank's pid: alone it lingers
    seconds after the rank is gone)."""
    import psutil

    found = []
    for pid in pids:
        try:
            found += psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            pass
    return found


def end_processes(procs: list[Any], within_s: float) -> None:
    """SIGTERM each of ``procs`` still running (psutil processes, which know a reused pid is another process: W&B's
    service flushes its run on it), SIGKILL what still runs ``within_s`` later; return once every one is gone."""
    import psutil

    procs = [proc for proc in procs if proc.is_running()]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=within_s)


def local_rank_entry(*args: Any) -> None:
    """``zeroexp.rank.worker.rank_entry``, by name: what the runner hands to :func:`launch_local`, so that the launching
    process never imports zeroexp.rank.worker (torch.distributed's stack, Lightning, the probes: 5 to 7 s of imports on
    this 2-core host, beside the forkserver importing the same for the ranks); the rank's forkserver preloaded it."""
    from zeroexp.rank.worker import rank_entry

    rank_entry(*args)


def launch_local(cfg: dict[str, Any], cell_dir: Path, run_info: dict[str, Any], rank_entry: Callable[..., None],
                 on_started: Callable[[list[int | None]], None] | None = None, cell: Any = None) -> LaunchResult:
    """Run every rank of the cell on this machine: ``rank_entry(rank, world_size, port, cfg, cell_dir, run_info,
    environ, cell)`` in a process each (``zeroexp.rank.worker.rank_entry``, handed in by the runner; ``cell``: the
    cell validation resolved, zeroexp.cell.resolved.Cell); block until all have exited.

    ``on_started`` is called with the rank pids once every rank process exists. A dry run
    (``cfg["dry_run"]``, zeroexp.rank.dryrun) starts one process, rank 0, which plays its part of ``world_size``.
    """
    world_size = int(cfg["world_size"])
    timeouts = cfg["timeout"]
    # Rendezvous on loopback only: the store is served here, on 127.0.0.1 (a dry run has no process group to join).
    store, port = (None, free_port()) if cfg.get("dry_run") else loopback_store(float(timeouts["collective_s"]))
    ctx = rank_context()
    environ = dict(os.environ)
    environ["ZEROEXP_LAUNCHER_PID"] = str(os.getpid())  # zeroexp.rank.worker: a rank whose launcher is gone exits
    nprocs = 1 if cfg.get("dry_run") else world_size
    procs = [ctx.Process(target=rank_entry, args=(r, world_size, port, cfg, str(cell_dir), run_info, environ, cell),
                         name=f"zeroexp-rank{r}") for r in range(nprocs)]
    error: dict[str, Any] | None = None
    killed_by_us: set[int] = set()
    # What the ranks started (W&B's service and monitor), looked up once a second while they run: a rank that exits
    # on the signal itself (Ctrl-C reaches the whole group) leaves them reparented, out of reach of a later look.
    started: dict[int, Any] = {}
    looked_at = 0.0
    stopped = True  # until the ranks ended by themselves: then what they started ends by itself too
    try:
        for p in procs:
            p.start()
        if on_started is not None:
            on_started([p.pid for p in procs])
        deadline = time.monotonic() + float(timeouts["cell_s"])
        kill_at: float | None = None
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.05)  # back at once when a rank ends
            if time.monotonic() - looked_at >= 1.0:
                started.update((q.pid, q) for q in descendants([p.pid for p in procs if p.is_alive()]))
                looked_at = time.monotonic()
            if error is None:
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    error = _root_cause(failed, procs, cell_dir)
                    kill_at = time.monotonic() + float(timeouts["grace_s"])
                elif time.monotonic() > deadline:
                    error = {"rank": None, "cause": "timeout", "log": None,
                             "message": f"cell did not finish within timeout.cell_s={timeouts['cell_s']}s"}
                    kill_at = time.monotonic()
            if kill_at is not None and time.monotonic() >= kill_at:
                alive = [r for r, p in enumerate(procs) if p.is_alive()]
                if error is not None and error["cause"] == "exception" and "timed out" in error["message"].lower() \
                        and alive:
                    # Peers timed out in a collective while these ranks were still running: they hung.
                    error = {"rank": alive[0], "cause": "hang", "log": f"logs/rank{alive[0]}.log",
                             "message": f"rank(s) {', '.join(map(str, alive))} stopped responding; rank "
                                        f"{error['rank']} timed out in a collective after "
                                        f"timeout.collective_s={timeouts['collective_s']}s"}
                for r in alive:
                    killed_by_us.add(r)
                    procs[r].kill()
                kill_at = None
        stopped = error is not None
    finally:  # also on KeyboardInterrupt: no rank outlives the cell, nor, when it was stopped, what a rank started
        started.update((q.pid, q) for q in descendants([p.pid for p in procs if p.is_alive()]))
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        if stopped:
            end_processes(list(started.values()), within_s=LEFTOVER_GRACE_S)
        del store  # closes the listening socket
    codes = [p.exitcode for p in procs]
    rank_errors = [_describe(r, c, cell_dir) for r, c in enumerate(codes) if c != 0 and r not in killed_by_us]
    if error is None and rank_errors:
        error = rank_errors[0]
    return LaunchResult(ok=error is None, exitcodes=codes, pids=[p.pid for p in procs], error=error,
                        rank_errors=rank_errors)
