"""How the report writes numbers: one set of formatters for Markdown, HTML, W&B and the plots.

Bytes are shown in binary units, MiB (2^20) or GiB (2^30), one unit per table or plot, named in its column
headers; the raw byte counts are in ``report.csv``. A value that is absent (a cell without that probe
section, an op a cell never issued) is written :data:`NA`, never guessed.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable

__all__ = ["NA", "missing", "ByteUnit", "byte_unit", "fmt_factor", "fmt_int", "fmt_ms", "fmt_pct", "fmt_err",
           "fmt_number"]

NA = "n/a"


def missing(value: Any) -> bool:
    """True for None, NaN and pandas' missing markers."""
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, pd.NA (raises TypeError on ambiguity)
    except (TypeError, ValueError):
        return False


class ByteUnit:
    """A binary byte unit (MiB or GiB) with the number of decimals that keeps small values readable."""

    def __init__(self, name: str, decimals: int) -> None:
        self.name, self.decimals = name, decimals
        self.scale = 2 ** 30 if name == "GiB" else 2 ** 20

    def value(self, nbytes: Any) -> float:
        """``nbytes`` in this unit (NaN when missing)."""
        return math.nan if missing(nbytes) else float(nbytes) / self.scale

    def __call__(self, nbytes: Any) -> str:
        """``nbytes`` in this unit, without the unit's name (the column header says it); zero is ``0``."""
        if missing(nbytes):
            return NA
        return "0" if float(nbytes) == 0 else f"{float(nbytes) / self.scale:,.{self.decimals}f}"

    def __repr__(self) -> str:
        return self.name


def byte_unit(values: Iterable[Any]) -> ByteUnit:
    """GiB when the largest value reaches 1 GiB, else MiB; 2 decimals, or 4 when everything is under 1 MiB-unit
    (a 128 KiB test model reads ``0.1250`` MiB rather than ``0.13``)."""
    finite = [abs(float(v)) for v in values if not missing(v)]
    top = max(finite, default=0.0)
    name = "GiB" if top >= 2 ** 30 else "MiB"
    scale = 2 ** 30 if name == "GiB" else 2 ** 20
    return ByteUnit(name, 2 if top / scale >= 1 else 4)


def _or_na(fmt: Callable[[float], str]) -> Callable[[Any], str]:
    """Wrap a formatter of a number so that an absent value is written :data:`NA`."""
    @functools.wraps(fmt)
    def wrapper(value: Any) -> str:
        return NA if missing(value) else fmt(float(value))
    return wrapper


@_or_na
def fmt_factor(v: float) -> str:
    """A state or payload factor (a multiple of P): up to 6 significant digits, so 2 reads ``2``."""
    return f"{v:.6g}"


@_or_na
def fmt_int(v: float) -> str:
    """A count; a non-integer mean over profiled steps keeps 3 decimals."""
    return f"{int(v):d}" if v.is_integer() else f"{v:.3f}"


@_or_na
def fmt_ms(v: float) -> str:
    """Milliseconds with 3 significant decimals below 100 ms, 1 above."""
    return f"{v:.3f}" if abs(v) < 100 else f"{v:,.1f}"


@_or_na
def fmt_pct(v: float) -> str:
    """A fraction as a percentage with 2 decimals (0.0684 -> ``6.84 %``)."""
    return f"{100 * v:.2f} %"


@_or_na
def fmt_err(v: float) -> str:
    """A numerical error in scientific notation (``0`` when exactly zero)."""
    return "0" if v == 0 else f"{v:.2e}"


def fmt_number(value: Any) -> str:
    """Anything else: bools and strings as they are, numbers with up to 6 significant digits."""
    if missing(value):
        return NA
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, (int, float)):
        return fmt_factor(value)
    return str(value)
