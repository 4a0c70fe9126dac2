"""The report's tables, built once as pandas DataFrames and rendered by Markdown, HTML and W&B alike.

The report is its own ``cells`` table, then one section per registered probe (``Probe.report_table``,
``zeroexp.probes.registry``) and the planner's (:class:`PlanSection`) in their ``report_order``, then ``failures``.
Each :class:`ReportTable` keeps the numbers as the cells wrote them (``raw``, one row per cell, keyed by the
``summary.json`` field names of ``docs/results.md``) and the columns that show them (:meth:`display`).
Only cells that finished appear in the measurement tables; the others are in ``failures``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from zeroexp.results.axes import axis_values, fmt_axis, set_axes
from zeroexp.results.cells import column, is_dry_run
from zeroexp.report.checks import NamedCheck, plan_checks
from zeroexp.results.format import NA, byte_unit, fmt_int, fmt_number, missing
from zeroexp.results.section import OPS, Column, ReportTable, raw_rows
from zeroexp.results.verdict import Verdict

__all__ = ["Column", "ReportTable", "PlanSection", "build_tables", "sections", "OPS"]


def cells_table(frame: pd.DataFrame) -> ReportTable:
    """Every cell of the sweep, finished or not."""
    cols = [Column("cell", "label", str), Column("status", "status"), Column("model", "cell.model"),
            Column("N", "cell.world_size", fmt_int),
            Column("final loss", "final_loss", lambda v: NA if missing(v) else f"{float(v):.6g}"),
            Column("wall s", "duration_s", lambda v: NA if missing(v) else f"{float(v):.1f}"),
            Column("directory", "cell_name", str)]
    raw = raw_rows(frame, [c.key for c in cols[1:-1]])
    if is_dry_run(frame).any():  # a sweep with dry runs says which cells trained
        raw["mode"] = [_mode(m, src) for m, src in zip(column(frame, "mode"), column(frame, "dry_run.source"))]
        cols.insert(2, Column("mode", "mode", str))
    axes, values = set_axes(frame), axis_values(frame).reset_index(drop=True)
    for i, axis in enumerate(axes):  # the axes some cell sets, after N (n/a where one does not apply)
        raw[axis.key] = values[axis.key]
        cols.insert(cols.index(next(c for c in cols if c.key == "cell.world_size")) + 1 + i,
                    Column(axis.header, axis.key, fmt_axis))
    note = ("Axes beyond model, strategy, precision, offload and N, shown where a cell sets them (n/a where an axis "
            "does not apply to the cell's strategy): " + "; ".join(a.note for a in axes) + "."
            if axes else "")
    return ReportTable("cells", "Cells", raw, cols, note, empty_text="no cell")


def _mode(mode: Any, source: Any) -> str:
    """``trained``, or ``dry run, traced`` / ``dry run, derived`` (zeroexp.rank.dryrun: measured on a fake rank 0, or
    computed from the model's structure)."""
    if mode != "dry_run":
        return "trained"
    kind = str(source).split(":")[0] if not missing(source) else ""
    return f"dry run, {kind}" if kind in ("traced", "derived") else "dry run"


def plan_table(ok: pd.DataFrame) -> ReportTable | None:
    """The planner's prediction beside the measurement, where cells have a ``plan`` section; else None.

    With the planner's per-kind fields (``plan.predicted_bytes.<kind>``, ``plan.measured_bytes.<kind>``) one
    ``planned / measured`` column per kind (``<kind> P / M <unit>``); any other plan section shows its scalar fields
    as they are.
    """
    kinds = [k.removeprefix("plan.predicted_bytes.") for k in ok.columns if k.startswith("plan.predicted_bytes.")]
    if not kinds:
        return _plain_plan_table(ok)
    kinds = [k for k in kinds if k != "total"] + (["total"] if "total" in kinds else [])
    raw = raw_rows(ok, [f"plan.{f}.{k}" for f in ("predicted_bytes", "measured_bytes", "difference_bytes")
                        for k in kinds]
               + ["plan.layout", "plan.payload_check", "plan.groups.check", "plan.check", "plan.memory.check"])
    unit = byte_unit(v for f in ("predicted_bytes", "measured_bytes") for k in kinds for v in raw[f"plan.{f}.{k}"])
    for k in kinds:
        raw[f"plan {k}"] = [_planned_measured(p, m, d, unit) for p, m, d in
                            zip(raw[f"plan.predicted_bytes.{k}"], raw[f"plan.measured_bytes.{k}"],
                                raw[f"plan.difference_bytes.{k}"])]
    cols = [Column("cell", "label", str), Column("layout", "plan.layout"),
            *(Column(f"{k} P / M {unit}", f"plan {k}", str) for k in kinds),
            Column("payload check", "plan.payload_check"), Column("groups", "plan.groups.check"),
            Column("check", "plan.check"), Column("peak model", "plan.memory.check")]
    note = (f"Largest rank, physical bytes in {unit}: the planner's prediction for this very cell (P) beside the "
            "state probe's measurement (M); a difference is shown exactly, Δ = measured - planned, in bytes. Explained "
            "residuals the planner leaves out (Adam's step scalars) are not in these columns. Payload check: the "
            "planned payload S per op against the collectives probe's. Groups: the buckets, units, owners and "
            "partitions the planner derived from the shapes against those the strategy reported live. Check: all of "
            "it, and the calls per op. Peak model: plan.memory's check of each phase's peak (report_peak_model.png).")
    return ReportTable("plan", "Plan vs measured", raw, cols, note)


def _planned_measured(planned: Any, measured: Any, diff: Any, unit: Any) -> str:
    if missing(planned) and missing(measured):
        return NA
    text = f"{unit(planned)} / {unit(measured)}"
    return text if missing(diff) or not float(diff) else f"{text} (Δ {int(diff):+,} B)"


def _plain_plan_table(ok: pd.DataFrame) -> ReportTable | None:
    keys = [k for k in ok.columns if k.startswith("plan.")
            and all(missing(v) or isinstance(v, (int, float, str, bool)) for v in ok[k])]
    if not keys:
        return None
    raw = raw_rows(ok, keys)
    unit = byte_unit(v for k in keys if "bytes" in k for v in raw[k] if isinstance(v, (int, float)))
    cols = [Column("cell", "label", str)] + [
        Column(k.removeprefix("plan.") + (f" {unit}" if "bytes" in k else ""), k, unit if "bytes" in k else fmt_number)
        for k in keys]
    return ReportTable("plan", "Plan vs measured", raw, cols, f"The cells' plan sections; bytes in {unit}.")


def failures_table(frame: pd.DataFrame) -> ReportTable:
    """Cells that did not finish, with their first error: failed, refused (invalid for the cell: ``error.key`` names
    the key), skipped (not applicable on this machine)."""
    keys = ["status", "error.rank", "error.cause", "error.key", "error.message", "error.log"]
    cols = [Column("cell", "label", str), Column("status", keys[0]), Column("rank", keys[1], fmt_int),
            Column("cause", keys[2]), Column("key", keys[3]), Column("error", keys[4]), Column("log", keys[5]),
            Column("directory", "cell_name", str)]
    raw = raw_rows(frame[frame.status != "ok"], keys)
    notes = []
    if (raw["status"] == "failed").any():
        notes.append("A failed cell's partial files stay in its directory (renamed *.partial); no other table shows "
                     "them.")
    if raw["status"].isin(["refused", "skipped"]).any():
        notes.append("A refused cell is invalid for its combination (its strategy cannot take this model, precision, "
                     "offload...; the key names the setting) and a skipped one cannot run on this machine: neither "
                     "started a rank, and the sweep ran its other cells.")
    return ReportTable("failures", "Failed, refused or skipped cells", raw, cols, " ".join(notes), empty_text="none")


class PlanSection:
    """The planner's section (``summary.json["plan"]``, ``zeroexp.plan.check.cell``): not a probe, but shown like one,
    between the probes' sections by its ``order``."""

    name = "plan"
    order = 70
    report_order = None

    @staticmethod
    def digest_line(p: dict[str, Any]) -> str:
        """The plan's summary line: its layout, how many of its parts PASS, and each other part's verdict (the check
        of the line is the worst of them: :func:`zeroexp.report.digest.digest`)."""
        parts = plan_checks(p)
        said = [f"{sum(c.verdict is Verdict.PASS for c in parts)} of {len(parts)} parts PASS"]
        # "plan": stopped before its parts, no line of its own
        said += [f"{c.name} {c.verdict}" + (f" ({_reasons(c)})" if c.name == "plan" else "")
                 for c in parts if c.verdict is not Verdict.PASS]
        layout = p.get("layout") or p.get("row")
        return (f"{layout}: " if layout else "") + ", ".join(said)

    @staticmethod
    def digest_parts(p: dict[str, Any]) -> list[tuple[str, str]]:
        """A line per part of the plan with no section of its own in the digest (``plan.time`` has one)."""
        memory = p.get("memory") or {}
        late = {ph: d for ph, d in (memory.get("phases") or {}).items() if isinstance(d, dict) and d.get("late_free")}
        modelled = memory.get("max_rel_err_modelled", memory.get("max_rel_err"))  # older summaries: one figure
        above = ", ".join(f"{ph} {d['measured_bytes'] - d['predicted_bytes']:,} B" for ph, d in late.items())
        peak = (f"peak model: largest error {100 * float(modelled or 0):.2f} %"
                + (f" ({above} above the prediction: within a late-freed tensor, plan.memory says which)"
                   if late else ""))
        ck = p.get("checkpoint") or {}
        passed = {"plan.state": "planned state bytes of every rank and kind equal the measured",
                  "plan.collectives": "planned calls and payload of every op equal the measured",
                  "plan.groups": "the planned buckets, units, owners and partitions equal the live ones",
                  "plan.memory": peak,
                  "plan.checkpoint": (f"checkpoint: {ck.get('measured_bytes', 0):,} B of tensors written "
                                      f"({ck.get('kind')}), as planned; {_peaks_said(ck.get('peaks') or {})}")}
        lines = []
        for c in plan_checks(p):
            if c.name not in passed:
                continue
            if c.verdict is Verdict.PASS:
                lines.append((c.name, passed[c.name]))
            else:
                lines.append((c.name, (f"{peak}; " if c.name == "plan.memory" and c.verdict is Verdict.FAIL else "")
                              + _reasons(c)))
        return lines

    @staticmethod
    def report_table(ok: pd.DataFrame) -> ReportTable | None:
        return plan_table(ok)


def _reasons(c: NamedCheck, shown: int = 2) -> str:
    """A check's first reasons, and how many more ``summary.json`` holds."""
    more = len(c.reasons) - shown
    return "; ".join(c.texts[:shown]) + (f" (and {more} more in summary.json)" if more > 0 else "")


def sections(report: bool = False) -> list[Any]:
    """The sections of a cell's results: every registered probe and :class:`PlanSection`, in digest ``order``
    (with ``report=True``: in ``report_order``, where a section has one). Each has ``name`` (its ``summary.json``
    key), ``digest_line(section)`` and ``report_table(ok)`` (either may give None: no line, no table); the plan also
    ``digest_parts(section)``, a line per part."""
    from zeroexp.probes import registry  # here, not at the top: the probes load torch (not Lightning: probes.base)
    from zeroexp.report.groups import GroupsSection
    from zeroexp.report.moves import MovesSection
    from zeroexp.report.step_time import TimeSection

    def key(s: Any) -> int:
        return s.report_order if report and s.report_order is not None else s.order

    return sorted([*registry(), GroupsSection, PlanSection, TimeSection, MovesSection], key=key)


def build_tables(cells: pd.DataFrame) -> list[ReportTable]:
    """Every table of the report, from cells already in ladder order (:func:`zeroexp.results.cells.order_cells`):
    the cells, each section's table (:func:`sections`), the failures."""
    ok = cells[cells.status == "ok"] if "status" in cells.columns else cells.iloc[0:0]
    tables = [cells_table(cells)]
    for section in sections(report=True):
        table = section.report_table(ok)
        if table is not None:
            tables.append(table)
    tables.append(failures_table(cells if "status" in cells.columns else cells.assign(status="unknown")))
    return tables


def _peaks_said(peaks: dict[str, Any]) -> str:
    """plan.checkpoint's save and load peaks in a few words: the largest above-start bytes of each phase, measured
    beside planned, and whether the plan is exact there or a lower bound; or why there is none."""
    if peaks.get("check") != "PASS":
        return f"save and load peaks {peaks.get('check', 'n/a')}: {'; '.join(peaks.get('reasons') or ['not planned'])}"
    said = []
    for phase in ("save", "load"):
        p = peaks.get(phase) or {}
        got, want, exact = p.get("measured_rank_bytes") or [], p.get("rank_bytes") or [], p.get("exact") or []
        if p.get("check") != "PASS" or not got or len(got) != len(want):
            said.append(f"{phase} {p.get('check', 'n/a')} ({'; '.join(p.get('reasons') or ['not planned'])})")
            continue
        r = max(range(len(got)), key=got.__getitem__)
        said.append(f"{phase} {got[r]:,} B above its start (planned {'' if exact[r] else '>= '}{want[r]:,} B)")
    return "peaks: " + ", ".join(said)
