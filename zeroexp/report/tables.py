"""The report's tables, built once as pandas DataFrames and rendered by Markdown, HTML and W&B alike.

Each :class:`ReportTable` keeps the numbers as the cells wrote them (``raw``, one row per cell, keyed by the
``summary.json`` field names of ``docs/results.md``) and the columns that show them (:meth:`display`).
Only cells that finished appear in the measurement tables; the others are in ``failures``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from zeroexp.report.cells import column, is_dry_run
from zeroexp.report.format import (NA, byte_unit, fmt_err, fmt_factor, fmt_int, fmt_ms, fmt_number, fmt_pct,
                                   missing)
from zeroexp.tolerances import FLOOR_FACTOR

__all__ = ["Column", "ReportTable", "build_tables", "OPS"]

CORE_KINDS = ("param", "grad", "optim")
#: Collective ops in the order the ladder introduces them, with the short names used in headers.
OPS = {"all_reduce": "AR", "broadcast": "BC", "all_gather": "AG", "reduce_scatter": "RS"}


@dataclass
class Column:
    """A displayed column: ``header``, the raw field ``key``, its formatter, and optionally the field of the
    expected value (shown beside the measured one as ``(exp. X)`` when they differ)."""

    header: str
    key: str
    fmt: Callable[[Any], str] = fmt_number
    expected: str | None = None


@dataclass
class ReportTable:
    """One table of the report: its raw rows, the columns that display them, a note and bullets under it."""

    key: str
    title: str
    raw: pd.DataFrame
    columns: list[Column]
    note: str = ""
    empty_text: str = "no finished cell"
    bullets: list[str] = field(default_factory=list)

    def display(self) -> pd.DataFrame:
        """The table as strings, the one formatting shared by every renderer."""
        out = {}
        for c in self.columns:
            values = []
            for _, row in self.raw.iterrows():
                text = c.fmt(row.get(c.key))
                want = row.get(c.expected) if c.expected else None
                if c.expected and not missing(want) and not missing(row.get(c.key)) and c.fmt(want) != text:
                    text += f" (exp. {c.fmt(want)})"
                values.append(text)
            out[c.header] = values
        return pd.DataFrame(out, columns=[c.header for c in self.columns])


def _raw(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    return pd.DataFrame({k: column(frame, k) for k in ["label", "cell_name", *keys]}).reset_index(drop=True)


def cells_table(frame: pd.DataFrame) -> ReportTable:
    """Every cell of the sweep, finished or not."""
    cols = [Column("cell", "label", str), Column("status", "status"), Column("model", "cell.model"),
            Column("N", "cell.world_size", fmt_int), Column("final loss", "final_loss", lambda v: NA if missing(v) else f"{float(v):.6g}"),
            Column("wall s", "duration_s", lambda v: NA if missing(v) else f"{float(v):.1f}"),
            Column("directory", "cell_name", str)]
    raw = _raw(frame, [c.key for c in cols[1:-1]])
    if is_dry_run(frame).any():  # a sweep with dry runs says which cells trained
        raw["mode"] = [_mode(m, src) for m, src in zip(column(frame, "mode"), column(frame, "dry_run.source"))]
        cols.insert(2, Column("mode", "mode", str))
    return ReportTable("cells", "Cells", raw, cols, empty_text="no cell")


def _mode(mode: Any, source: Any) -> str:
    """``trained``, or ``dry run, traced`` / ``dry run, derived`` (zeroexp.dryrun: measured on a fake rank 0, or
    computed from the model's structure)."""
    if mode != "dry_run":
        return "trained"
    kind = str(source).split(":")[0] if not missing(source) else ""
    return f"dry run, {kind}" if kind in ("traced", "derived") else "dry run"


def state_table(ok: pd.DataFrame) -> ReportTable:
    """State factors (logical bytes summed over ranks / P), expected, check, and the largest rank's bytes."""
    expected = [k.removeprefix("state.expected.") for k in ok.columns if k.startswith("state.expected.")]
    extra = [k for k in dict.fromkeys(expected) if k not in CORE_KINDS
             and any(not missing(v) and float(v) != 0 for v in column(ok, f"state.expected.{k}"))]
    kinds = [*CORE_KINDS, *extra]
    raw = _raw(ok, [f"state.{f}.{k}" for f in ("factors", "expected", "max_rank_bytes") for k in kinds]
               + ["state.check", "state.padding_bytes", "state.owner_imbalance", "state.logical_param_bytes"])
    has = [not missing(v) for v in raw["state.check"]]
    for key in [f"state.{f}.{k}" for f in ("factors", "max_rank_bytes") for k in kinds]:  # a kind not held is 0
        raw[key] = [0 if h and missing(v) else v for h, v in zip(has, raw[key])]
    raw["expected"] = [_joined([raw.at[i, f"state.expected.{k}"] for k in kinds], fmt_factor) for i in raw.index]
    raw["other kinds"] = [_other_kinds(row, kinds) for _, row in ok.iterrows()]
    unit = byte_unit([*(v for k in kinds for v in raw[f"state.max_rank_bytes.{k}"]), *raw["state.padding_bytes"]])
    raw["max-rank"] = [_joined([raw.at[i, f"state.max_rank_bytes.{k}"] for k in kinds], unit) for i in raw.index]
    short = "/".join(k[0].upper() if k in CORE_KINDS else k for k in kinds)
    cols = [Column("cell", "label", str),
            *(Column(f"{k} ×P", f"state.factors.{k}", fmt_factor) for k in kinds),
            Column(f"expected {short}", "expected", str),
            Column("other kinds ×P", "other kinds", str), Column("check", "state.check"),
            Column(f"max-rank {short} {unit}", "max-rank", str),
            Column(f"padding {unit}", "state.padding_bytes", unit),
            Column("owner imbalance", "state.owner_imbalance", lambda v: NA if missing(v) else f"{float(v):.3f}")]
    p_values = {fmt_factor(v) for v in raw["state.logical_param_bytes"] if not missing(v)}
    p_text = (f"P = {unit(raw['state.logical_param_bytes'].dropna().iloc[0])} {unit} (logical fp32 parameter "
              "bytes); " if len(p_values) == 1 else "")
    note = (f"{p_text}a factor is a kind's logical bytes summed over all ranks / P, counted at the optimizer "
            "boundary after warm-up (ZeRO, arXiv:1910.02054, section 5.1: stage 0 N/N/2N ... stage 3 1/1/2). "
            f"Max-rank and padding columns are physical bytes in {unit} (2^{20 if unit.name == 'MiB' else 30} "
            "bytes).")
    semantics = {}
    for label, text in zip(raw["label"], column(ok, "state.semantics")):
        if not missing(text):
            semantics.setdefault(str(text), []).append(str(label))
    bullets = [f"{', '.join(labels)}: {text}" for text, labels in semantics.items()]
    return ReportTable("state", "Model state per rank", raw, cols, note, bullets=bullets)


def _joined(values: list[Any], fmt: Callable[[Any], str]) -> str:
    """``a / b / c``, or n/a when the cell has none of them."""
    return NA if all(missing(v) for v in values) else " / ".join(fmt(v) for v in values)


def _other_kinds(row: pd.Series, shown: list[str]) -> str:
    if missing(row.get("state.check")):
        return NA
    parts = []
    for key in row.index:
        kind = key.removeprefix("state.factors.")
        if key.startswith("state.factors.") and kind not in shown and not missing(row[key]) and float(row[key]):
            parts.append(f"{kind} {fmt_factor(row[key])}")
    return ", ".join(parts) or "-"


def memory_table(ok: pd.DataFrame) -> ReportTable:
    """Steady bytes at the optimizer boundary, the training peak, the difference, the peak of each phase of the
    step and the phase the peak falls in (the largest rank's each)."""
    phases = ("forward", "backward", "optimizer")
    keys = ["memory.steady_bytes_max", "memory.peak_bytes_max", "memory.peak_minus_steady_max",
            *(f"memory.phase_peak_bytes_max.{ph}" for ph in phases)]
    raw = _raw(ok, keys + ["memory.peak_phase_of_max_rank", "memory.source"])
    unit = byte_unit(v for k in keys for v in raw[k])
    cols = [Column("cell", "label", str), Column(f"steady {unit}", keys[0], unit), Column(f"peak {unit}", keys[1], unit),
            Column(f"peak - steady {unit}", keys[2], unit),
            *(Column(f"{ph} peak {unit}", key, unit) for ph, key in zip(phases, keys[3:])),
            Column("peak in", "memory.peak_phase_of_max_rank")]
    sources = sorted({str(s).split(":")[0] for s in raw["memory.source"] if not missing(s)})
    note = (f"Largest rank of each, in {unit}. Steady: what a rank holds at the optimizer boundary; peak: the highest "
            "allocation during the memory-tracked steps (a training peak: building and wrapping the model are not "
            "in it). Phase peaks: the highest allocation within forward (to on_before_backward), backward (with the "
            "gradient collectives, to on_before_optimizer_step) and the optimizer step; 'peak in' names the phase "
            "of the peak. A peak in the optimizer step is what the step allocates (AdamW's update temporaries; "
            "zero1/zero2's and DeepSpeed's gradient reduction run there too): the activations are freed by then. "
            f"Source: {'; '.join(sources) or NA}.")
    return ReportTable("memory", "Steady and peak memory", raw, cols, note)


def _ops(ok: pd.DataFrame) -> list[str]:
    found = {k.split(".")[-1] for k in ok.columns
             if k.startswith(("collectives.counts.", "collectives.expected_counts."))}
    return [op for op in OPS if op in found] + sorted(found - set(OPS))


def collectives_table(ok: pd.DataFrame) -> ReportTable:
    """Calls and payload per step by op (rank 0's), the expected fingerprint, and the check."""
    ops = _ops(ok)
    raw = _raw(ok, [f"collectives.{f}.{op}" for f in ("counts", "payload_bytes", "expected_counts",
                                                     "expected_payload_bytes") for op in ops]
               + ["collectives.payload_total_bytes", "collectives.param_bytes", "collectives.check"])
    has = column(ok, "collectives.check").reset_index(drop=True).map(lambda v: not missing(v))
    for f in ("counts", "payload_bytes"):  # an op a profiled cell never issued is 0, not unknown
        for op in ops:
            raw[f"collectives.{f}.{op}"] = [0 if h and missing(v) else v for h, v in zip(has, raw[f"collectives.{f}.{op}"])]
    raw["payload / P"] = [None if missing(t) or missing(p) or not p else t / p
                          for t, p in zip(raw["collectives.payload_total_bytes"], raw["collectives.param_bytes"])]
    raw["expected"] = [_expected_text(row, ops) for _, row in raw.iterrows()]
    unit = byte_unit(v for op in ops for v in raw[f"collectives.payload_bytes.{op}"])
    cols = [Column("cell", "label", str)]
    for op in ops:
        name = OPS.get(op, op)
        cols += [Column(f"{name} calls", f"collectives.counts.{op}", fmt_int, f"collectives.expected_counts.{op}"),
                 Column(f"{name} {unit}", f"collectives.payload_bytes.{op}", unit,
                        f"collectives.expected_payload_bytes.{op}")]
    cols += [Column("payload / P", "payload / P", fmt_number), Column("expected calls", "expected", str),
             Column("check", "collectives.check")]
    legend = ", ".join(f"{short} = {op}" for op, short in OPS.items() if op in ops)
    note = (f"Per step, rank 0 (ranks that differ make the check FAIL). {legend}. Payload is the nccl-tests S "
            f"(the full array) in {unit}, input bytes, not link bytes; a measured value that differs from the "
            "expected one shows it as (exp. X).")
    return ReportTable("collectives", "Collectives per step", raw, cols, note)


def _expected_text(row: pd.Series, ops: list[str]) -> str:
    parts = [f"{OPS.get(op, op)} {fmt_int(row[f'collectives.expected_counts.{op}'])}" for op in ops
             if not missing(row[f"collectives.expected_counts.{op}"]) and float(row[f"collectives.expected_counts.{op}"])]
    return ", ".join(parts) or (NA if all(missing(row[f"collectives.expected_counts.{op}"]) for op in ops) else "none")


def timing_table(ok: pd.DataFrame) -> ReportTable:
    """Median and P95 step time, CV, the stability flag, and the comparison with the first cell: a ratio when
    both are stable, else a trend word (slower, faster, within noise)."""
    keys = ["timing.median_ms", "timing.p95_ms", "timing.cv", "timing.unstable", "timing.timed_steps"]
    raw = _raw(ok, keys)
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


def equivalence_table(ok: pd.DataFrame) -> ReportTable:
    """Final parameters against the unsharded reference."""
    keys = ["equivalence.max_abs_err", "equivalence.max_rel_err", "equivalence.reduction_floor",
            "equivalence.threshold", "equivalence.effective_threshold", "equivalence.check", "equivalence.steps",
            "equivalence.compared_tensors"]
    cols = [Column("cell", "label", str), Column("max abs err", keys[0], fmt_err), Column("max rel err", keys[1], fmt_err),
            Column("reduction floor", keys[2], fmt_err), Column("threshold", keys[3], fmt_err),
            Column("bound", keys[4], fmt_err), Column("check", keys[5]), Column("steps", keys[6], fmt_int),
            Column("tensors", keys[7], fmt_int)]
    note = ("Every parameter after the last step against an unsharded nn.Module + AdamW trained in one process on "
            "the same global batches; the reduction floor is how far the same reference moves when only the "
            "rounding of data parallelism's sums changes. PASS when max abs err <= bound: the precision's "
            f"threshold, or {FLOOR_FACTOR:g}x the floor where larger.")
    return ReportTable("equivalence", "Numerical equivalence", _raw(ok, keys), cols, note)


def plan_table(ok: pd.DataFrame) -> ReportTable | None:
    """The planner's prediction beside the measurement, where cells have a ``plan`` section; else None.

    With the planner's per-kind fields (``plan.predicted_bytes.<kind>``, ``plan.measured_bytes.<kind>``) one
    ``planned / measured`` column per kind; any other plan section shows its scalar fields as they are.
    """
    kinds = [k.removeprefix("plan.predicted_bytes.") for k in ok.columns if k.startswith("plan.predicted_bytes.")]
    if not kinds:
        return _plain_plan_table(ok)
    kinds = [k for k in kinds if k != "total"] + (["total"] if "total" in kinds else [])
    raw = _raw(ok, [f"plan.{f}.{k}" for f in ("predicted_bytes", "measured_bytes", "difference_bytes") for k in kinds]
               + ["plan.layout", "plan.payload_check", "plan.check"])
    unit = byte_unit(v for f in ("predicted_bytes", "measured_bytes") for k in kinds for v in raw[f"plan.{f}.{k}"])
    for k in kinds:
        raw[f"plan {k}"] = [_planned_measured(p, m, d, unit) for p, m, d in
                            zip(raw[f"plan.predicted_bytes.{k}"], raw[f"plan.measured_bytes.{k}"],
                                raw[f"plan.difference_bytes.{k}"])]
    cols = [Column("cell", "label", str), Column("layout", "plan.layout"),
            *(Column(f"{k} planned / measured {unit}", f"plan {k}", str) for k in kinds),
            Column("payload check", "plan.payload_check"), Column("check", "plan.check")]
    note = (f"Largest rank, physical bytes in {unit}: the planner's prediction for this very cell beside the state "
            "probe's measurement; a difference is shown exactly, Δ = measured - planned, in bytes. Explained "
            "residuals the planner leaves out (Adam's step scalars) are not in these columns. Payload check: the "
            "planned payload S per op against the collectives probe's.")
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
    raw = _raw(ok, keys)
    unit = byte_unit(v for k in keys if "bytes" in k for v in raw[k] if isinstance(v, (int, float)))
    cols = [Column("cell", "label", str)] + [
        Column(k.removeprefix("plan.") + (f" {unit}" if "bytes" in k else ""), k, unit if "bytes" in k else fmt_number)
        for k in keys]
    return ReportTable("plan", "Plan vs measured", raw, cols, f"The cells' plan sections; bytes in {unit}.")


def checkpoint_table(ok: pd.DataFrame) -> ReportTable | None:
    """Save and restore of the cells run with ``checkpoint=full|sharded``: bytes, rank 0's and the largest save
    peak above what the rank held, the save's collectives, times, the bit-identical continuation; else None."""
    has = [not missing(v) for v in column(ok, "checkpoint.kind")]
    if not any(has):
        return None
    ok = ok[has]
    ops = sorted({k.split(".")[-1] for k in ok.columns if k.startswith("checkpoint.save.collectives.counts.")},
                 key=lambda op: (list(OPS).index(op) if op in OPS else len(OPS), op))
    keys = ["checkpoint.kind", "checkpoint.files", "checkpoint.save.bytes_written",
            "checkpoint.save.rank0_peak_over_start_bytes", "checkpoint.save.max_peak_over_start_bytes",
            "checkpoint.save.ms", "checkpoint.load.ms", "checkpoint.continuation_max_abs_diff", "checkpoint.check"]
    raw = _raw(ok, keys + [f"checkpoint.save.collectives.counts.{op}" for op in ops])
    raw["save collectives"] = [", ".join(f"{OPS.get(op, op)} {fmt_int(row[f'checkpoint.save.collectives.counts.{op}'])}"
                                         for op in ops if not missing(row[f"checkpoint.save.collectives.counts.{op}"]))
                               or "none" for _, row in raw.iterrows()]
    unit = byte_unit(v for k in keys[2:5] for v in raw[k])
    cols = [Column("cell", "label", str), Column("kind", keys[0]), Column("files", keys[1], fmt_int),
            Column(f"written {unit}", keys[2], unit), Column(f"rank-0 save peak + {unit}", keys[3], unit),
            Column(f"max save peak + {unit}", keys[4], unit), Column("save collectives", "save collectives", str),
            Column("save ms", keys[5], fmt_ms), Column("load ms", keys[6], fmt_ms),
            Column("continuation max abs diff", keys[7], fmt_err), Column("check", keys[8])]
    note = (f"After training: bytes written by all ranks; save peak + is the highest allocation during the save "
            f"above what the rank held when it started ({unit}; rank 0, and the largest rank); the save's collectives "
            "(rank 0's calls, torch.profiler); times with the profiler and memory tracker running. PASS: restored into "
            "a fresh model, one more step gives bit-identical parameters.")
    return ReportTable("checkpoint", "Checkpoint: save and restore", raw, cols, note)


def failures_table(frame: pd.DataFrame) -> ReportTable:
    """Cells that did not finish, with their first error."""
    keys = ["status", "error.rank", "error.cause", "error.message", "error.log"]
    cols = [Column("cell", "label", str), Column("status", keys[0]), Column("rank", keys[1], fmt_int),
            Column("cause", keys[2]), Column("error", keys[3]), Column("log", keys[4]),
            Column("directory", "cell_name", str)]
    raw = _raw(frame[frame.status != "ok"], keys)
    note = "Their partial files stay in their directories (renamed *.partial); no other table shows them." if len(raw) else ""
    return ReportTable("failures", "Failed or skipped cells", raw, cols, note, empty_text="none")


def build_tables(cells: pd.DataFrame) -> list[ReportTable]:
    """Every table of the report, from cells already in ladder order (:func:`zeroexp.report.cells.order_cells`)."""
    ok = cells[cells.status == "ok"] if "status" in cells.columns else cells.iloc[0:0]
    tables = [cells_table(cells), state_table(ok), memory_table(ok), collectives_table(ok), timing_table(ok),
              equivalence_table(ok)]
    plan = plan_table(ok)
    if plan is not None:
        tables.append(plan)
    checkpoint = checkpoint_table(ok)
    if checkpoint is not None:
        tables.append(checkpoint)
    tables.append(failures_table(cells if "status" in cells.columns else cells.assign(status="unknown")))
    return tables
