"""The terminal digest of one cell: what each probe found, in one line per probe, printed after a run.

Built from ``summary.json`` alone, with the report's formatters, so the terminal, the report and the files
show the same numbers; each probe writes its own line (``Probe.digest_line``). A probe a cell lacks (a dry
run's memory, a probe that did not run) has no line.
"""

from __future__ import annotations

from typing import Any

from zeroexp.report.format import missing
from zeroexp.report.tables import sections

__all__ = ["digest"]


def digest(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(probe, what it found, check)`` for each section of ``summary`` with a digest line
    (``Probe.digest_line``, :func:`zeroexp.report.tables.sections` order); check ``-`` where none applies
    (memory and timing are reported, not checked)."""
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
        if section.get("check") == "n/a" and str(section.get("reason", "")).startswith("too few steps"):
            line = f"not measured: {section['reason']}"  # a probe skipped in a short run, whichever it is
        check = section.get("check")
        rows.append((s.name, line, "-" if missing(check) else str(check)))
    return rows
