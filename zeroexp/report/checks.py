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

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from zeroexp.results.format import fmt_err, missing

__all__ = ["FAILED", "Check", "worst", "plan_checks", "cell_checks", "failed_checks"]

#: The verdicts that fail a check.
FAILED = ("ERROR", "FAIL")
#: Worst first; any other verdict (``n/a``, ``SKIP``) ranks below ``PASS``.
_ORDER = ("ERROR", "FAIL", "PASS")
#: The plan's parts with a section of their own in ``summary.json["plan"]``, by the check's name.
_PLAN_SECTIONS = {"state": "state", "calls": "collectives", "groups": "groups", "memory": "memory", "time": "time"}


@dataclass(frozen=True)
class Check:
    """One check of a cell: ``name`` (``equivalence``, ``plan.memory``), its ``verdict`` and its ``reasons``
    (why it is not ``PASS``; never empty for a verdict other than ``PASS``)."""

    name: str
    verdict: str
    reasons: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.verdict in FAILED


def worst(verdicts: Iterable[str]) -> str:
    """The worst of ``verdicts``: ERROR, then FAIL, then PASS, then any other (``n/a`` when there is none)."""
    found = list(verdicts)
    return next((v for v in _ORDER if v in found), found[0] if found else "n/a")


def _reasons(section: Mapping[str, Any]) -> list[str]:
    for key in ("reasons", "reason", "why"):
        value = section.get(key)
        if isinstance(value, (list, tuple)) and value:
            return [str(v) for v in value]
        if isinstance(value, str) and value:
            return [value]
    if section.get("check") == "FAIL" and "max_abs_err" in section:  # the equivalence probe's FAIL: its numbers
        bound = section.get("effective_threshold")
        bound = section.get("threshold") if missing(bound) else bound  # written before the reduction-order floor
        basis = section.get("threshold_basis")
        return [f"max abs err {fmt_err(section.get('max_abs_err'))} > bound {fmt_err(bound)}"
                + ("" if missing(basis) else f" ({basis})")]
    return []


def _check(name: str, verdict: Any, reasons: Iterable[str] = ()) -> Check:
    verdict = str(verdict) if isinstance(verdict, str) and verdict else "n/a"
    said = tuple(reasons) if verdict != "PASS" else ()
    return Check(name, verdict, said or (("no reason recorded",) if verdict != "PASS" else ()))


def _of(name: str, section: Any) -> Check | None:
    if not isinstance(section, Mapping) or not isinstance(section.get("check"), str):
        return None
    return _check(name, section["check"], _reasons(section))


def plan_checks(plan: Mapping[str, Any]) -> list[Check]:
    """The checks of ``summary.json["plan"]`` (``zeroexp.plan.check.cell.plan_section``), one per part.

    A plan that stopped before its parts (it raised: ``ERROR``; no byte model, no state measured: ``n/a``) is one
    check, ``plan``, beside ``plan.time``. Otherwise each part has its own section (``plan.state``, ``plan.calls``
    read as ``plan.collectives``, ``plan.groups``, ``plan.memory``, ``plan.time``). A plan written without the
    ``state`` and ``calls`` parts has its own ``check`` over the state bytes, the calls and the groups, its
    ``reasons`` listing the state's, then one per op that differs, then the groups': split here by that order."""
    out = []
    own, reasons = plan.get("check"), _reasons(plan)
    if "ranks" not in plan:
        out.append(_check("plan", own, reasons))
    elif isinstance(plan.get("state"), Mapping):
        pass  # the parts below
    else:
        rows = plan.get("collectives")
        differ = [r for r in rows or () if (r.get("measured_count"), r.get("measured_bytes"))
                  != (r.get("predicted_count"), r.get("predicted_bytes"))]
        groups = plan.get("groups") if isinstance(plan.get("groups"), Mapping) else {}
        of_groups = len(groups.get("reasons") or ()) if groups.get("check") == "FAIL" else 0
        of_state = len(reasons) - len(differ) - of_groups
        if own != "FAIL":  # PASS, or n/a / ERROR for the whole: each part says the same
            out.append(_check("plan.state", own, reasons))
        elif of_state < 0:  # reasons not in the order above: the whole FAIL, every reason
            out.append(_check("plan.state", "FAIL", reasons))
        else:
            out.append(_check("plan.state", "FAIL" if of_state else "PASS", reasons[:of_state]))
        if own not in ("PASS", "FAIL"):
            out.append(_check("plan.collectives", own, reasons))
        elif rows is None:  # no calls measured, or no payload model: payload_check says which
            out.append(_check("plan.collectives", plan.get("payload_check"), plan.get("payload_reasons") or ()))
        else:
            out.append(_check("plan.collectives", "FAIL" if differ else "PASS",
                              reasons[max(of_state, 0):max(of_state, 0) + len(differ)]))
    for part, name in _PLAN_SECTIONS.items():
        found = _of(f"plan.{name}", plan.get(part))
        if found is not None:
            out.append(found)
    return out


def cell_checks(summary: Mapping[str, Any]) -> list[Check]:
    """Every check of a cell's ``summary.json`` (or of a dict shaped like it), in its sections' order."""
    out: list[Check] = []
    for name, section in summary.items():
        if name == "plan" and isinstance(section, Mapping):
            out += plan_checks(section)
        elif (found := _of(str(name), section)) is not None:
            out.append(found)
    return out


def failed_checks(summary: Mapping[str, Any] | None) -> list[Check]:
    """The checks of ``summary`` that FAILed or ERRORed: none means the cell's every check is PASS or n/a."""
    return [c for c in cell_checks(summary or {}) if c.failed]
