"""The fault-injection matrix: one row per fault, each on the smallest cell that shows it (2 ranks, the small
Linear stack of ``conftest.BASE``, few steps). Every row asserts the cell's recorded state (``manifest.json``:
status, error) and that no process is left behind.

Faults inside a rank come from ``zeroexp.rank.faults`` (``ZEROEXP_FAULT``); faults of the main process are signals sent
to a ``python -m zeroexp`` in its own session. Elsewhere, not repeated here: a sweep that survives a failed cell and
resumes it, and a sweep stopped by SIGTERM (tests/test_reliability.py); a rank error as one line without tensor
values (same file); a write killed mid-way (``test_a_killed_write_never_leaves_a_truncated_file``). The rows that
signal a running ``python -m zeroexp`` first check, while its cell trains, that every listening socket of its
processes (main, forkserver, ranks) is on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from zeroexp.launch.progress import read_progress
from zeroexp.rank.deathsig import die_with_parent
from zeroexp.results.files import read_json

pytestmark = pytest.mark.serial  # fresh interpreters waited on with timeouts: run alone (conftest, Makefile)

SMALL = ("world_size=2", "timeout.collective_s=4", "timeout.grace_s=1")
#: collective timeout + grace + start-up (a cold forkserver: ~9 s, more on 2 shared cores)
BOUND_S = 4 + 1 + 55


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ZEROEXP"))}
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    """Running (a zombie is dead for our purposes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the main process of a run started with ``start_new_session``, its
    forkserver, resource tracker and ranks)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(d.name))
    return found


