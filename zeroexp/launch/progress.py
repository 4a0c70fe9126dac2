"""Progress you can see while a cell trains, and while a sweep runs its cells: the launching process's side.

Rank 0 writes ``.progress.json`` in the cell directory after each training step (:mod:`zeroexp.rank.progress`). The
process that launched the ranks polls it while it waits (:func:`watch_progress`): on an interactive terminal a rich
progress bar, otherwise (logs, CI, tests) a plain line at most every :data:`LINE_EVERY_S` and one at the last step.
Both go to stderr: stdout stays the status, the digest and the cell directory. A sweep prints ``cell i of n: <name>``
and its ETA from the cells finished so far (:class:`SweepClock`). This module imports neither torch nor Lightning.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

from zeroexp.rank.progress import PROGRESS_FILE

__all__ = ["read_progress", "format_line", "watch_progress", "SweepClock", "SWEEP_CLOCK", "fmt_duration"]

LINE_EVERY_S = 5.0
POLL_S = 0.25


def fmt_duration(seconds: float | None) -> str:
    """``75.2`` -> ``1:15``; ``3725`` -> ``1:02:05``; None -> ``?``."""
    if seconds is None:
        return "?"
    s = max(0, int(round(seconds)))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


def read_progress(cell_dir: Path | str) -> dict[str, Any] | None:
    """The last record rank 0 wrote, or None (not started, a dry run, unreadable)."""
    try:
        with open(Path(cell_dir) / PROGRESS_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def format_line(name: str, rec: dict[str, Any], elapsed_s: float) -> str:
    """One plain progress line: ``<name>: step 7 of 30, loss 0.1235, step 34.1 ms, elapsed 0:12, ETA 0:20``."""
    loss = rec.get("loss")
    step_ms = 1e3 * float(rec.get("step_s") or 0.0)
    return (f"{name}: step {rec['step']} of {rec['steps']}, loss {'?' if loss is None else f'{loss:.4g}'}, "
            f"step {step_ms:.1f} ms, elapsed {fmt_duration(elapsed_s)}, ETA {fmt_duration(rec.get('eta_s'))}")


class _Plain:
    def __init__(self, name: str, stream: TextIO, every_s: float) -> None:
        self.name, self.stream, self.every_s = name, stream, every_s
        self.t0 = self._last = time.monotonic()
        self._final_shown = False

    def show(self, rec: dict[str, Any] | None, final: bool = False) -> None:
        if rec is None or self._final_shown:
            return
        now = time.monotonic()
        last_step = rec["step"] >= rec["steps"]
        if last_step or now - self._last >= self.every_s:
            self._last, self._final_shown = now, last_step
            print(format_line(self.name, rec, now - self.t0), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class _Bar:
    def __init__(self, name: str, stream: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}  step {task.fields[step_ms]}"),
                                 TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"),
                                 console=Console(file=stream), transient=False)
        self.task = self.progress.add_task(name, total=None, loss="?", step_ms="?", eta="?")
        self.progress.start()

    def show(self, rec: dict[str, Any] | None, final: bool = False) -> None:
        if rec is None:
            return
        loss = rec.get("loss")
        self.progress.update(self.task, total=rec["steps"], completed=rec["step"],
                             loss="?" if loss is None else f"{loss:.4g}",
                             step_ms=f"{1e3 * float(rec.get('step_s') or 0.0):.1f} ms",
                             eta=fmt_duration(rec.get("eta_s")))

    def close(self) -> None:
        self.progress.stop()


@contextmanager
def watch_progress(cell_dir: Path | str, name: str | None = None, stream: TextIO | None = None,
                   interactive: bool | None = None, line_every_s: float | None = None) -> Iterator[None]:
    """While the body runs (the ranks train), show rank 0's progress from ``cell_dir/.progress.json``.

    ``interactive`` (default: ``stream`` is a terminal): a rich bar; else plain lines (:func:`format_line`) at
    most every ``line_every_s`` seconds (default :data:`LINE_EVERY_S`), and one at the last step. A background thread
    polls; it is stopped and joined, and the file read a last time, before this returns."""
    cell_dir, stream = Path(cell_dir), stream if stream is not None else sys.stderr
    name = name or cell_dir.name
    if interactive is None:
        interactive = hasattr(stream, "isatty") and stream.isatty()
    view: Any = (_Bar(name, stream) if interactive
                 else _Plain(name, stream, LINE_EVERY_S if line_every_s is None else line_every_s))
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            view.show(read_progress(cell_dir))

    thread = threading.Thread(target=poll, name="zeroexp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        view.show(read_progress(cell_dir), final=True)
        view.close()


@dataclass
class SweepClock:
    """A local ``--multirun``'s jobs: how many, and how long the cells run so far took (for the ETA)."""

    jobs: int = 0
    durations: list[float] = field(default_factory=list)
    done: set[int] = field(default_factory=set)

    def start(self, jobs: int) -> None:
        self.jobs, self.durations, self.done = jobs, [], set()

    def line(self, job: int, name: str) -> str:
        """``cell 3 of 6: <name>`` and, once a cell has run, the sweep's ETA (mean cell time x cells left)."""
        head = f"cell {job + 1} of {self.jobs}: {name}" if self.jobs else f"cell {job + 1}: {name}"
        if not self.durations or not self.jobs:
            return head
        left = self.jobs - job
        mean = sum(self.durations) / len(self.durations)
        return f"{head}  (sweep ETA {fmt_duration(mean * left)}, {mean:.1f} s per cell so far)"

    def finished(self, job: int, seconds: float) -> None:
        if job not in self.done:
            self.done.add(job)
            self.durations.append(seconds)


#: The sweep of this process (Hydra's basic launcher runs every job here): set by ``zeroexp.cli.sweep.SweepSummary``.
SWEEP_CLOCK = SweepClock()
