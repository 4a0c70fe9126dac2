"""Every strategy's row: where it keeps each kind of state and what it sends (a strategy's YAML names its row,
``strategy.layout``); the ZeRO paper's stages for comparison (``reference``: no strategy runs them, so the planner
never recommends one). Each family's module defines its rows (:mod:`zeroexp.formulas.families`); a new strategy in
an existing family is one more row there."""

from __future__ import annotations

from zeroexp.formulas.families import ddp, deepspeed, fsdp1, fsdp2, paper, zero, zro
from zeroexp.formulas.families.ddp import all_reduce_buckets
from zeroexp.formulas.families.paper import PAPER
from zeroexp.formulas.layout import StateLayout

__all__ = ["LAYOUTS", "row_of", "rows_where", "LADDER"]

#: The ZeRO ladder the report lists cells in: the paper's stages, then replicated first and what each stage shards
#: (ZeRO-0; ZeRO-1, PyTorch's then zeroexp's; ZeRO-2; SHARD_GRAD_OP; FULL_SHARD, each FSDP1 then FSDP2), hybrid
#: sharding's, DeepSpeed's.
LADDER = ("zero_stage0", "zero_stage1", "zero_stage2", "zero_stage3", "ddp", "zro", "zero1", "zero2", "fsdp_grad_op",
          "fsdp2_grad_op", "fsdp_full", "fsdp2_full", "fsdp__HYBRID_SHARD_ZERO2", "fsdp_HYBRID_SHARD", "fsdp2_hybrid")

_ROWS: dict[str, StateLayout] = {**paper.ROWS, **ddp.ROWS, **zro.ROWS, **zero.ROWS, **fsdp1.ROWS, **fsdp2.ROWS,
                                 **deepspeed.ROWS}
#: Every row the planner knows, by name, in the ladder's order (a row no ladder place names last, as its family
#: lists it); ``strategy.layout`` of each registered strategy names one.
LAYOUTS: dict[str, StateLayout] = {**{name: _ROWS[name] for name in LADDER}, **_ROWS}

#: What a name no row has resolves to: a row of no model (the paper's stage 0 family, no peak model).
_NO_ROW = StateLayout("no such row", 0, frozenset(), "never", PAPER, all_reduce_buckets)


def row_of(name: str) -> StateLayout:
    """The row ``name`` names (``strategy.layout``): what the planner reads of a strategy, in place of its name; for
    a name no row has, a row of no model (no peak model)."""
    return LAYOUTS.get(name, _NO_ROW)


def rows_where(predicate) -> list[str]:
    """The names of the rows for which ``predicate(row)`` holds, in ``LAYOUTS`` order."""
    return [name for name, row in LAYOUTS.items() if predicate(row)]
