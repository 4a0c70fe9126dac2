"""The peak check's rule: a rank's measured phases against its prediction, within the tolerance, the range a moment
only gloo's timing creates spans, or one tensor gloo may free late (CPU cells; :func:`zeroexp.plan.check.memory`'s
``zeroexp.plan.check.gloo.late_free`` names them); a dry run's section shown as the simulation it is
(:func:`as_simulated`)."""

from __future__ import annotations

from typing import Any

from zeroexp.formulas.peak.phases import PHASES
from zeroexp.results.verdict import Check, Code, Reason, Verdict

__all__ = ["TOLERANCE", "ABS_TOLERANCE", "judge_rank", "judge", "nz", "as_simulated"]

#: The largest shortfall of the prediction, as a fraction of the measured bytes above steady, that still PASSes.
TOLERANCE = 0.02
#: Below this many bytes above steady a relative band is no band: a phase that allocates (nearly) nothing may hold
#: one loss scalar or step counter more or less than the model's moments name.
ABS_TOLERANCE = 16
RANGE_NOTE = "within the predicted range"


def judge_rank(got_phases: dict[str, Any], steady: int, steady_cats: dict[str, Any], predicted: dict[str, dict],
                late: dict[str, list[tuple[str, int]]]
                ) -> tuple[dict[str, Any], list[Reason], list[tuple[float, bool]]]:
    """One rank's phases: measured (above that rank's steady) beside predicted, each judged (:func:`judge`); with
    each phase's relative error, whether the phase PASSed by a late-freed tensor (its error is that tensor's)."""
    phases: dict[str, Any] = {"steady": {"measured_bytes": steady, "measured_by_category": nz(steady_cats)}}
    reasons, errs = [], []
    for ph in PHASES:
        got = got_phases.get(ph)
        if got is None:
            continue
        want = predicted[ph]
        above = int(got["peak_bytes"]) - steady
        by_cat = nz({c: int(b) - int(steady_cats.get(c, 0)) for c, b in got["by_category"].items()})
        rec = {"predicted_bytes": want["bytes"], "measured_bytes": above,
               "predicted_peak_bytes": steady + want["bytes"], "measured_peak_bytes": int(got["peak_bytes"]),
               "predicted_by_category": want["by_category"], "measured_by_category": by_cat}
        upper = want.get("upper_bytes")
        if upper is not None:
            rec.update(predicted_upper_bytes=upper, predicted_upper_by_category=want["upper_by_category"],
                       upper_note=want.get("upper_note", ""))
        verdict, note, rel = judge(above, want["bytes"], late.get(ph, []), upper, want.get("upper_note", ""))
        rec.update(check=verdict, rel_err=rel)
        late_free = bool(note) and not note.startswith(RANGE_NOTE)
        if note:  # within the range's upper end, or one tensor gloo freed late
            rec["late_free" if late_free else "in_range"] = note
        errs.append((rel, late_free))
        if verdict is Verdict.FAIL:
            span = f"{want['bytes']} B" if upper is None else f"{want['bytes']}-{upper} B"
            reasons.append(Reason(Code.MEMORY_PHASE_DIFFERS, f"{ph}: measured {above} B above steady, predicted "
                                  f"{span} ({_worst_category(want['by_category'], by_cat)})"))
        phases[ph] = rec
    return phases, reasons, errs


def judge(measured: int, predicted: int, late: list[tuple[str, int]], upper: int | None = None,
           upper_note: str = "") -> tuple[Verdict, str | None, float]:
    """PASS when 0 <= measured - predicted <= max(TOLERANCE * |measured|, ABS_TOLERANCE); or when the excess is at
    most one named tensor that gloo may free late (``late``: each candidate's description and bytes), said in the
    note; or, where the prediction is a range (``upper``: a moment only timing decides, ``upper_note``), when
    predicted <= measured <= upper within the band, or above it by at most one named late tensor (two gloo timings
    at one moment: the range's, and an earlier collective's work object not yet gone). Never PASS when the prediction
    exceeds the measurement. Also the relative error of the prediction (against the nearer end of a range)."""
    band = max(TOLERANCE * abs(measured), ABS_TOLERANCE)  # the magnitude: a phase may sit below steady
    excess = measured - predicted
    rel = abs(excess) / abs(measured) if measured else float(excess != 0)
    if 0 <= excess <= band:
        return Verdict.PASS, None, rel
    if excess > 0:
        for note, size in sorted(late, key=lambda c: c[1]):
            if excess <= size + band:
                return (Verdict.PASS, f"{excess} B above the prediction, within one late-freed tensor: {note} "
                        f"({size} B)", rel)
    if upper is not None and 0 <= excess and measured <= upper + band:
        return Verdict.PASS, f"{RANGE_NOTE} {predicted}-{upper} B: {upper_note}", \
            min(rel, abs(measured - upper) / abs(measured) if measured else 0.0)
    if upper is not None and excess > 0:  # the range's timing and one earlier work object gloo still holds
        for note, size in sorted(late, key=lambda c: c[1]):
            if measured <= upper + size + band:
                return Verdict.PASS, (f"{measured - upper} B above the predicted range's upper end {upper} B "
                                      f"({upper_note}), within one late-freed tensor: {note} ({size} B)"), rel
    return Verdict.FAIL, None, rel


def _worst_category(predicted: dict[str, int], measured: dict[str, int]) -> str:
    diffs = {c: measured.get(c, 0) - predicted.get(c, 0) for c in {*predicted, *measured}}
    c = max(diffs, key=lambda k: abs(diffs[k]))
    return f"largest difference in {c}: measured {measured.get(c, 0)} B, predicted {predicted.get(c, 0)} B"


def nz(cats: dict[str, Any]) -> dict[str, int]:
    return {c: int(b) for c, b in cats.items() if int(b)}


def as_simulated(section: dict[str, Any]) -> dict[str, Any]:
    """A traced dry run's memory is a simulation (``zeroexp.probes.memory.SIMULATED``), not a measurement: its
    figures sit beside the prediction as ``simulated_*``, the same rule's verdict as ``simulated_check``; ``check`` is
    n/a."""
    renamed = {"measured_bytes": "simulated_bytes", "measured_peak_bytes": "simulated_peak_bytes",
               "measured_by_category": "simulated_by_category", "check": "simulated_check"}
    phases = {ph: {renamed.get(k, k): v for k, v in rec.items()} for ph, rec in section["phases"].items()}
    judged = Check.read(section)
    said = Check(Verdict.NA, (Reason(Code.MEMORY_SIMULATED, "a dry run measures no memory: the phases' simulated_* "
                                     "figures are the memory probe's over fake storages (summary.json memory.source), "
                                     "beside the prediction, not a check of it"),
                              *(r.prefixed("simulated ") for r in judged.reasons)))
    return {**section, "phases": phases, "simulated_check": section["check"], **said.fields()}
