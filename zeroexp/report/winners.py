"""What won a sweep, on every axis: the fastest cell, the lowest peak, the least communication, and the trade-off
between them in one line.

Only cells that trained and whose checks passed compete (:func:`zeroexp.report.checks.failed_checks` finds none);
a cell that failed or errored, or failed a check, or a dry run (nothing measured) is named as not competing, never
dropped in silence. The figures are measured, each cell's own:

- step time: ``timing.median_ms``, the median of the timed steps (slowest rank per step), with the bootstrap 95 % CI
  of that median (``plan.time.median_ci95_ms``; computed by the same :func:`zeroexp.plan.check.step_time.median_ci95`
  from
  ``timing.step_ms`` where a cell has no plan). Two cells tie when their CIs overlap;
- peak: ``memory.peak_bytes_max``, the worst rank's training peak. Exact: a tie is equality;
- communication: the bus bytes per step of rank 0's collectives (``collectives.bus_bytes`` summed over ops: what the
  ring model puts on a rank's links, docs/results.md). Exact: a tie is equality. A cell that ran an op with no bus
  factor has no such figure and does not compete on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from zeroexp.report.checks import failed_checks
from zeroexp.report.verdicts import _nested
from zeroexp.results.cells import is_dry_run
from zeroexp.results.format import byte_unit, fmt_ms, missing

__all__ = ["Figure", "Winners", "winners"]


@dataclass(frozen=True)
class Figure:
    """One cell's measured figure on an axis: its ``value`` and the interval it is known within (``low`` = ``high``
    = ``value`` for exact figures)."""

    label: str
    value: float
    low: float
    high: float

    def ties(self, other: Figure) -> bool:
        """Within each other's spread: the intervals overlap (for exact figures: equal)."""
        return self.low <= other.high and other.low <= self.high


@dataclass
class Axis:
    """An axis the cells compete on: the line's ``title``, the ``noun`` of the trade-off line, how a figure and a
    difference of two are written, and each competing cell's :class:`Figure` (lowest first)."""

    title: str
    noun: str
    fmt: Callable[[Figure], str]
    diff: Callable[[float], str]
    figures: list[Figure]
    missing: list[str] = field(default_factory=list)  # competing cells without this figure, with why

    def winners(self) -> list[Figure]:
        """The lowest figure and every figure tied with it."""
        return [f for f in self.figures if f.ties(self.figures[0])] if self.figures else []

    def of(self, label: str) -> Figure | None:
        return next((f for f in self.figures if f.label == label), None)


@dataclass
class Winners:
    """``lines``: one per axis, the trade-off, the cells not competing; ``note``: what the figures are and when two
    tie; ``excluded``: a phrase per cell not competing. The same sentences in every renderer."""

    lines: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    note: str = ""


#: What the figures are, under the lines.
NOTE = ("Only cells that trained and passed every check compete; all figures measured. Step time: the median of the "
        "timed steps (slowest rank per step) with the bootstrap 95 % CI of the median in brackets; two cells tie when "
        "their CIs overlap. Peak: the worst rank's training peak (memory.peak_bytes_max). Communication: rank 0's bus "
        "bytes per step, summed over ops (collectives.bus_bytes). Peak and bytes are exact: a tie is equality. "
        "Runner-up: the best cell not tied with the winner, and how much more it takes.")


def _time_figure(row: pd.Series) -> Figure | None:
    median = row.get("timing.median_ms")
    if missing(median):
        return None
    ci = row.get("plan.time.median_ci95_ms")
    if not isinstance(ci, (list, tuple)) or len(ci) != 2:
        steps = row.get("timing.step_ms")
        if not isinstance(steps, (list, tuple)) or not steps:
            return Figure(str(row["label"]), float(median), float(median), float(median))
        from zeroexp.plan.check.step_time import median_ci95

        _, *ci = median_ci95(steps)
    return Figure(str(row["label"]), float(median), float(ci[0]), float(ci[1]))


def _exact(value: Any, label: str) -> Figure | None:
    return None if missing(value) else Figure(label, float(value), float(value), float(value))


def _bus_bytes(row: pd.Series) -> tuple[Figure | None, str]:
    """Rank 0's bus bytes per step over every op it ran, or None and why."""
    label = str(row["label"])
    if missing(row.get("collectives.payload_total_bytes")):
        return None, f"{label} (no collectives section)"
    ops = [k.removeprefix("collectives.payload_bytes.") for k in row.index
           if k.startswith("collectives.payload_bytes.") and not missing(row[k])]
    no_factor = [op for op in ops if missing(row.get(f"collectives.bus_bytes.{op}"))]
    if no_factor:
        return None, f"{label} (ran {', '.join(no_factor)}, which has no bus factor)"
    return _exact(sum(float(row[f"collectives.bus_bytes.{op}"]) for op in ops), label), ""