def wait_until_gone(sid: int, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _as_from_a_terminal() -> None:
    """In the child before exec: Ctrl-C's default disposition and no blocked signals, as a shell's foreground job
    starts (the test process may hold SIGINT ignored or blocked from an earlier test's machinery; a CI run saw the
    ctrl_c row's cell train on through the signal for 60 s, once; `make test` runs this module in the background,
    where SIGINT starts ignored). And SIGTERM when the test process dies: a run in a session of its own is not in the
    group a Ctrl-C or a stopped `make test` signals, and would train on. Nothing imported here: a fork's child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    die_with_parent(signal.SIGTERM)


def start_cli(tmp_path: Path, *args: str, logger: str = "none") -> tuple[subprocess.Popen, Path]:
    """``python -m zeroexp`` on a long 2-rank cell, in its own session; returns once its ranks exist."""
    cell = tmp_path / "cell"
    proc = subprocess.Popen([sys.executable, "-m", "zeroexp", f"logger={logger}", "world_size=2", "model.width=32",
                             "steps=100000", f"hydra.run.dir={cell}", *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)
    deadline, pids = time.monotonic() + 120, []
    while time.monotonic() < deadline and not pids:
        time.sleep(0.2)
        try:
            pids = [r["pid"] for r in read_json(cell / "manifest.json").get("ranks") or []]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    assert pids and all(_alive(p) for p in pids), "ranks never started"
    while time.monotonic() < deadline and not (read_progress(cell) or {}).get("step"):
        time.sleep(0.2)  # rank 0 has finished a step: every rank has joined its process group and trains
    assert (read_progress(cell) or {}).get("step"), "no training step finished"
    return proc, cell


def _tree(root: int) -> set[int]:
    """``root`` and every process below it (from /proc/<pid>/stat)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def listening_addresses(pids: set[int]) -> set[str]:
    """The local addresses of the listening TCP sockets (IPv4 and IPv6) that ``pids`` hold, from /proc/net/tcp*."""
    import socket as so

    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    found = set()
    for name, family in (("tcp", so.AF_INET), ("tcp6", so.AF_INET6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            addr = bytes.fromhex(f[1].split(":")[0])
            addr = b"".join(addr[i:i + 4][::-1] for i in range(0, len(addr), 4))  # each 32-bit word is host order
            found.add(so.inet_ntop(family, addr))
    return found


# --- faults inside a rank: run_cell in this process ----------------------------------------------------------
IN_RANK = {  # row: (ZEROEXP_FAULT, failed rank, manifest error cause, words of its message)
    "raise": ("1:4:raise", 1, "exception", "RuntimeError: injected fault"),
    "kill": ("1:4:kill", 1, "signal", "killed by SIGKILL"),
    "hang": ("1:4:hang", 1, "hang", "stopped responding"),
    "memory": ("1:4:memory", 1, "exception", "MemoryError: injected fault"),
    "enospc": ("0:1:enospc", 0, "exception", "No space left on device"),  # rank 0's second result file
}
#: faults of the main process: the signal, how it is sent, the exit code
MAIN = {"ctrl_c": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP, "sigkill": signal.SIGKILL}


@pytest.mark.parametrize("row", [*IN_RANK, *MAIN, "stale_sweep"])
def test_fault_matrix(row, compose, tmp_path, monkeypatch):
    if row in IN_RANK:
        return _in_rank(row, compose, tmp_path, monkeypatch)
    if row in MAIN:
        return _main_process(MAIN[row], tmp_path)
    return _stale_sweep(compose, tmp_path)


def _in_rank(row: str, compose, tmp_path: Path, monkeypatch) -> None:
    from zeroexp.launch.runner import run_cell

    fault, rank, cause, words = IN_RANK[row]
    monkeypatch.setenv("ZEROEXP_FAULT", fault)
    cell = tmp_path / "cell"
    t0 = time.monotonic()
    result = run_cell(compose(*SMALL), cell)
    assert time.monotonic() - t0 < BOUND_S
    m = read_json(cell / "manifest.json")
    assert result.status == m["status"] == "failed", m["error"]
    assert (m["error"]["rank"], m["error"]["cause"]) == (rank, cause), m["error"]
    assert words in m["error"]["message"], m["error"]
    assert len(m["ranks"]) == 2 and m["ranks"][rank]["exitcode"] not in (None, 0)
    assert not any(_alive(r["pid"]) for r in m["ranks"])  # every rank reaped
    assert not (cell / "summary.json").exists()  # nothing claims ok
    assert not list(cell.rglob("*.tmp")), list(cell.rglob("*.tmp"))  # no temporary file of a write left
    if row == "enospc":  # the first result file was whole: marked partial; the second never got its name
        assert m["partial_files"] and all(f.endswith(".partial") for f in m["partial_files"]), m
        assert not list(cell.glob("*.csv"))
        for name in m["partial_files"]:
            text = (cell / name).read_text()
            assert text.endswith("\n") and len(text.splitlines()) > 1, name  # whole (header and rows)


@pytest.mark.parametrize("fault", [None, "1:4:perturb"])
def test_the_exit_code_says_whether_every_check_passed(fault, tmp_path):
    """``python -m zeroexp world_size=2`` exits 0: it ran and every check is PASS or n/a; with rank 1 training on
    other data from step 4 the cell still runs, its equivalence FAILs, and it exits 3 (a failed run exits 1: the
    rows above)."""
    from zeroexp.report.checks import failed_checks

    cell = tmp_path / "cell"
    proc = run_cli("logger=none", "model.width=32", "steps=9", *SMALL, f"hydra.run.dir={cell}", cwd=tmp_path,
                   env=_env(**({"ZEROEXP_FAULT": fault} if fault else {})))  # python -m zeroexp, in this process
    assert read_json(cell / "manifest.json")["status"] == "ok"
    failed = [c.name for c in failed_checks(read_json(cell / "summary.json"))]
    assert proc.returncode == (3 if failed else 0) == (3 if fault else 0), (failed, proc.stdout + proc.stderr)
    assert ("equivalence" in failed) == bool(fault), failed
    assert proc.stdout.strip().splitlines()[-1] == str(cell)  # the directory is still the last line


def _main_process(sig: signal.Signals, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground group), SIGTERM or SIGHUP to the main process: the cell ends within
    ``timeout.grace_s`` of it, recorded ``failed`` naming the signal; exit 128 + the signal. SIGKILL: the manifest
    cannot be updated (it stays ``running``; a resumed sweep re-runs it), but no rank, forkserver or resource
    tracker outlives the main process. Before the signal, while the cell trains: nothing of it listens beyond
    loopback. The handled signals run the cell with its W&B run (offline): no process of the run's tree (W&B's
    service and monitor, each in a session of its own, included) outlives the main process by 1 s."""
    proc, cell = start_cli(tmp_path, "timeout.grace_s=5", logger="none" if sig == signal.SIGKILL else "wandb")
    pids = [r["pid"] for r in read_json(cell / "manifest.json")["ranks"]]
    # While the cell trains, every listening socket of the main process, its forkserver and its ranks is on
    # loopback: the rendezvous store the main process serves on 127.0.0.1, gloo's sockets (GLOO_SOCKET_IFNAME=lo).
    seen = set()
    for _ in range(4):
        seen |= listening_addresses(_tree(proc.pid))
        time.sleep(0.5)
    assert seen and seen <= {"127.0.0.1", "::1"}, seen
    tree = _tree(proc.pid) - {proc.pid}  # every process below the main one, whatever its session
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal does: the whole foreground group
    else:
        os.kill(proc.pid, sig)  # kill, SLURM, the OOM killer: the main process alone
    out, _ = proc.communicate(timeout=60)
    if sig != signal.SIGKILL:
        assert time.monotonic() - t0 < 5 + 3, out  # within the grace (and Python's exit)
        assert proc.returncode == 128 + sig, out
        assert f"stopped by {sig.name}" in out and "Traceback" not in out, out
        exited = time.monotonic()
        while (left := [p for p in tree if _alive(p)]) and time.monotonic() < exited + 1:
            time.sleep(0.05)
        assert left == [], [(p, Path(f"/proc/{p}/cmdline").read_bytes()[:80]) for p in left if _alive(p)]
    assert wait_until_gone(proc.pid, 30) == []  # nothing of the run's session is left
    assert not any(_alive(p) for p in pids)
    m = read_json(cell / "manifest.json")
    if sig == signal.SIGKILL:
        assert m["status"] == "running"
        return
    assert m["status"] == "failed", m
    assert m["error"]["cause"] == "interrupted" and m["error"]["signal"] == sig.name, m["error"]
    assert sig.name in m["error"]["message"]
    assert not (cell / "summary.json").exists() and not list(cell.glob("*.csv"))


def _stale_sweep(compose, tmp_path: Path) -> None:
    """A sweep directory left by a killed run (a manifest still ``running``, a partial result, a temporary file,
    rank files): ``resume=true`` re-runs that cell from clean and it ends ok."""
    from zeroexp.cell.identity import cell_name

    sweep = tmp_path / "sweep"
    args = ("logger=none", "model.width=32", "steps=9", *SMALL)
    stale = sweep / cell_name(compose(*args, base=()))  # the cell the command below runs
    (stale / ".ranks").mkdir(parents=True)
    (stale / "manifest.json").write_text(json.dumps({"status": "running", "started_at": "stale", "ranks": None}))
    (stale / "iterations.csv.partial").write_text("step,loss\n1,0.5\n")
    (stale / ".summary.json.abc.tmp").write_text('{"status": "o')
    (stale / ".ranks" / "rank0.json").write_text("{}")
    proc = run_cli("--multirun", *args, f"hydra.sweep.dir={sweep}", "resume=true", cwd=tmp_path,
                   env=_env())  # python -m zeroexp, in this process
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = read_json(stale / "manifest.json")
    assert m["status"] == "ok" and m["started_at"] != "stale"
    assert read_json(stale / "summary.json")["status"] == "ok"
    assert not list(stale.glob("*.partial")) and not list(stale.glob("*.tmp"))
    assert not any(_alive(r["pid"]) for r in m["ranks"])
