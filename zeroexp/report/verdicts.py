"""The verdicts block on top of the report: how many cells passed each check, and every failure in words."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from zeroexp.results.cells import column, is_dry_run
from zeroexp.report.checks import FAILED, NamedCheck, cell_checks, failed_checks
from zeroexp.results.format import fmt_ms, missing
from zeroexp.results.verdict import Verdict

__all__ = ["Verdicts", "verdicts"]

#: The checks of a cell (zeroexp.report.checks.cell_checks) -> what each asserts, in the verdicts' order.
CHECKS = {"state": "state factors match the ZeRO formula", "collectives": "collective fingerprint matches",
          "equivalence": "parameters match the unsharded reference",
          "grad_norm": "every rank's total gradient norm matches the reference's, every step",
          "plan.state": "planned state bytes of every rank and kind equal the measured",
          "plan.collectives": "planned calls and payload of every op equal the measured",
          "plan.groups": "planned groups equal the live ones",
          "plan.memory": "the peak model matches each phase's measured peak within its tolerance",
          "plan.time": "the predicted step time matches the measured median within its tolerance",
          "plan.checkpoint": "the tensors' bytes each rank wrote for the checkpoint equal the planned",
          "checkpoint": "one step after save and restore is bit-identical"}
#: Checks every cell has; the others get a line when some finished cell has them (plans are newer than the probes,
#: checkpoints opt-in).
REQUIRED = ("state", "collectives", "equivalence")


@dataclass
class Verdicts:
    """``lines``: one per check; ``failures``: one sentence per failure; ``ok``: nothing failed."""

    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    ok: bool = True


def _cells_line(cells: pd.DataFrame) -> str:
    status = column(cells, "status").fillna("unknown").value_counts()
    order = {"refused": 0, "skipped": 1}  # then running, unreadable...: by name
    others = ", ".join(f"{status[s]} {s}" for s in sorted(status.index, key=lambda s: (order.get(s, 2), s))
                       if s not in ("ok", "failed"))
    dry = int(is_dry_run(cells).sum())
    return (f"Cells: {len(cells)}, {status.get('ok', 0)} finished, {status.get('failed', 0)} failed"
            + (f", {others}" if others else "")
            + (f"; {dry} of them dry runs (one process under a fake process group: state and collectives only; "
               "no memory, timing or equivalence)" if dry else "") + ".")


def _nested(row: pd.Series) -> dict[str, Any]:
    """A ``load_sweep`` row as the nested dicts it was flattened from (its missing values left out)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if missing(value):
            continue
        node, *path, last = [out, *str(key).split(".")]
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break
        else:
            node[last] = value
    return out


def _verdict_of(checks: dict[str, NamedCheck], name: str) -> Verdict | None:
    """The cell's verdict of check ``name``; a part of a plan that stopped before its parts takes the plan's
    (``ERROR``: none of them was checked)."""
    if name in checks:
        return checks[name].verdict
    plan = checks.get("plan")
    return plan.verdict if plan is not None and name.startswith("plan.") else None


def _check_line(name: str, claim: str, verdicts: list[Verdict | None], dry: list[bool]) -> str:
    passed = verdicts.count(Verdict.PASS)
    na_dry = sum(v is None and d for v, d in zip(verdicts, dry))
    na = sum(v is None for v in verdicts) - na_dry
    others = [v for v in verdicts if v is not None and v is not Verdict.PASS]
    order = sorted(set(others), key=lambda v: (v not in FAILED, FAILED.index(v) if v in FAILED else 0, v))
    line = f"{name}: {passed} of {len(verdicts)} finished cells PASS ({claim})"
    line += "".join(f", {others.count(v)} {v}" for v in order)
    line += f", {na} n/a (no {name} section)" if na else ""
    return line + (f", {na_dry} n/a (dry run: not measured)" if na_dry else "") + "."


def _check_lines(ok: pd.DataFrame) -> list[str]:
    """One line per check of :data:`CHECKS` (the optional ones where some cell has it), then one per other check
    some cell has (a probe's own), each counting every verdict, FAIL and ERROR first."""
    per_cell = [{c.name: c for c in cell_checks(_nested(row))} for _, row in ok.iterrows()]
    dry = list(is_dry_run(ok))
    names = [n for n in CHECKS if n in REQUIRED or any(_verdict_of(c, n) is not None for c in per_cell)]
    names += [n for n in dict.fromkeys(n for c in per_cell for n in c) if n not in CHECKS and n != "plan"
              and any(c[n].verdict in (*FAILED, Verdict.PASS) for c in per_cell if n in c)]  # not a skipped probe's n/a
    return [_check_line(n, CHECKS.get(n, "its check"), [_verdict_of(c, n) for c in per_cell], dry) for n in names]


def _timing_lines(ok: pd.DataFrame) -> list[str]:
    timed = ok[[not missing(v) for v in column(ok, "timing.median_ms")]]
    if timed.empty:
        return ["timing: n/a (dry runs: no step time)." if len(ok) and is_dry_run(ok).all()
                else "timing: n/a (no timing section)."]
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
    """A sentence per cell that did not finish, and one per failed check of a finished cell
    (:func:`zeroexp.report.checks.failed_checks`), naming the check."""
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
        failed = failed_checks(_nested(row))
        out += [f"{label}: {c.name} {c.verdict}: " + "; ".join(c.texts) + _located(row, c.name) for c in failed]
        if failed and not missing(row.get("cell_dir")):
            out[-1] += f" (every check: `python -m zeroexp.explain {shlex.quote(str(row['cell_dir']))}`)"
    return out


def _located(row: pd.Series, check: str) -> str:
    """An equivalence FAIL's divergence, where the cell replayed its steps (zeroexp.probes.divergence)."""
    if check != "equivalence" or missing(row.get("equivalence.divergence.found")):
        return ""
    from zeroexp.probes.divergence import divergence_line

    return "; " + divergence_line(_nested(row)["equivalence"]["divergence"])


def verdicts(cells: pd.DataFrame) -> Verdicts:
    """The verdicts of cells in ladder order (with ``label``), as sentences."""
    ok = cells[column(cells, "status") == "ok"]
    lines = [_cells_line(cells), *_check_lines(ok)]
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
