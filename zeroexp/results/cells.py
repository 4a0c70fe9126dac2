"""The cells of a sweep in the order of the ZeRO ladder, each with a short label for tables and plots."""

from __future__ import annotations

from typing import Any

import pandas as pd

from zeroexp.formulas import LAYOUTS
from zeroexp.results.axes import label_axes, varies
from zeroexp.results.format import missing

__all__ = ["LADDER", "PREFETCH_ORDER", "column", "order_cells"]

#: The ZeRO ladder: the order of the strategies' rows in the one expectation model (``zeroexp.formulas.LAYOUTS``),
#: replicated first, then what each stage shards; a cell is placed by its row (``plan.row``, else its strategy's
#: name). Cells of no row follow, by name.
LADDER = tuple(LAYOUTS)
PREFETCH_ORDER = ("pre", "post", "none")
#: Axes that can tell cells of a sweep apart besides the strategy, in the order they appear in a label.
_AXES = ("model", "precision", "offload", "world_size")


def column(frame: pd.DataFrame, key: str) -> pd.Series:
    """``frame[key]``, or a column of missing values when no cell has that field."""
    return frame[key] if key in frame.columns else pd.Series([None] * len(frame), index=frame.index, dtype=object)


def is_dry_run(frame: pd.DataFrame) -> pd.Series:
    """True for the cells that are dry runs (``summary.json["mode"] == "dry_run"``, zeroexp.rank.dryrun)."""
    return column(frame, "mode") == "dry_run"


def _rank(values: tuple[str, ...], value: Any) -> tuple[int, str]:
    value = "" if missing(value) else str(value)
    return (values.index(value), "") if value in values else (len(values), value)


def _sort_key(row: pd.Series) -> tuple:
    stage = row.get("cell.stage")
    layout = row.get("plan.row")
    return (*_rank(LADDER, row.get("cell.strategy") if missing(layout) else layout),
            -1 if missing(stage) else float(stage),
            *_rank(PREFETCH_ORDER, row.get("cell.prefetch")),
            *(_axis_key(row.get(f"cell.{axis}")) for axis in _AXES), str(row.get("cell_name")))


def _axis_key(value: Any) -> tuple[int, float, str]:
    """Numbers (world sizes) sort as numbers, before text; missing values last."""
    if missing(value):
        return (2, 0.0, "")
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def _label(row: pd.Series, varying: list[str], extra: list[str]) -> str:
    label = str(row.get("cell.strategy")) if not missing(row.get("cell.strategy")) else str(row.get("cell_name"))
    keys = [k for k in row.index if k.startswith("cell.") and k not in ("cell.strategy",)]
    for key in sorted(keys, key=lambda k: k != "cell.prefetch"):  # the prefetch suffix belongs to the strategy
        value, axis = row[key], key.removeprefix("cell.")
        if missing(value) or (axis != "prefetch" and key not in varying):
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # a column with missing values is float in pandas: stage 2, not 2.0
        if axis == "prefetch":
            label += f"-{value}"
        elif axis == "world_size":
            label += f" N={value}"
        elif axis in _AXES:
            label += f" {value}"
        else:
            label += f" {axis}={value}"
    return " ".join([label, *extra])


def order_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (from :func:`zeroexp.results.files.load_sweep`) in ladder order, with a ``label`` column.

    A label is the strategy, ``-<prefetch>`` where prefetch applies, and each other axis that varies across the
    sweep and the cell sets (``N=4``, ``bf16``, ``stage=2``, ``shard_size=2``, ``grad_accum=4``, ``clip=0.05``:
    :func:`zeroexp.results.axes.label_axes`); labels that would still collide get the cell id.
    """
    if frame.empty:
        return frame.assign(label=pd.Series(dtype=object))
    frame = frame.iloc[sorted(range(len(frame)), key=lambda i: _sort_key(frame.iloc[i]))].reset_index(drop=True)
    varying = [k for k in frame.columns if k.startswith("cell.") and varies(frame[k])]
    extra = label_axes(frame)  # the axes no cell.* field names: strategy.clip_grad_norm, sync_each_microbatch
    labels = [_label(row, varying, more) for (_, row), more in zip(frame.iterrows(), extra)]
    dupes = {lab for lab in labels if labels.count(lab) > 1}
    frame["label"] = [f"{lab} #{cid}" if lab in dupes else lab for lab, cid in zip(labels, column(frame, "cell_id"))]
    return frame
