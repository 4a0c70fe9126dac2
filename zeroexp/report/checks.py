"""Every check of one cell, by name: what the digest, a sweep's verdicts and the exit code of ``python -m zeroexp``
read, so that no verdict hides a failure.

A cell's checks are the ``check`` of each section of its ``summary.json`` (``state``, ``collectives``,
``equivalence``, ``checkpoint``, a probe not measured in a short run) and the parts of its plan
(:func:`plan_checks`): ``plan.state`` (state bytes per rank and kind), ``plan.collectives`` (calls and payload per
op), ``plan.groups``, ``plan.memory`` (the peak model) and ``plan.time`` (the step time). A check reads ``PASS``,
``FAIL``, ``ERROR`` (the check itself raised), or ``n/a`` / ``SKIP`` with its reason; :func:`failed_checks` is the
one rule of what failed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from zeroexp.results.format import fmt_err, missing
from zeroexp.results.verdict import FAILED, Check, Code, Reason, Verdict, worst

__all__ = ["FAILED", "NamedCheck", "worst", "plan_checks", "cell_checks", "failed_checks"]

#: The plan's parts with a section of their own in ``summary.json["plan"]``, by the check's name.
_PLAN_SECTIONS = {"state": "state", "calls": "collectives", "groups": "groups", "memory": "memory", "time": "time",
                  "checkpoint": "checkpoint"}


@dataclass(frozen=True)
class NamedCheck:
    """One check of a cell: ``name`` (``equivalence``, ``plan.memory``) and its :class:`~zeroexp.results.verdict.Check`
    as ``summary.json`` holds it (its reasons: why it is not ``PASS``; never empty for another verdict)."""

    name: str
    check: Check

    @property
    def verdict(self) -> Verdict:
        return self.check.verdict

    @property
    def reasons(self) -> tuple[Reason, ...]:
        return self.check.reasons

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(self.check.texts)

    @property
    def failed(self) -> bool:
        return self.check.failed


def _numbers(section: Mapping[str, Any]) -> str:
    """An equivalence FAIL's reason from its numbers (the probe writes no ``why`` of its own for it)."""
    bound = section.get("effective_threshold")
    bound = section.get("threshold") if missing(bound) else bound  # written before the reduction-order floor
    basis = section.get("threshold_basis")
    return (f"max abs err {fmt_err(section.get('max_abs_err'))} > bound {fmt_err(bound)}"
            + ("" if missing(basis) else f" ({basis})"))


def _read(section: Mapping[str, Any]) -> Check:
    """The check of ``section`` (:meth:`Check.read`); an equivalence FAIL above its bound reads its numbers."""
    check = Check.read(section)
    if check.verdict is Verdict.FAIL and "max_abs_err" in section:
        above = [Reason(Code.EQUIVALENCE_ABOVE_BOUND, _numbers(section))]  # a file written before codes: that one
        found = [r if r.text else above[0] for r in check.reasons if r.code is not Code.UNRECORDED] or above
        check = replace(check, reasons=tuple(found))
    return check


def _check(name: str, check: Check) -> NamedCheck:
    """A PASS says no reason here (its notes stay in ``summary.json``)."""
    return NamedCheck(name, check if check.verdict is not Verdict.PASS else Check(Verdict.PASS))


def _part(name: str, verdict: Any, reasons: Iterable[Reason] = ()) -> NamedCheck:
    """A part of a plan written without its own section, from the plan's verdict and a slice of its reasons."""
    verdict = Verdict.of(verdict)
    found = tuple(reasons) if verdict is not Verdict.PASS else ()
    return NamedCheck(name, Check(verdict, found or ((Reason(Code.UNRECORDED, "no reason recorded"),)
                                                     if verdict is not Verdict.PASS else ())))


def _of(name: str, section: Any) -> NamedCheck | None:
    if not isinstance(section, Mapping) or not isinstance(section.get("check"), str):
        return None
    return _check(name, _read(section))


def plan_checks(plan: Mapping[str, Any]) -> list[NamedCheck]:
    """The checks of ``summary.json["plan"]`` (``zeroexp.plan.check.cell.plan_section``), one per part.

    A plan that stopped before its parts (it raised: ``ERROR``; no byte model, no state measured: ``n/a``) is one
    check, ``plan``, beside ``plan.time``. Otherwise each part has its own section (``plan.state``, ``plan.calls``
    read as ``plan.collectives``, ``plan.groups``, ``plan.memory``, ``plan.time``). A plan written without the
    ``state`` and ``calls`` parts has its own ``check`` over the state bytes, the calls and the groups, its
    ``reasons`` listing the state's, then one per op that differs, then the groups': split here by that order."""
    out = []
    whole = _read(plan)
    own, reasons = whole.verdict, whole.reasons
    if "ranks" not in plan:
        out.append(_check("plan", whole))
    elif isinstance(plan.get("state"), Mapping):
        pass  # the parts below
    else:
        rows = plan.get("collectives")
        differ = [r for r in rows or () if (r.get("measured_count"), r.get("measured_bytes"))
                  != (r.get("predicted_count"), r.get("predicted_bytes"))]
        groups = plan.get("groups") if isinstance(plan.get("groups"), Mapping) else {}
        of_groups = len(groups.get("reasons") or ()) if groups.get("check") == Verdict.FAIL else 0
        of_state = len(reasons) - len(differ) - of_groups
        if own is not Verdict.FAIL:  # PASS, or n/a / ERROR for the whole: each part says the same
            out.append(_part("plan.state", own, reasons))
        elif of_state < 0:  # reasons not in the order above: the whole FAIL, every reason
            out.append(_part("plan.state", Verdict.FAIL, reasons))
        else:
            out.append(_part("plan.state", Verdict.passed_if(not of_state), reasons[:of_state]))
        if own not in (Verdict.PASS, Verdict.FAIL):
            out.append(_part("plan.collectives", own, reasons))
        elif rows is None:  # no calls measured, or no payload model: payload_check says which
            payload = Check.read({"check": plan.get("payload_check"), "reasons": plan.get("payload_reasons"),
                                  "reason_codes": plan.get("payload_reason_codes")})
            out.append(_part("plan.collectives", payload.verdict, payload.reasons))
        else:
            out.append(_part("plan.collectives", Verdict.passed_if(not differ),
                             reasons[max(of_state, 0):max(of_state, 0) + len(differ)]))
    for part, name in _PLAN_SECTIONS.items():
        found = _of(f"plan.{name}", plan.get(part))
        if found is not None:
            out.append(found)
    return out


def cell_checks(summary: Mapping[str, Any]) -> list[NamedCheck]:
    """Every check of a cell's ``summary.json`` (or of a dict shaped like it), in its sections' order."""
    out: list[NamedCheck] = []
    for name, section in summary.items():
        if name == "plan" and isinstance(section, Mapping):
            out += plan_checks(section)
        elif (found := _of(str(name), section)) is not None:
            out.append(found)
    return out


def failed_checks(summary: Mapping[str, Any] | None) -> list[NamedCheck]:
    """The checks of ``summary`` that FAILed or ERRORed: none means the cell's every check is PASS or n/a."""
    return [c for c in cell_checks(summary or {}) if c.failed]
