"""Step-time statistics over the timed steps only: ``summary.json[timing]``.

Timed steps (``Schedule.timed``) exclude warm-up and every step on which another probe ran (profiler,
memory tracking), so their times are not polluted by measurement. A step's time is the slowest rank's (data
parallelism waits for it); the statistics are taken over steps. When the coefficient of variation exceeds
:data:`CV_UNSTABLE` the cell is flagged ``unstable``: compare such cells by trend only, never by a ratio.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import pandas as pd

from zeroexp.probes.base import Probe, ProbeReport

__all__ = ["TimingProbe", "step_statistics", "CV_UNSTABLE"]

#: Above 5 % step-to-step variation a difference between strategies of a few percent is noise.
CV_UNSTABLE = 0.05


def step_statistics(step_ms: Sequence[float], cv_limit: float = CV_UNSTABLE) -> dict[str, Any]:
    """Median, P95, CV and the ``unstable`` flag of a series of step times (ms).

    P95 interpolates linearly between order statistics (numpy's default); CV is the population standard
    deviation over the mean; ``unstable`` is ``cv > cv_limit``.
    """
    a = np.asarray(step_ms, dtype=float)
    if a.size == 0:
        raise ValueError("no timed steps")
    cv = float(a.std() / a.mean())
    return {"median_ms": float(np.median(a)), "p95_ms": float(np.percentile(a, 95)), "cv": cv,
            "unstable": bool(cv > cv_limit), "timed_steps": int(a.size)}


class TimingProbe(Probe):
    """Wall time of each timed step on each rank, with a device synchronisation on CUDA at both ends."""

    name = "timing"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.step_ms: list[tuple[int, float]] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx in self.ctx.schedule.timed:
            self.sync_device()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx in self.ctx.schedule.timed:
            self.sync_device()
            self.step_ms.append((batch_idx, (time.perf_counter() - self._t0) * 1e3))

    def rank_result(self) -> dict[str, Any]:
        return {"step_ms": self.step_ms}

    @classmethod
    def aggregate(cls, results, cfg) -> ProbeReport:
        frame = pd.DataFrame([(r, s, ms) for r, res in enumerate(results) for s, ms in res["step_ms"]],
                             columns=["rank", "step", "step_ms"])
        slowest = frame.groupby("step").step_ms.max()  # per step: the rank everybody waited for
        section = step_statistics(slowest.to_numpy())
        section.update(
            steps=[int(s) for s in slowest.index],
            step_ms=[float(v) for v in slowest.values],
            rank_median_ms=[float(v) for v in frame.groupby("rank").step_ms.median()],
            note=("unstable: CV > 5 %, compare strategies by trend only, not by a ratio of times"
                  if section["unstable"] else "stable: CV <= 5 %"),
        )
        return ProbeReport(section=section)
