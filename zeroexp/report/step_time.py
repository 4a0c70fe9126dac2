"""Step time planned vs measured (``summary.json["plan"]["time"]``, :mod:`zeroexp.plan.check.step_time`): the digest
line, the
report's table and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from zeroexp.results.cells import column
from zeroexp.results.format import NA, fmt_ms, missing
from zeroexp.results.section import Column, ReportTable, raw_rows
from zeroexp.results.verdict import Verdict

__all__ = ["TimeSection", "time_table", "planned_vs_measured", "order_agreement"]

_KEYS = ["plan.time.predicted_step_ms", "plan.time.measured_median_ms", "plan.time.median_ci95_ms", "plan.time.ratio",
         "plan.time.exposed_comm_ms", "plan.time.measured_exposed_comm_ms", "plan.time.check", "plan.time.reasons",
         "plan.time.overlap_rule"]


def _ci(v: Any) -> str:
    return NA if not isinstance(v, (list, tuple)) or len(v) != 2 else f"[{fmt_ms(v[0])}, {fmt_ms(v[1])}]"


def _ratio(v: Any) -> str:
    return NA if missing(v) else f"{float(v):.2f}×"


def _first_reason(v: Any) -> str:
    return v[0] if isinstance(v, list) and v else ""


def order_agreement(rows: list[tuple[str, float, tuple[float, float], float]]) -> tuple[list[str], list[str]]:
    """Over ``(label, measured median, (CI low, high), predicted)`` rows: each pair whose measured CIs do not overlap
    (their order is known), as ``a < b``, split into those the prediction orders the same way and those it does
    not; a pair predicted equal is not ordered (a tie orders neither way)."""
    agree, disagree = [], []
    for i, (a, ma, ca, pa) in enumerate(rows):
        for b, mb, cb, pb in rows[i + 1:]:
            if ca[1] < cb[0] or cb[1] < ca[0]:
                fast, slow = (a, b) if ma < mb else (b, a)
                (agree if pa != pb and (pa < pb) == (ma < mb) else disagree).append(f"{fast} < {slow}")
    return agree, disagree


def _order_note(raw: pd.DataFrame) -> str:
    rows = [(str(r["label"]), float(r[_KEYS[1]]), tuple(r[_KEYS[2]]), float(r[_KEYS[0]])) for _, r in raw.iterrows()
            if not missing(r[_KEYS[0]]) and not missing(r[_KEYS[1]]) and isinstance(r[_KEYS[2]], (list, tuple))]
    agree, disagree = order_agreement(rows)
    if not agree and not disagree:
        return " Order: no two measured medians differ by more than their 95 % CIs."
    return (f" Order: of {len(agree) + len(disagree)} pairs whose measured CIs do not overlap, the prediction orders "
            f"{len(agree)} the same way" + (f"; not: {', '.join(disagree)}." if disagree else "."))


def time_table(ok: pd.DataFrame) -> ReportTable | None:
    """Per cell: predicted and measured step time (median, its 95 % CI), the ratio, predicted and measured exposed
    communication, the check and its first reason; None when no cell has ``plan.time``."""
    if all(missing(v) for v in column(ok, "plan.time.check")):
        return None
    raw = raw_rows(ok, _KEYS)
    cols = [Column("cell", "label", str), Column("predicted ms", _KEYS[0], fmt_ms),
            Column("median ms", _KEYS[1], fmt_ms), Column("95 % CI ms", _KEYS[2], _ci),
            Column("ratio", _KEYS[3], _ratio), Column("exposed ms P", _KEYS[4], fmt_ms),
            Column("exposed ms M", _KEYS[5], fmt_ms), Column("check", _KEYS[6]),
            Column("why", _KEYS[7], _first_reason)]
    note = ("Predicted (computed): zeroexp.formulas.predict_step over the cell's groups with this machine's "
            "calibration (python -m zeroexp.calibrate), nothing fitted to the cell. Measured: the median of the timed "
            "steps and its bootstrap 95 % CI; ratio: predicted / measured median; exposed communication predicted (P) "
            "and measured (M) on the profiled steps (a collective in flight, no compute op). "
            "PASS within 1.25× either way; n/a when the CI is wider than ±10 % or no calibration exists."
            + _order_note(raw))
    return ReportTable("time", "Step time: planned vs measured", raw, cols, note)


class TimeSection:
    """``plan.time`` shown like a probe's section: a digest line and a report table."""

    name = "plan.time"
    order = 71
    report_order = None

    @staticmethod
    def digest_line(t: dict[str, Any]) -> str:
        if t.get("predicted_step_ms") is None:
            return "; ".join(t.get("reasons", [])) or "not predicted"
        measured = t.get("measured_median_ms")
        line = (f"predicted {fmt_ms(t['predicted_step_ms'])} ms (exposed comm {fmt_ms(t.get('exposed_comm_ms'))}), "
                f"measured median {fmt_ms(measured)} ms {_ci(t.get('median_ci95_ms'))}")
        if t.get("ratio") is not None:
            line += f", ratio {t['ratio']:.2f}"
        return line + (f" ({t['reasons'][0]})" if t.get("check") != Verdict.PASS and t.get("reasons") else "")

    @staticmethod
    def report_table(ok: pd.DataFrame) -> ReportTable | None:
        return time_table(ok)


def planned_vs_measured(cells: pd.DataFrame, path: Path) -> Path | None:
    """Per cell: the measured median with its 95 % CI (bar and whisker) beside the predicted step, each split into
    exposed communication (hatched) and the rest."""
    from matplotlib.figure import Figure

    ok = cells[column(cells, "status") == "ok"]
    rows = [r for _, r in ok.iterrows() if not missing(r.get("plan.time.predicted_step_ms"))
            and not missing(r.get("plan.time.measured_median_ms"))]
    if not rows:
        return None
    fig = Figure(figsize=(min(24.0, max(6.0, 1.3 * len(rows) + 2)), 4.4), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Step time: predicted (computed) vs measured median with 95 % CI (ms); hatched: exposed comm",
                 fontsize=10)
    xs = range(len(rows))
    w = 0.38
    pred = [float(r["plan.time.predicted_step_ms"]) for r in rows]
    pexp = [float(r.get("plan.time.exposed_comm_ms") or 0.0) for r in rows]
    meas = [float(r["plan.time.measured_median_ms"]) for r in rows]
    mexp = [0.0 if missing(r.get("plan.time.measured_exposed_comm_ms")) else
            min(float(r["plan.time.measured_exposed_comm_ms"]), m) for r, m in zip(rows, meas)]
    ci = [r.get("plan.time.median_ci95_ms") or [m, m] for r, m in zip(rows, meas)]
    ax.bar([x - w / 2 for x in xs], pred, w, color="#8172B3", label="predicted")
    ax.bar([x - w / 2 for x in xs], pexp, w, color="none", edgecolor="white", hatch="//")
    ax.bar([x + w / 2 for x in xs], meas, w, color="#55A868", label="measured median",
           yerr=[[m - c[0] for m, c in zip(meas, ci)], [c[1] - m for m, c in zip(meas, ci)]], capsize=3)
    ax.bar([x + w / 2 for x in xs], mexp, w, color="none", edgecolor="white", hatch="//")
    for x, r in zip(xs, rows):
        ax.annotate(str(r.get("plan.time.check")), (x, max(pred[x], ci[x][1])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r["label"] for r in rows], fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("ms")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path)
    return path
