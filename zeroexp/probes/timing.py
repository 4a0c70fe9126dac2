"""Step-time statistics over the timed steps only: ``summary.json[timing]``.

Timed steps (``Schedule.timed``) exclude warm-up and every step on which another probe ran (profiler,
memory tracking), so their times are not polluted by measurement. A step's time is the slowest rank's (data
parallelism waits for it); the statistics are taken over steps. When the coefficient of variation exceeds
:data:`CV_UNSTABLE` the cell is flagged ``unstable``: compare such cells by trend only, never by a ratio.
``host_activity``: what else ran on the host from the first timed step's start to the last one's end
(:func:`zeroexp.hostload.activity`: the host's busy CPU less the ranks' own), read outside the timed windows.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import pandas as pd

from zeroexp.devices import usable_cores
from zeroexp.hostload import activity, busy_cpu_s, own_cpu_s
from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.results.format import NA, fmt_int, fmt_ms, fmt_pct, missing
from zeroexp.results.section import Column, ReportTable, raw_rows
from zeroexp.cell.schedule import PROBE_STEPS

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


def timing_table(ok: pd.DataFrame) -> ReportTable:
    """Median and P95 step time, CV, the stability flag, and the comparison with the first cell: a ratio when
    both are stable, else a trend word (slower, faster, within noise)."""
    keys = ["timing.median_ms", "timing.p95_ms", "timing.cv", "timing.unstable", "timing.timed_steps"]
    raw = raw_rows(ok, keys)
    timed = raw.dropna(subset=["timing.median_ms"])
    base = timed.iloc[0] if len(timed) else None
    raw["vs first"] = [_trend(row, base) for _, row in raw.iterrows()]
    cols = [Column("cell", "label", str), Column("median ms", keys[0], fmt_ms), Column("P95 ms", keys[1], fmt_ms),
            Column("CV", keys[2], fmt_pct),
            Column("stability", keys[3], lambda v: NA if missing(v) else ("unstable" if bool(v) else "stable")),
            Column("timed steps", keys[4], fmt_int),
            Column(f"vs {base['label'] if base is not None else 'first'}", "vs first", str)]
    note = ("Slowest rank per timed step (warm-up and probed steps excluded). A cell with CV > 5 % is unstable: "
            "compare it by trend only; a ratio is given only when both cells are stable.")
    return ReportTable("timing", "Step time", raw, cols, note)


def timing_line(t: dict[str, Any]) -> str:
    word = "unstable: a trend, not a figure" if t.get("unstable") else "stable"
    cores = t.get("cores") or {}
    sliced = f"; {cores['ranks']} ranks on {cores['cores']} cores: time-sliced" if cores.get("time_sliced") else ""
    return (f"median {fmt_ms(t.get('median_ms'))} ms, P95 {fmt_ms(t.get('p95_ms'))} ms, CV {fmt_pct(t.get('cv'))} "
            f"over {t.get('timed_steps')} steps ({word}{sliced})")


class TimingProbe(Probe):
    """Wall time of each timed step on each rank, with a device synchronisation on CUDA at both ends."""

    name = "timing"
    order = 50
    steps = PROBE_STEPS["timing"]  # declared in zeroexp.cell.schedule
    dry_run_absent = "no step time: a fake step computes nothing and communicates with no peer"

    digest_line = staticmethod(timing_line)
    report_table = staticmethod(timing_table)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.step_ms: list[tuple[int, float]] = []
        self.phases: list[tuple[int, float, float, float]] = []  # (step, forward, backward, rest) ms
        self._t0 = 0.0
        self._marks: list[float] = []
        self._timed = False
        self._host_first: tuple[float, float | None, float] | None = None  # (wall, host busy, own CPU) seconds
        self._host_last: tuple[float, float | None, float] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._timed = batch_idx in self.ctx.schedule.timed
        if self._timed:
            if self._host_first is None:
                self._host_first = (time.perf_counter(), busy_cpu_s(), own_cpu_s())
            self.sync_device()
            self._t0 = time.perf_counter()
            self._marks = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._timed:
            self.sync_device()
            self._marks.append(time.perf_counter())

    def on_after_backward(self, trainer, pl_module) -> None:
        if self._timed:
            self.sync_device()
            self._marks.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._timed:
            self.sync_device()
            end = time.perf_counter()
            self.step_ms.append((batch_idx, (end - self._t0) * 1e3))
            self._host_last = (time.perf_counter(), busy_cpu_s(), own_cpu_s())
            if len(self._marks) == 2:  # one micro-batch: forward, backward, the rest (grad_accum > 1: step only)
                a, b = self._marks
                self.phases.append((batch_idx, (a - self._t0) * 1e3, (b - a) * 1e3, (end - b) * 1e3))

    def rank_result(self) -> dict[str, Any]:
        import socket

        return {"step_ms": self.step_ms, "phases": self.phases, "hostname": socket.gethostname(),
                "host": [*self._host_first, *self._host_last] if self._host_first and self._host_last else None,
                "cores": usable_cores()}

    @classmethod
    def aggregate(cls, results, cell) -> ProbeReport:
        frame = pd.DataFrame([(r, s, ms) for r, res in enumerate(results) for s, ms in res["step_ms"]],
                             columns=["rank", "step", "step_ms"])
        slowest = frame.groupby("step").step_ms.max()  # per step: the rank everybody waited for
        section = step_statistics(slowest.to_numpy())
        section.update(
            steps=[int(s) for s in slowest.index],
            step_ms=[float(v) for v in slowest.values],
            rank_median_ms=[float(v) for v in frame.groupby("rank").step_ms.median()],
            phase_ms=_phases(results),
            host_activity=_host(results),
            cores=_cores(results),
            note=("unstable: CV > 5 %, compare strategies by trend only, not by a ratio of times"
                  if section["unstable"] else "stable: CV <= 5 %"),
        )
        if section["cores"] and section["cores"]["time_sliced"]:
            c = section["cores"]
            section["note"] += (f"; {c['ranks']} ranks time-sliced on {c['cores']} cores of rank 0's host: the step "
                                "times are a property of the slicing, not of the strategy alone")
        return ProbeReport(section=section)


def _cores(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Rank 0's host: its ranks (by host name) and the cores they may run on (rank 0's affinity); ``time_sliced`` when
    the ranks outnumber the cores (a CPU cell: each rank computes on at least one thread). None where no rank said
    (a summary of older ranks)."""
    here = [res for res in results if res.get("hostname") == results[0].get("hostname")]
    if not here or results[0].get("cores") is None:
        return None
    cores = int(results[0]["cores"])
    return {"ranks": len(here), "cores": cores, "time_sliced": len(here) > cores}


