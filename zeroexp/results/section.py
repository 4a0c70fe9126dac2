"""What a report section is made of: :class:`ReportTable` with its :class:`Column` s, and the helpers a probe
uses to build its section (``Probe.report_table``). A leaf of the report package: it imports only the
formatters, so probes and the report's assembly (``zeroexp.report.tables``) can both import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from zeroexp.results.cells import column
from zeroexp.results.format import NA, fmt_number, missing

__all__ = ["Column", "ReportTable", "OPS", "CORE_KINDS", "raw_rows", "joined"]

CORE_KINDS = ("param", "grad", "optim")
#: Collective ops in the order the ladder introduces them, with the short names used in headers.
OPS = {"all_reduce": "AR", "broadcast": "BC", "all_gather": "AG", "reduce_scatter": "RS"}


@dataclass
class Column:
    """A displayed column: ``header``, the raw field ``key``, its formatter, and optionally the field of the
    expected value (shown beside the measured one as ``(exp. X)`` when they differ)."""

    header: str
    key: str
    fmt: Callable[[Any], str] = fmt_number
    expected: str | None = None


@dataclass
class ReportTable:
    """One table of the report: its raw rows, the columns that display them, a note and bullets under it."""

    key: str
    title: str
    raw: pd.DataFrame
    columns: list[Column]
    note: str = ""
    empty_text: str = "no finished cell"
    bullets: list[str] = field(default_factory=list)

    def display(self) -> pd.DataFrame:
        """The table as strings, the one formatting shared by every renderer."""
        out = {}
        for c in self.columns:
            values = []
            for _, row in self.raw.iterrows():
                text = c.fmt(row.get(c.key))
                want = row.get(c.expected) if c.expected else None
                if c.expected and not missing(want) and not missing(row.get(c.key)) and c.fmt(want) != text:
                    text += f" (exp. {c.fmt(want)})"
                values.append(text)
            out[c.header] = values
        return pd.DataFrame(out, columns=[c.header for c in self.columns])


def raw_rows(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``label``, ``cell_name`` and ``keys`` of each row of ``frame`` (a missing key: a column of missing values)."""
    return pd.DataFrame({k: column(frame, k) for k in ["label", "cell_name", *keys]}).reset_index(drop=True)


def joined(values: list[Any], fmt: Callable[[Any], str]) -> str:
    """``a / b / c``, or n/a when the cell has none of them."""
    return NA if all(missing(v) for v in values) else " / ".join(fmt(v) for v in values)
