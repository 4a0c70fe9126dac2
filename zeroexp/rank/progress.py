"""Progress you can see while a cell trains: rank 0's side, the writer.

Rank 0 writes ``.progress.json`` in the cell directory after each training step (:class:`StepRecorder`, through
:func:`write_progress`: at most every :data:`WRITE_EVERY_S` and always at the last step; atomically, no fsync). The
launching process polls it (:mod:`zeroexp.launch.progress`). This module imports neither torch nor Lightning.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["PROGRESS_FILE", "WRITE_EVERY_S", "write_progress", "StepRecorder"]

PROGRESS_FILE = ".progress.json"
WRITE_EVERY_S = 0.5


def write_progress(cell_dir: Path | str, record: dict[str, Any]) -> None:
    """Atomically replace ``cell_dir/.progress.json`` with ``record`` (a reader never sees half a file)."""
    cell_dir = Path(cell_dir)
    fd, tmp = tempfile.mkstemp(prefix=f"{PROGRESS_FILE}.", suffix=".tmp", dir=cell_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, cell_dir / PROGRESS_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StepRecorder:
    """Rank 0's side: call :meth:`step` after each training step; writes the record when due."""

    def __init__(self, cell_dir: Path | str, steps: int, every_s: float = WRITE_EVERY_S) -> None:
        self.cell_dir, self.steps, self.every_s = Path(cell_dir), int(steps), every_s
        self.t0 = time.monotonic()
        self._last_write = float("-inf")
        self._last_step_end = self.t0

    def step(self, step: int, loss: float | None) -> None:
        """``step``: steps done (1-based)."""
        now = time.monotonic()
        step_s, self._last_step_end = now - self._last_step_end, now
        if step < self.steps and now - self._last_write < self.every_s:
            return
        self._last_write = now
        elapsed = now - self.t0
        write_progress(self.cell_dir, {
            "step": step, "steps": self.steps, "loss": loss, "step_s": step_s, "train_elapsed_s": elapsed,
            "eta_s": elapsed / step * (self.steps - step) if step else None, "time": time.time()})
