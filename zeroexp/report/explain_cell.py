"""One finished cell's explanation (``python -m zeroexp.explain CELL_DIR``): each check with its verdict and reasons,
those that failed first, and where a FAIL came from as far as the cell recorded it: the equivalence's divergence
(``summary.json[equivalence][divergence]``, zeroexp.probes.divergence), or, where the cell did not replay its steps,
the command that replays it. Read from the cell's files alone: nothing is run."""

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
    cell where it FAILed without a divergence recorded, or where the replay raised); ``failed``: how many checks
    FAILed or ERRORed."""
    checks = cell_checks(cell.summary)
    rows = sorted(({"check": c.name, "verdict": str(c.verdict), "reasons": [r.text for r in c.reasons if r.text],
                    "codes": [r.code.value for r in c.reasons]}
                   for c in checks), key=lambda r: r["verdict"] not in FAILED)
    eq = cell.summary.get("equivalence") or {}
    divergence = eq.get("divergence") if isinstance(eq.get("divergence"), dict) else None
    failed = eq.get("check") == "FAIL"
    located = divergence is not None and divergence.get("found")
    out = {"cell": cell.name, "dir": str(cell.path), "checks": rows,
           "failed": sum(1 for c in checks if c.verdict in FAILED),
           "equivalence": {"check": eq.get("check"), "max_abs_err": eq.get("max_abs_err"),
                           "bound": eq.get("effective_threshold", eq.get("threshold")), "divergence": divergence,
                           "replay": replay_command(cell) if failed and not located else None}}
    return out
