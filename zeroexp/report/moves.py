"""The sweep report's matrix of checkpoint moves: one row per checkpoint a sweep's cells started from (the strategy and
world size that wrote it), one column per strategy and world size that started from it, each entry the moved cell's
verdict (``checkpoint.moved.check`` and ``equivalence.check`` together: ``PASS`` only when the state moved bit for bit
and the resumed training met the reference started from the checkpoint; otherwise the first that did not, with the
cell). A cell refused before launch (zeroexp.config.moves) has no entry; the report's failures table names it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from zeroexp.results.cells import column
from zeroexp.results.format import missing
from zeroexp.results.section import Column, ReportTable

__all__ = ["MovesSection", "moves_table"]


def _verdict(moved: Any, equivalence: Any) -> str:
    """One entry: ``PASS``, or the first check that did not pass with its verdict."""
    for name, verdict in (("moved", moved), ("equivalence", equivalence)):
        if missing(verdict) or verdict != "PASS":
            return f"{name} {'n/a' if missing(verdict) else verdict}"
    return "PASS"


def _label(label: Any, strategy: Any) -> str:
    """The strategy with its axes (``deepspeed-stage3``); a cell written before labels: its strategy."""
    return str(strategy if missing(label) else label)


def moves_table(ok: pd.DataFrame) -> ReportTable | None:
    """The matrix of the cells that started from a checkpoint (``checkpoint.moved``); None where no cell did."""
    strategies = column(ok, "checkpoint.moved.source.strategy")
    has = [not missing(v) for v in strategies]
    if not any(has):
        return None
    moved = ok[has]
    src = [f"{_label(lab, s)} N={int(n)} ({k})"
           for lab, s, n, k in zip(column(moved, "checkpoint.moved.source.label"),
                                   column(moved, "checkpoint.moved.source.strategy"),
                                   column(moved, "checkpoint.moved.source.world_size"),
                                   column(moved, "checkpoint.moved.source.kind"))]
    dst = [f"{_label(lab, s)} N={int(n)}" for lab, s, n in zip(column(moved, "checkpoint.moved.target_label"),
                                                            column(moved, "cell.strategy"),
                                                            column(moved, "cell.world_size"))]
    verdicts = [_verdict(m, e) for m, e in zip(column(moved, "checkpoint.moved.check"),
                                              column(moved, "equivalence.check"))]
    entries: dict[str, dict[str, list[str]]] = {}
    for s, d, v in zip(src, dst, verdicts):
        entries.setdefault(s, {}).setdefault(d, []).append(v)
    targets = list(dict.fromkeys(dst))
    raw = pd.DataFrame([{"from": s, **{d: ", ".join(row.get(d, [])) or "-" for d in targets}}
                        for s, row in entries.items()])
    cols = [Column("from (writer, N, kind)", "from", str), *(Column(d, d, str) for d in targets)]
    passed = sum(v == "PASS" for v in verdicts)
    note = ("Each cell that started from a checkpoint (checkpoint.load_from): the checkpoint's writer by row, the "
            "cell's strategy and N by column. PASS: every tensor moved bit for bit and the resumed training met the "
            "unsharded reference started from the checkpoint; otherwise the first check that did not; - : no such "
            f"cell. {passed} of {len(verdicts)} moves PASS.")
    return ReportTable("checkpoint_moves", "Checkpoint moves", raw, cols, note)


class MovesSection:
    """The moves matrix as a section of its own, after the checkpoint table: a report table, no digest line (the
    checkpoint line says where a cell started from)."""

    name = "checkpoint.moved"
    order = 81
    report_order = None

    @staticmethod
    def digest_line(moved: dict[str, Any]) -> None:
        return None

    @staticmethod
    def report_table(ok: pd.DataFrame) -> ReportTable | None:
        return moves_table(ok)