def _axes(competing: pd.DataFrame) -> list[Axis]:
    times: list[Figure] = []
    peaks: list[Figure] = []
    comms: list[Figure] = []
    no_time: list[str] = []
    no_peak: list[str] = []
    no_comm: list[str] = []
    for _, row in competing.iterrows():
        label = str(row["label"])
        t = _time_figure(row)
        times.append(t) if t else no_time.append(f"{label} (no timed steps)")
        p = _exact(row.get("memory.peak_bytes_max"), label)
        peaks.append(p) if p else no_peak.append(f"{label} (no memory section)")
        c, why = _bus_bytes(row)
        comms.append(c) if c else no_comm.append(why)
    peak_unit = byte_unit(f.value for f in peaks)
    comm_unit = byte_unit(f.value for f in comms)
    return [
        Axis("Fastest (median step time)", "step time",
             lambda f: f"{fmt_ms(f.value)} ms [{fmt_ms(f.low)}, {fmt_ms(f.high)}]", lambda d: f"{fmt_ms(d)} ms",
             sorted(times, key=lambda f: f.value), no_time),
        Axis("Lowest peak (worst rank)", "peak", lambda f: f"{peak_unit(f.value)} {peak_unit.name}",
             lambda d: f"{d:,.0f} B", sorted(peaks, key=lambda f: f.value), no_peak),
        Axis("Least communication (bus bytes per step)", "bytes", lambda f: f"{comm_unit(f.value)} {comm_unit.name}",
             lambda d: f"{d:,.0f} B", sorted(comms, key=lambda f: f.value), no_comm),
    ]


def _gap(axis: Axis, a: Figure, b: Figure) -> str:
    """How much more ``b`` is than ``a``: in per cent (where ``a`` is not 0) and in the figure's units."""
    return (f"+{100 * (b.value / a.value - 1):.1f} %, " if a.value else "") + f"+{axis.diff(b.value - a.value)}"


def _axis_line(axis: Axis) -> str:
    head = f"{axis.title}: "
    if not axis.figures:
        return head + "n/a (no competing cell has this figure)."
    won = axis.winners()
    first = won[0]
    line = head + f"{first.label}, {axis.fmt(first)}"
    if len(won) > 1:
        line += ", tied with " + ", ".join(f"{f.label} {axis.fmt(f)}" for f in won[1:])
    rest = axis.figures[len(won):]
    if rest:
        line += f"; runner-up {rest[0].label}, {axis.fmt(rest[0])} ({_gap(axis, first, rest[0])})"
    elif len(axis.figures) == 1:
        line += " (the only competing cell)"
    else:
        line += " (every competing cell ties)"
    if axis.missing:
        line += f"; not ranked: {', '.join(axis.missing)}"
    return line + "."


def _relation(axis: Axis, a: str, b: str) -> str:
    """``a``'s figure against ``b``'s in words: ``38 % less peak``, ``1.60× the step time``, ``the same bytes``."""
    fa, fb = axis.of(a), axis.of(b)
    if fa is None or fb is None:
        return f"{axis.noun} n/a"
    if fa.ties(fb):
        return f"the same {axis.noun}" + (" (95 % CIs overlap)" if fa.low != fa.high or fb.low != fb.high else "")
    if fa.value < fb.value:
        return f"{100 * (1 - fa.value / fb.value):.0f} % less {axis.noun}"
    return f"{fa.value / fb.value:.2f}× the {axis.noun}" if fb.value else f"{axis.noun} where it has none"


def _trade_off(axes: list[Axis]) -> str:
    """One line: what the lowest peak and the least communication cost on the other axes, against the fastest."""
    if not all(a.figures for a in axes):
        return "Trade-off: n/a (an axis has no competing cell)."
    sets = [{f.label for f in a.winners()} for a in axes]
    every = [f.label for f in axes[0].figures if all(f.label in s for s in sets)]
    if every:
        return f"Trade-off: none: {every[0]} is fastest, lowest in peak and least in communication (or ties each)."
    fast = axes[0].figures[0].label
    parts, spoken = [], set()
    for i in (1, 2):  # the lowest peak, then the least communication, each against the fastest
        best = axes[i].figures[0].label
        if fast in sets[i] or best in spoken:
            continue  # the fastest wins this axis too, or that cell was already weighed
        spoken.add(best)
        others = [axes[j] for j in (0, 1, 2) if j != i]
        parts.append(f"{best}: {_relation(axes[i], best, fast)} than {fast} for "
                     + " and ".join(_relation(o, best, fast) for o in others))
    return "Trade-off: " + "; ".join(parts) + "."


def _not_competing(cells: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The cells that compete, and a phrase per cell that does not, saying why."""
    dry = list(is_dry_run(cells)) if len(cells) else []
    keep, out = [], []
    for (_, row), is_dry in zip(cells.iterrows(), dry):
        label = row["label"]
        if row.get("status") != "ok":
            out.append(f"{label} (cell {row.get('status')})")
        elif failed := failed_checks(_nested(row)):
            out.append(f"{label} ({', '.join(f'{c.name} {c.verdict}' for c in failed)})")
        elif is_dry:
            out.append(f"{label} (dry run: nothing measured)")
        else:
            keep.append(True)
            continue
        keep.append(False)
    return cells[keep] if len(cells) else cells, out


def winners(cells: pd.DataFrame) -> Winners:
    """What won among ``cells`` (ladder order, with ``label``): a line per axis, the trade-off, the excluded."""
    competing, excluded = _not_competing(cells)
    if competing.empty:
        return Winners(["n/a: no cell trained and passed its checks."]
                       + ([f"Not competing: {', '.join(excluded)}."] if excluded else []), excluded)
    axes = _axes(competing)
    lines = [_axis_line(a) for a in axes] + [_trade_off(axes)]
    lines.append(f"Not competing (only cells whose checks passed do): {', '.join(excluded)}." if excluded
                 else f"Competing: all {len(competing)} cells (every check passed).")
    return Winners(lines, excluded, NOTE)
