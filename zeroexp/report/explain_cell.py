"""One finished cell's explanation (``python -m zeroexp.explain CELL_DIR``): each check with its verdict and reasons,
those that failed first, and where a FAIL came from as far as the cell recorded it: the equivalence's divergence
(``summary.json[equivalence][divergence]``, zeroexp.probes.divergence), or, where the cell did not replay its steps,
the command that replays it; and what the step made alive at its highest peak, by module and op (the memory
probe's ``born_at_peak_by_rank``). Read from the cell's files alone: nothing is run."""

from __future__ import annotations

import shlex
from typing import Any

from zeroexp.report.checks import cell_checks
from zeroexp.report.compare import Cell
from zeroexp.results.files import read_json
from zeroexp.results.verdict import FAILED

__all__ = ["explain_cell", "replay_command"]

#: The override that replays a cell's steps to locate its divergence (zeroexp.probes.divergence).
TRACE = "probes.trace_divergence=true"


def replay_command(cell: Cell) -> str | None:
    """``python -m zeroexp <the cell's overrides> probes.trace_divergence=true``: the cell run again, replayed (None
    where its manifest records no overrides)."""
    overrides = read_json(cell.path / "manifest.json").get("overrides")
    if overrides is None:
        return None
    kept = [o for o in overrides if not o.startswith("probes.trace_divergence=") and not o.startswith("hydra.")]
    return "python -m zeroexp " + " ".join(shlex.quote(o) for o in [*kept, TRACE])


def explain_cell(cell: Cell) -> dict[str, Any]:
    """``checks``: every check of the cell, ``check``, ``verdict``, ``reasons`` and ``codes``, the failed first;
    ``equivalence``: its figures, ``divergence`` (as recorded, or null) and ``replay`` (the command that replays the
    cell where it FAILed without a divergence recorded, or where the replay raised); ``memory_at_peak``: what the
    step made alive at the highest rank's peak (its ``rank``, ``phase``, ``bytes``, ``by_module``, ``by_op``,
    ``groups``; null where not recorded: a CUDA cell, a dry run); ``failed``: how many checks FAILed or ERRORed."""
    checks = cell_checks(cell.summary)
    rows = sorted(({"check": c.name, "verdict": str(c.verdict), "reasons": [r.text for r in c.reasons if r.text],
                    "codes": [r.code.value for r in c.reasons]}
                   for c in checks), key=lambda r: r["verdict"] not in FAILED)
    eq = cell.summary.get("equivalence") or {}
    divergence = eq.get("divergence") if isinstance(eq.get("divergence"), dict) else None
    failed = eq.get("check") == "FAIL"
    replayed = divergence is not None and not divergence.get("error")  # found or not, the cell replayed its steps
    memory = cell.summary.get("memory") or {}
    worst, phase = memory.get("max_rank"), memory.get("peak_phase_of_max_rank")
    ranks = memory.get("born_at_peak_by_rank") or []
    born = ranks[int(worst)] if worst is not None and int(worst) < len(ranks) else None
    peak = None if not born or phase not in born else {"rank": int(worst), "phase": phase, **born[phase]}
    out = {"cell": cell.name, "dir": str(cell.path), "checks": rows, "memory_at_peak": peak,
           "failed": sum(1 for c in checks if c.verdict in FAILED),
           "equivalence": {"check": eq.get("check"), "max_abs_err": eq.get("max_abs_err"),
                           "bound": eq.get("effective_threshold", eq.get("threshold")), "divergence": divergence,
                           "replay": replay_command(cell) if failed and not replayed else None}}
    return out
