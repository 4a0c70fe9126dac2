"""Two finished cells side by side (``python -m zeroexp.explain A B``): what differs between their configurations, their
checks, and every figure both measured (state, memory, collectives, time, numerics, checkpoint), largest difference
first. Read from each cell's ``manifest.json`` (the composed configuration) and ``summary.json``; nothing is run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from zeroexp.report.checks import cell_checks
from zeroexp.results.files import flat_keys, read_json

__all__ = ["Cell", "read_cell", "compare", "FIGURES"]

#: Configuration keys that name where a cell ran or wrote, not what it is: never a difference.
WHERE = ("logger", "launcher", "timeout", "resources", "calibration", "checkpoint.dir", "checkpoint.sources_dir")
#: Units whose figure a cell lacks is zero (a state kind it holds none of, an op it never calls).
COUNTED = ("B", "calls")
#: The figures compared: (label, path into summary.json, unit). A ``*`` stands for every key of the mapping there.
FIGURES = [
    ("state bytes, largest rank", "state.max_rank_bytes.*", "B"),
    ("steady bytes, largest rank", "memory.steady_bytes_max", "B"),
    ("peak bytes, largest rank", "memory.peak_bytes_max", "B"),
    ("phase peak bytes, largest rank", "memory.phase_peak_bytes_max.*", "B"),
    ("collective calls per step", "collectives.counts.*", "calls"),
    ("collective payload per step", "collectives.payload_bytes.*", "B"),
    ("bus bytes per step", "collectives.bus_bytes.*", "B"),
    ("exposed communication", "collectives.exposed_comm_ms", "ms"),
    ("step time, median", "timing.median_ms", "ms"),
    ("step time, P95", "timing.p95_ms", "ms"),
    ("largest difference from the reference", "equivalence.max_abs_err", ""),
    ("final loss", "final_loss", ""),
    ("checkpoint bytes written", "checkpoint.save.bytes_written", "B"),
    ("checkpoint save, slowest rank", "checkpoint.save.ms", "ms"),
    ("checkpoint load, slowest rank", "checkpoint.load.ms", "ms"),
]


class Cell:
    """One finished cell as read from its directory: ``name``, ``config`` (flattened, dotted keys) and ``summary``."""

    def __init__(self, path: Path, config: dict[str, Any], summary: dict[str, Any], name: str) -> None:
        self.path, self.config, self.summary, self.name = path, config, summary, name


def read_cell(path: str | Path) -> Cell:
    """The cell in ``path``; ValueError naming what is missing (not a cell directory, a cell that wrote no summary)."""
    where = Path(path)
    manifest, summary = where / "manifest.json", where / "summary.json"
    if not manifest.is_file():
        raise ValueError(f"{where} is no cell directory (no manifest.json)")
    if not summary.is_file():
        raise ValueError(f"{where} holds no summary.json (the cell did not finish: its manifest's status is "
                         f"{read_json(manifest).get('status')!r})")
    meta = read_json(manifest)
    return Cell(where, flat_keys(meta.get("config") or {}), read_json(summary),
                str(meta.get("cell_name") or where.name))


def _figures(summary: Mapping[str, Any]) -> dict[tuple[str, str], tuple[float, str]]:
    """Every figure of :data:`FIGURES` the summary holds, by (label, key): its value and unit."""
    out = {}
    for label, path, unit in FIGURES:
        *head, last = path.split(".")
        node: Any = summary
        for part in head:
            node = node.get(part) if isinstance(node, Mapping) else None
        items = (node or {}).items() if last == "*" and isinstance(node, Mapping) else (
            [(path, node.get(last))] if isinstance(node, Mapping) else [])
        for key, value in items:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[(label, key if last == "*" else "")] = (float(value), unit)
    return out


def _size(a: float, b: float) -> float:
    """How far apart two figures are, for ordering: |log2(b / a)|; infinite where one is zero and the other not."""
    if a == b:
        return 0.0
    if a <= 0 or b <= 0:
        return math.inf
    return abs(math.log2(b / a))


def compare(a: Cell, b: Cell) -> dict[str, Any]:
    """``config``: each key whose value differs (``a``, ``b``); ``checks``: each check with its verdict in each (a
    check one cell lacks: ``missing``), those that differ first; ``figures``: each figure both or one measured,
    ``a``, ``b``, ``ratio`` (b / a), largest difference first (bytes and calls one cell lacks: zero of them; a time
    or an error one lacks: null); ``same``: how many figures are equal. Configuration keys both cells have come
    first, then those of one alone (a key of one strategy). ``notes``: a cell whose step times are unstable (the
    timing probe's CV above 5 %), whose time ratios are then trends only."""
    keys = sorted(set(a.config) | set(b.config), key=lambda k: (k not in a.config or k not in b.config, k))
    config = [{"key": k, "a": a.config.get(k, "missing"), "b": b.config.get(k, "missing")} for k in keys
              if a.config.get(k, "missing") != b.config.get(k, "missing") and not k.startswith(WHERE)]
    verdicts = [{c.name: str(c.verdict) for c in cell_checks(s.summary)} for s in (a, b)]
    names = list(dict.fromkeys([*verdicts[0], *verdicts[1]]))
    checks = sorted(({"check": n, "a": verdicts[0].get(n, "missing"), "b": verdicts[1].get(n, "missing")}
                     for n in names), key=lambda r: r["a"] == r["b"])
    fa, fb = _figures(a.summary), _figures(b.summary)
    rows = []
    for key in dict.fromkeys([*fa, *fb]):
        unit = (fa.get(key) or fb.get(key))[1]
        none = 0.0 if unit in COUNTED else None  # a kind or op a cell does not hold or call: zero of it
        va, vb = fa.get(key, (none, ""))[0], fb.get(key, (none, ""))[0]
        size = math.inf if va is None or vb is None else _size(va, vb)
        rows.append({"figure": key[0], "of": key[1], "unit": unit, "a": va, "b": vb,
                     "ratio": None if va in (None, 0) or vb is None else vb / va, "_size": size})
    rows.sort(key=lambda r: -r["_size"])
    same = sum(1 for r in rows if r["_size"] == 0)
    figures = [{k: v for k, v in r.items() if k != "_size"} for r in rows if r["_size"] > 0]
    notes = [f"{side}'s step times are unstable (CV {100 * float(c.summary['timing'].get('cv') or 0):.0f} %): its "
             "times compare by trend only, not by their ratio" for side, c in (("A", a), ("B", b))
             if (c.summary.get("timing") or {}).get("unstable")]
    return {"a": {"dir": str(a.path), "cell": a.name}, "b": {"dir": str(b.path), "cell": b.name},
            "config": config, "checks": checks, "figures": figures, "same": same, "notes": notes}