def _host(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What else ran on rank 0's host over the timed steps: rank 0's window (its wall and its host's busy CPU) less
    the own CPU over their windows of every rank on that host (by host name: other nodes' ranks run elsewhere); None
    where such a rank has no window or the host's counters are unreadable."""
    here = [res.get("host") for res in results if res.get("hostname") == results[0].get("hostname")]
    if not here or any(w is None for w in here):
        return None
    wall0, busy0, _, wall1, busy1, _ = here[0]
    busy = None if busy0 is None or busy1 is None else busy1 - busy0
    return activity(wall1 - wall0, busy, sum(w[5] - w[2] for w in here))


def _phases(results: list[dict[str, Any]]) -> dict[str, float] | None:
    """Per phase of a timed step, the median over steps and ranks (ms): ``forward`` (batch start to
    ``on_before_backward``: zero_grad, forward, the loss), ``backward`` (to ``on_after_backward``: every wait on
    backward's collectives included), ``optimizer`` (to batch end: clipping, the step, what the strategy sends
    after it, the loop's logging). None under gradient accumulation (its micro-batches' hooks repeat)."""
    rows = [p for res in results for p in res.get("phases", [])]
    if not rows:
        return None
    a = np.asarray([p[1:] for p in rows], dtype=float)
    return {k: float(v) for k, v in zip(("forward", "backward", "optimizer"), np.median(a, axis=0))}


# The digest line and the report section (Probe.digest_line, Probe.report_table).


def _trend(row: pd.Series, base: pd.Series | None) -> str:
    if base is None or missing(row["timing.median_ms"]):
        return NA
    if row["label"] == base["label"]:
        return "baseline"
    ratio = float(row["timing.median_ms"]) / float(base["timing.median_ms"])
    if not bool(row["timing.unstable"]) and not bool(base["timing.unstable"]):
        return f"{ratio:.2f}×"
    noise = max(float(row["timing.cv"]), float(base["timing.cv"]))
    return "≈ (within noise)" if abs(ratio - 1) <= noise else ("slower (trend)" if ratio > 1 else "faster (trend)")

