"""The terminal digest of one cell: what each probe found, in one line per probe, printed after a run.

Built from ``summary.json`` alone, with the report's formatters, so the terminal, the report and the files
show the same numbers. A probe a cell lacks (a dry run's memory, a probe that did not run) has no line.
"""

from __future__ import annotations

from typing import Any

from zeroexp.report.format import byte_unit, fmt_err, fmt_factor, fmt_ms, fmt_pct, missing
from zeroexp.report.tables import OPS

__all__ = ["digest"]

def _state(s: dict[str, Any]) -> str:
    f = s.get("factors", {})
    core = " / ".join(fmt_factor(f.get(k)) for k in ("param", "grad", "optim"))
    unit = byte_unit(s.get("max_rank_bytes", {}).values())
    per_rank = " / ".join(unit(s.get("max_rank_bytes", {}).get(k)) for k in ("param", "grad", "optim"))
    return f"P/G/O x P (sum over ranks) {core}; largest rank {per_rank} {unit}"


def _human_bytes(nbytes: Any) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB)."""
    if missing(nbytes):
        return "n/a"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _collectives(c: dict[str, Any]) -> str:
    counts, payload = c.get("counts", {}), c.get("payload_bytes", {})
    ops = ", ".join(f"{n} {OPS.get(op, op)} ({_human_bytes(payload.get(op))})" for op, n in counts.items() if n)
    return f"per step: {ops or 'none'} (payload S)"


def _memory(m: dict[str, Any]) -> str:
    unit = byte_unit([m.get("steady_bytes_max"), m.get("peak_bytes_max")])
    phase = m.get("peak_phase_of_max_rank")
    return (f"largest rank: steady {unit(m.get('steady_bytes_max'))} {unit}, peak {unit(m.get('peak_bytes_max'))} "
            f"{unit}" + ("" if missing(phase) else f" (in {phase})"))


def _timing(t: dict[str, Any]) -> str:
    word = "unstable: a trend, not a figure" if t.get("unstable") else "stable"
    return (f"median {fmt_ms(t.get('median_ms'))} ms, P95 {fmt_ms(t.get('p95_ms'))} ms, CV {fmt_pct(t.get('cv'))} "
            f"over {t.get('timed_steps')} steps ({word})")


def _equivalence(e: dict[str, Any]) -> str:
    bound = e.get("effective_threshold", e.get("threshold"))
    basis = e.get("threshold_basis")
    return (f"max abs err {fmt_err(e.get('max_abs_err'))} vs bound {fmt_err(bound)}"
            + ("" if missing(basis) else f" ({basis})") + f" after {e.get('steps')} steps")


def _plan(p: dict[str, Any]) -> str:
    if p.get("check") == "n/a":
        return "; ".join(p.get("reasons", [])) or "no byte model"
    verdict = "equal the measured" if p.get("check") == "PASS" else "differ from the measured"
    return f"{p.get('layout')}: predicted bytes per rank and kind {verdict}"


def _checkpoint(c: dict[str, Any]) -> str:
    save, load = c.get("save", {}), c.get("load", {})
    return (f"{c.get('kind')}: {c.get('files')} files saved in {fmt_ms(save.get('ms'))} ms, restored in "
            f"{fmt_ms(load.get('ms'))} ms; restored and continued bit for bit: "
            f"{c.get('restored_bit_identical')} / {c.get('continuation_bit_identical')}")


_LINES = {"state": _state, "collectives": _collectives, "memory": _memory, "timing": _timing,
          "equivalence": _equivalence, "plan": _plan, "checkpoint": _checkpoint}


def digest(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(probe, what it found, check)`` for each probe section of ``summary``; check ``-`` where none applies
    (memory and timing are reported, not checked)."""
    rows = []
    for key, line in _LINES.items():
        section = summary.get(key)
        if not isinstance(section, dict):
            continue
        check = section.get("check")
        rows.append((key, line(section), "-" if missing(check) else str(check)))
    return rows
