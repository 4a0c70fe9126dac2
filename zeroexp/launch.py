"""The local launcher: start ``world_size`` rank processes for one cell, watch them, reap them.

Ranks are forked from a forkserver that has already imported torch and Lightning, so a cell pays the import
once per sweep, not once per rank. Ranks are handed the resolved config as an argument and never read
``sys.argv`` (Lightning's own subprocess launcher replays argv, which under Hydra ``--multirun`` re-runs the
whole sweep in every rank). Each cell rendezvous on a free loopback port.

When a rank fails (exception, signal, or the cell timeout) the others get ``timeout.grace_s`` to exit and are
then killed; every rank process is joined before :func:`launch_local` returns.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroexp.results import read_json

__all__ = ["LaunchResult", "launch_local", "free_port"]

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["zeroexp.worker"])
    return _CTX


def free_port() -> int:
    """A free TCP port on loopback (the rendezvous binds to 127.0.0.1 only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LaunchResult:
    ok: bool
    exitcodes: list[int | None]
    error: dict[str, Any] | None  # {"rank", "cause", "message"} of the first failure


def _describe(rank: int, code: int | None, cell_dir: Path) -> dict[str, Any]:
    err_file = cell_dir / ".ranks" / f"rank{rank}.error.json"
    if err_file.exists():
        e = read_json(err_file)
        return {"rank": rank, "cause": "exception", "message": f"{e['type']}: {e['message']}",
                "log": f"logs/rank{rank}.log"}
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals.__members__.values() else str(-code)
        return {"rank": rank, "cause": "signal", "message": f"rank {rank} was killed by {name}",
                "log": f"logs/rank{rank}.log"}
    return {"rank": rank, "cause": "exit", "message": f"rank {rank} exited with code {code}",
            "log": f"logs/rank{rank}.log"}


def launch_local(cfg: dict[str, Any], cell_dir: Path, run_info: dict[str, Any]) -> LaunchResult:
    """Run every rank of the cell on this machine; block until all have exited."""
    from zeroexp.worker import rank_entry

    world_size = int(cfg["world_size"])
    timeouts = cfg["timeout"]
    port = free_port()
    ctx = _context()
    procs = [ctx.Process(target=rank_entry, args=(r, world_size, port, cfg, str(cell_dir), run_info),
                         name=f"zeroexp-rank{r}") for r in range(world_size)]
    error: dict[str, Any] | None = None
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + float(timeouts["cell_s"])
        kill_at: float | None = None
        while any(p.is_alive() for p in procs):
            time.sleep(0.05)
            if error is None:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0):
                        error = _describe(r, p.exitcode, cell_dir)
                        kill_at = time.monotonic() + float(timeouts["grace_s"])
                        break
            if error is None and time.monotonic() > deadline:
                error = {"rank": None, "cause": "timeout",
                         "message": f"cell did not finish within timeout.cell_s={timeouts['cell_s']}s"}
                kill_at = time.monotonic()
            if kill_at is not None and time.monotonic() >= kill_at:
                for p in procs:
                    if p.is_alive():
                        p.kill()
    finally:  # also on KeyboardInterrupt: no rank outlives the cell
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
    codes = [p.exitcode for p in procs]
    if error is None and any(c != 0 for c in codes):
        r = next(i for i, c in enumerate(codes) if c != 0)
        error = _describe(r, codes[r], cell_dir)
    return LaunchResult(ok=error is None, exitcodes=codes, error=error)
