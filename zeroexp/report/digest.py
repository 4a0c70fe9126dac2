"""The terminal digest of one cell: what each probe found, in one line per probe, printed after a run.

Built from ``summary.json`` alone, with the report's formatters, so the terminal, the report and the files
show the same numbers; each probe writes its own line (``Probe.digest_line``), and the plan a line per part
(``PlanSection.digest_parts``). A line's check is the cell's check of that name
(:func:`zeroexp.report.checks.cell_checks`), or the worst of its parts' (``plan`` over ``plan.state`` ...
``plan.time``), so no line reads PASS while a part of it FAILed or ERRORed. A probe a cell lacks (a dry run's
memory, a probe that did not run) has no line.
"""

from __future__ import annotations

from typing import Any

from zeroexp.report.checks import cell_checks, worst
from zeroexp.report.tables import sections
from zeroexp.results.verdict import Code

__all__ = ["digest"]


def digest(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(probe, what it found, check)`` for each section of ``summary`` with a digest line
    (``Probe.digest_line``, :func:`zeroexp.report.tables.sections` order), each part of the plan after its line;
    check ``-`` where none applies (memory and timing are reported, not checked)."""
    checks = cell_checks(summary)

    def check_of(name: str) -> str:
        found = [c.verdict for c in checks if c.name == name or c.name.startswith(name + ".")]
        return worst(found) if found else "-"

    rows = []
    for s in sections():
        section: Any = summary
        for part in s.name.split("."):  # a nested section: plan.time
            section = section.get(part) if isinstance(section, dict) else None
        if not isinstance(section, dict):
            continue
        line = s.digest_line(section)
        if line is None:
            continue
        if Code.TOO_FEW_STEPS in (section.get("reason_codes") or ()):
            line = f"not measured: {section['reason']}"  # a probe skipped in a short run, whichever it is
        rows.append((s.name, line, check_of(s.name)))
        rows += [(name, text, check_of(name)) for name, text in getattr(s, "digest_parts", lambda _: [])(section)]
    return rows
