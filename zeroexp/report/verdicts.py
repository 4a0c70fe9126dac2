"""The verdicts block on top of the report: how many cells passed each check, and every failure in words."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from zeroexp.report.cells import column, is_dry_run
from zeroexp.report.format import fmt_err, fmt_ms, missing

__all__ = ["Verdicts", "verdicts"]

#: The checked sections: summary.json key -> what the check asserts.
CHECKS = {"state": "state factors match the ZeRO formula", "collectives": "collective fingerprint matches",
          "equivalence": "parameters match the unsharded reference",
          "plan": "planned state bytes, collective calls and groups equal the measured ones",
          "checkpoint": "one step after save and restore is bit-identical"}
#: Sections reported only when some cell has them (the planner's is newer than the probes; checkpoints are opt-in).
OPTIONAL = ("plan", "checkpoint")


@dataclass
class Verdicts:
    """``lines``: one per check; ``failures``: one sentence per failure; ``ok``: nothing failed."""

    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ok: bool = True


def _as_list(value) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [] if missing(value) else [str(value)]


def _cells_line(cells: pd.DataFrame) -> str:
    status = column(cells, "status").fillna("unknown").value_counts()
    others = ", ".join(f"{n} {s}" for s, n in status.items() if s not in ("ok", "failed"))
    dry = int(is_dry_run(cells).sum())
    return (f"Cells: {len(cells)}, {status.get('ok', 0)} finished, {status.get('failed', 0)} failed"
            + (f", {others}" if others else "")
            + (f"; {dry} of them dry runs (one process under a fake process group: state and collectives only; "
               "no memory, timing or equivalence)" if dry else "") + ".")


def _check_line(ok: pd.DataFrame, section: str, claim: str) -> str:
    checks, dry = list(column(ok, f"{section}.check")), list(is_dry_run(ok))
    passed = checks.count("PASS")
    na_dry = sum(missing(c) and d for c, d in zip(checks, dry))
    na = sum(missing(c) for c in checks) - na_dry
    others = pd.Series([c for c in checks if not missing(c) and c != "PASS"], dtype=object).value_counts()
    line = f"{section}: {passed} of {len(ok)} finished cells PASS ({claim})"
    line += "".join(f", {n} {value}" for value, n in others.items())
    line += f", {na} n/a (no {section} section)" if na else ""
    return line + (f", {na_dry} n/a (dry run: not measured)" if na_dry else "") + "."


def _timing_lines(ok: pd.DataFrame) -> list[str]:
    timed = ok[[not missing(v) for v in column(ok, "timing.median_ms")]]
    if timed.empty:
        return ["timing: n/a (dry runs: no step time)." if len(ok) and is_dry_run(ok).all() else "timing: n/a (no timing section)."]
    unstable = [bool(v) for v in timed["timing.unstable"]]
    order = timed.sort_values("timing.median_ms")
    if any(unstable):
        head = (f"timing: {sum(unstable)} of {len(timed)} cells unstable (CV > 5 %): step times are trends, "
                "not ratios.")
        if len(timed) < 2:
            return [head]
        return [head, "Median step time, fastest first (trend only): " + ", ".join(order["label"]) + "."]
    base = timed.iloc[0]
    ratios = ", ".join(f"{r['label']} {float(r['timing.median_ms']) / float(base['timing.median_ms']):.2f}×"
                       for _, r in timed.iloc[1:].iterrows())
    return [f"timing: all {len(timed)} cells stable (CV <= 5 %).",
            f"Median step time relative to {base['label']} ({fmt_ms(base['timing.median_ms'])} ms): {ratios or '-'}."]


def _failures(cells: pd.DataFrame) -> list[str]:
    out = []
    for _, row in cells.iterrows():
        label = row["label"]
        if row.get("status") != "ok":
            rank = row.get("error.rank")
            who = "" if missing(rank) else f"rank {int(rank)} "
            cause = row.get("error.cause")
            log = row.get("error.log")
            out.append(f"{label}: cell {row.get('status')}: {who}{'' if missing(cause) else f'({cause}) '}"
                       f"{row.get('error.message') if not missing(row.get('error.message')) else 'no error recorded'}"
                       + ("" if missing(log) else f" (see {row['cell_name']}/{log})"))
            continue
        for section in CHECKS:
            check = row.get(f"{section}.check")
            if check in ("FAIL", "ERROR"):
                reasons = _as_list(row.get(f"{section}.reasons")) or _as_list(row.get(f"{section}.why"))
                if section == "equivalence" and not reasons:
                    bound = row.get("equivalence.effective_threshold")
                    if missing(bound):  # summaries written before the reduction-order floor existed
                        bound = row.get("equivalence.threshold")
                    basis = row.get("equivalence.threshold_basis")
                    reasons = [f"max abs err {fmt_err(row.get('equivalence.max_abs_err'))} > bound {fmt_err(bound)}"
                               + ("" if missing(basis) else f" ({basis})")]
                out.append(f"{label}: {section} {check}: " + "; ".join(reasons or ["no reason recorded"]))
    return out


def verdicts(cells: pd.DataFrame) -> Verdicts:
    """The verdicts of cells in ladder order (with ``label``), as sentences."""
    ok = cells[column(cells, "status") == "ok"]
    lines = [_cells_line(cells), *(_check_line(ok, s, c) for s, c in CHECKS.items()
                                   if s not in OPTIONAL or f"{s}.check" in ok.columns)]
    dry_mask = is_dry_run(ok)
    have = [not missing(v) for v in column(ok, "memory.peak_bytes_max")]
    mem = sum(h for h, d in zip(have, dry_mask) if not d)
    simulated = sum(h for h, d in zip(have, dry_mask) if d)
    dry = int(dry_mask.sum())
    lines.append(f"memory: steady and peak measured in {mem} of {len(ok)} finished cells (reported, not checked)"
                 + (f"; {dry} dry runs allocate nothing to measure" + (f" ({simulated} simulated over fake storages, "
                    "beside the peak model)" if simulated else "") + "." if dry else "."))
    lines += _timing_lines(ok)
    failures = _failures(cells)
    return Verdicts(lines=lines, failures=failures, ok=not failures)
