"""The axes a cell may set beyond model x strategy x precision x offload x N, as columns of the report's cells table.

Each axis shows only in a sweep where some cell sets it (as the cell's identity holds it only when set,
zeroexp.cell.identity), and for each cell only where it applies: ``mesh`` (hybrid sharding:
``world_size / strategy.shard_size`` replicas x ``strategy.shard_size`` ranks per shard group) for ``fsdp_hybrid`` and
``fsdp2_hybrid`` only, n/a for the others; ``strategy.sync_each_microbatch`` for FSDP and FSDP2 only; activation
checkpointing, ``grad_accum`` and ``strategy.clip_grad_norm`` for every strategy (their defaults ``none``, ``1``,
``none`` where a cell leaves them); ``strategy.reshard_policy`` (FSDP2) and ``optimizer.impl`` where a cell sets
them. Read from what the cell wrote: ``manifest.json`` ``cell`` (``cell.shard_size``,
``cell.grad_accum``, ``cell.activation_checkpointing``) and its resolved ``config`` (``config.strategy.clip_grad_norm``,
which names no cell, ``config.strategy.sync_each_microbatch``, ``config.strategy.reshard_policy``,
``config.optimizer.impl``), never from the sweep's command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd

from zeroexp.results.format import NA, fmt_number, missing

__all__ = ["Axis", "AXES", "axis_values", "set_axes", "label_axes", "fmt_axis", "varies"]


def _first(row: pd.Series, *keys: str) -> Any:
    """The first of ``keys`` the row has a value for, else None."""
    return next((row.get(k) for k in keys if not missing(row.get(k))), None)


def _mesh(row: pd.Series) -> Any:
    shard = _first(row, "cell.shard_size", "config.strategy.shard_size")
    n = _first(row, "cell.world_size", "world_size")
    if shard is None or n is None:
        return None  # not a hybrid cell: the axis does not apply
    return f"{int(n) // int(shard)} x {int(shard)}"


def _checkpointing(row: pd.Series) -> Any:
    return _first(row, "cell.activation_checkpointing", "config.activation_checkpointing.name") or "none"


def _grad_accum(row: pd.Series) -> Any:
    value = _first(row, "cell.grad_accum", "config.grad_accum")
    return 1 if value is None else int(value)


def _clip(row: pd.Series) -> Any:
    value = row.get("config.strategy.clip_grad_norm")
    return "none" if missing(value) else float(value)


def _sync_each(row: pd.Series) -> Any:
    value = row.get("config.strategy.sync_each_microbatch")
    return None if missing(value) else bool(value)  # None: a strategy without the key (not FSDP / FSDP2)


def _reshard_policy(row: pd.Series) -> Any:
    value = row.get("config.strategy.reshard_policy")
    return None if missing(value) else str(value)  # None: unset, or a strategy without the key (not FSDP2)


def _adamw_impl(row: pd.Series) -> Any:
    value = row.get("config.optimizer.impl")
    return None if missing(value) else str(value)  # None: torch's own choice


@dataclass(frozen=True)
class Axis:
    """One axis: its column ``key`` in the report's raw rows, the header, the value of a cell (None where the axis
    does not apply to the cell's strategy), whether a value counts as set, what the column means (the cells table's
    note), and the label suffix of a set value for the axes that no ``cell.*`` field names (the others are in the
    label already: zeroexp.results.cells)."""

    key: str
    header: str
    value: Callable[[pd.Series], Any]
    is_set: Callable[[Any], bool]
    note: str
    label: Callable[[Any], str] | None = None


#: In the cells table's order, after N.
AXES = (
    Axis("axis.mesh", "mesh (replicas x shard)", _mesh, lambda v: v is not None,
         "mesh: hybrid sharding's (replicate, shard) device mesh, world_size / strategy.shard_size replicas x "
         "strategy.shard_size ranks per shard group"),
    Axis("axis.activation_checkpointing", "act. ckpt", _checkpointing, lambda v: v not in (None, "none"),
         "act. ckpt: activation_checkpointing (full: each wrap unit recomputed in backward; selective_layer-everyK: "
         "every K-th; selective_op: each unit under a per-op policy)"),
    Axis("axis.grad_accum", "grad accum", _grad_accum, lambda v: v not in (None, 1),
         "grad accum: grad_accum, micro-batches per optimizer step (every probe counts optimizer steps)"),
    Axis("axis.sync_each_microbatch", "sync each micro-batch", _sync_each, bool,
         "sync each micro-batch: strategy.sync_each_microbatch of FSDP and FSDP2 (reduce-scatter every micro-batch "
         "instead of no_sync)", lambda v: "sync_each_microbatch"),
    Axis("axis.clip_grad_norm", "clip grad norm", _clip, lambda v: v not in (None, "none"),
         "clip grad norm: strategy.clip_grad_norm, the max global gradient norm (none: not clipped)",
         lambda v: f"clip={fmt_number(v)}"),
    Axis("axis.reshard_policy", "reshard policy", _reshard_policy, lambda v: v is not None,
         "reshard policy: strategy.reshard_policy of FSDP2, torchtitan's reshard_after_forward per unit (always, "
         "default: the last unit and the root kept after forward, never)", lambda v: f"reshard={v}"),
    Axis("axis.adamw_impl", "AdamW", _adamw_impl, lambda v: v is not None,
         "AdamW: optimizer.impl, AdamW's update path (single, foreach, fused; torch's own choice where unset)",
         lambda v: f"adamw={v}"),
)


def axis_values(frame: pd.DataFrame) -> pd.DataFrame:
    """One column per axis (:data:`AXES` ``key``), one row per cell of ``frame``: the cell's value, None where the
    axis does not apply."""
    return pd.DataFrame({a.key: [a.value(row) for _, row in frame.iterrows()] for a in AXES}, index=frame.index,
                        dtype=object)


def set_axes(frame: pd.DataFrame) -> list[Axis]:
    """The axes some cell of ``frame`` sets (a value other than the default), in :data:`AXES` order."""
    values = axis_values(frame)
    return [a for a in AXES if any(a.is_set(v) for v in values[a.key])]


def label_axes(frame: pd.DataFrame) -> list[list[str]]:
    """Per cell (row of ``frame``), the label suffixes of the axes that tell cells of the sweep apart and that the cell
    sets, for the axes the cell's identity does not already name in ``cell.*`` (``strategy.clip_grad_norm``,
    ``strategy.sync_each_microbatch``)."""
    values = axis_values(frame)
    out: list[list[str]] = [[] for _ in range(len(frame))]
    for axis in (a for a in AXES if a.label is not None):
        column = values[axis.key]
        if not varies(column):  # the same for every cell: it tells none apart
            continue
        for i, value in enumerate(column):
            if axis.is_set(value):
                out[i].append(axis.label(value))
    return out


def fmt_axis(value: Any) -> str:
    """An axis value: n/a where the axis does not apply, ``yes`` / ``no`` for a flag, numbers compactly."""
    if value is None or (not isinstance(value, str) and missing(value)):
        return NA
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt_number(value)


def varies(values: Any) -> bool:
    """Whether ``values`` (a column of the sweep's cells) hold more than one value, a missing one counting as one
    (pandas' string columns leave missing values out of ``nunique``)."""
    return len({"" if missing(v) else str(v) for v in values}) > 1
