"""``summary.json["plan"]["checkpoint"]`` (``plan.checkpoint``): the tensors' bytes each rank wrote for the cell's
checkpoint (the checkpoint probe's ``save.rank_payload_bytes``, read from the files: zeroexp.probes.payload) beside
the planner's (zeroexp.formulas.checkpoint.written_bytes), exact: the total over the ranks, and each rank's where the
layout fixes it (a full checkpoint: rank 0 all of it; ZeroRedundancyOptimizer's owners; torch.distributed.checkpoint
picks the rank of a replicated item at run time, so its ranks are shown, their total judged)."""

from __future__ import annotations

from typing import Any

from zeroexp.formulas import Groups
from zeroexp.formulas.checkpoint import checkpoint_peaks, written_bytes
from zeroexp.formulas.device import measured_on
from zeroexp.plan.check.judge import judge
from zeroexp.results.verdict import Check, Code, Reason, Verdict

__all__ = ["checkpoint_section"]


def checkpoint_section(cell: Any, summary: dict[str, Any], groups: Groups, itemsize: int, shape: Any
                       ) -> dict[str, Any]:
    """The part; never raises (a failure is ``check: ERROR``)."""
    try:
        return _section(cell, summary, groups, itemsize, shape)
    except Exception as e:  # noqa: BLE001 - the plan must never fail a cell that ran
        return Check.raised(e).fields()


def _section(cell: Any, summary: dict[str, Any], groups: Groups, itemsize: int, shape: Any) -> dict[str, Any]:
    kind, layout = cell.checkpoint, cell.row
    save = (summary.get("checkpoint") or {}).get("save") or {}
    predicted = written_bytes(layout, groups, itemsize, kind, shape, cell.knobs)
    out: dict[str, Any] = {"kind": kind, "layout": None if predicted is None else predicted["layout"]}
    if predicted is None:
        return {**out, **Check(Verdict.NA, (Reason(Code.PLAN_CHECKPOINT_NOT_MODELLED, (
            f"{cell.row_name} writes no {kind} checkpoint the planner models")),)).fields()}
    out.update(predicted_bytes=predicted["total"], predicted_rank_bytes=predicted["ranks"],
               state_bytes=predicted["state"], aliases_bytes=predicted["aliases"])
    if "rank_payload_bytes" not in save:
        return {**out, **Check(Verdict.NA, (Reason(Code.PLAN_CHECKPOINT_NOT_MEASURED,
                                                   "no save measured: the checkpoint probe did not run"),)).fields()}
    ranks = [int(b) for b in save["rank_payload_bytes"]]
    out.update(measured_bytes=sum(ranks), measured_rank_bytes=ranks)
    reasons = []
    if sum(ranks) != predicted["total"]:
        reasons.append(Reason(Code.PLAN_CHECKPOINT_DIFFERS, f"all ranks wrote {sum(ranks)} B of tensors, planned "
                              f"{predicted['total']} B"))
    for r, (got, want) in enumerate(zip(ranks, predicted["ranks"] or ())):
        if got != want:
            reasons.append(Reason(Code.PLAN_CHECKPOINT_DIFFERS, f"rank {r} wrote {got} B of tensors, planned {want} B"))
    written = Check.failed_if(reasons)
    peaks = _peaks(cell, summary, groups, itemsize, shape)
    return {**out, "peaks": peaks, **Check.worst_of([written, Check.read(peaks)]).fields()}  # its worst part


def _peaks(cell: Any, summary: dict[str, Any], groups: Groups, itemsize: int, shape: Any) -> dict[str, Any]:
    """The save's and the load's bytes above each rank's start (the probe's ``peak_over_start_bytes``) beside the
    planner's (zeroexp.formulas.checkpoint.checkpoint_peaks), per rank: where the model sizes every allocation
    judged as plan.memory judges a phase (zeroexp.plan.check.judge.judge: at most 2 % below the measurement, never
    above it), where it is a lower bound (what it leaves out named) never above the measurement. Each phase its own
    ``check``: n/a where it was not measured, or where nothing of it is sized (every rank a lower bound of 0: a bound
    that cannot fail is no check); the peaks' check the worst of the two."""
    measured = summary.get("checkpoint") or {}
    device = measured_on(str(measured.get("memory_source", "")))
    predicted = checkpoint_peaks(cell.row, groups, itemsize, cell.checkpoint, shape, device, cell.knobs)
    if predicted is None:
        return Check(Verdict.NA, (Reason(Code.PLAN_CHECKPOINT_PEAK_NOT_MODELLED, (
            f"no save and load peak model for {cell.row_name} ({cell.row.family.name})")),)).fields()
    out: dict[str, Any] = {"device": device.name}
    phases = []
    for name in ("save", "load"):
        want, got = getattr(predicted, name), (measured.get(name) or {}).get("peak_over_start_bytes")
        out[name] = want.record()
        if got is None:
            check = Check(Verdict.NA, (Reason(Code.PLAN_CHECKPOINT_NOT_MEASURED, f"no {name} measured"),))
        elif not any(want.exact) and not any(want.ranks):
            check = Check(Verdict.NA, (Reason(Code.PLAN_CHECKPOINT_PEAK_NOT_MODELLED, (
                f"nothing of the {name} is sized ({'; '.join(out[name]['unsized'])})")),))
        else:
            reasons = [] if len(got) == len(want.ranks) else [Reason(Code.PLAN_CHECKPOINT_PEAK_DIFFERS, (
                f"the {name} was measured on {len(got)} ranks, planned for {len(want.ranks)}"))]
            for r, (m, p, exact) in enumerate(zip(got, want.ranks, want.exact)):
                if not (judge(int(m), p, [])[0] is Verdict.PASS if exact else int(m) >= p):
                    reasons.append(Reason(Code.PLAN_CHECKPOINT_PEAK_DIFFERS, (
                        f"rank {r}'s {name} held {int(m)} B above its start, planned {p} B"
                        + ("" if exact else " at least"))))
            check = Check.failed_if(reasons)
        if got is not None:
            out[name]["measured_rank_bytes"] = [int(v) for v in got]
        out[name].update(check.fields())
        phases.append(check)
    return {**out, **Check.worst_of(phases).fields()}
