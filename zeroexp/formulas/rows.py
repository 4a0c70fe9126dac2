"""Every strategy's row: where it keeps each kind of state and what it sends (a strategy's YAML names its row,
``strategy.layout``); the ZeRO paper's stages for comparison (``reference``: no strategy runs them, so the planner
never recommends one). A new strategy is one more row."""

from __future__ import annotations

from zeroexp.formulas.deepspeed import DEEPSPEED_ROWS
from zeroexp.formulas.hybrid import hybrid_units
from zeroexp.formulas.layout import (ModelShape, PlanKnobs, StateLayout, all_reduce_buckets, all_reduce_then_broadcast,
                                     cut_buckets, gather_shards_twice, gather_units, owner_assignment, scatter_gather,
                                     scatter_gather_each_micro_batch)

__all__ = ["LAYOUTS", "row_of", "rows_where", "ddp_buckets", "buffer_broadcasts"]


def ddp_buckets(shape: ModelShape, knobs: PlanKnobs) -> tuple[tuple[int, ...], ...]:
    """DDP's steady gradient buckets, each its parameters' numels: the parameters in gradient-ready order (the first
    backward's, which ``Reducer::rebuild_buckets`` keeps; with ``find_unused_parameters`` the reducer rebuilds none,
    ``should_rebuild_buckets``, so DDP's first assignment stays: cut in definition order, the buckets reversed,
    each in definition order), a bucket closed once it holds ``bucket_cap_mb``
    or more (``compute_bucket_assignment_by_size``; zeroexp passes the cap explicitly, so it holds for the first
    bucket too). One dtype assumed (fp32 at rest, also under autocast)."""
    numels = shape.numels
    if _finds_unused(shape, knobs):  # DDP's first assignment: cut in definition order, the list of buckets reversed
        cut = cut_buckets([k * 4 for k in numels], knobs.bucket_cap_bytes, "reach")
        return tuple(tuple(numels[i] for i in b) for b in reversed(cut))
    order = shape.ready_order
    buckets = cut_buckets([numels[i] * 4 for i in order], knobs.bucket_cap_bytes, "reach")
    return tuple(tuple(numels[order[j]] for j in b) for b in buckets)


#: DDP's ``broadcast_bucket_size``: the buffers' coalesced broadcasts are cut at 250 MiB (torch's DDP default).
BUFFER_BROADCAST_CAP = 250 * 2**20


def buffer_broadcasts(buffers: tuple[tuple[str, int], ...], cap: int = BUFFER_BROADCAST_CAP) -> tuple[int, ...]:
    """Bytes of each broadcast DDP's ``broadcast_buffers`` issues per step (``_sync_module_buffers`` ->
    ``dist._broadcast_coalesced``): the buffers grouped by dtype, in first-seen order, each group flattened into
    broadcasts of at most ``cap`` bytes (a tensor above it alone). Once per step: DDP syncs before a forward that
    follows a synchronised backward, so under ``no_sync`` accumulation too."""
    by_dtype: dict[str, list[int]] = {}
    for dtype, nbytes in buffers:
        by_dtype.setdefault(dtype, []).append(nbytes)
    return tuple(sum(sizes[i] for i in b) for sizes in by_dtype.values() for b in cut_buckets(sizes, cap))


def _ddp_unused(shape: ModelShape, knobs: PlanKnobs) -> dict:
    """DDP with parameters a step gives no gradient: they keep no gradient (``.grad`` stays None) and so no optimizer
    state; ``find_unused_parameters`` (set when there are such parameters, unless given) adds one all_reduce of the
    reducer's used-parameter map, an int32 per trainable parameter (``Reducer::all_reduce_local_used_map``)."""
    find = _finds_unused(shape, knobs)
    return {"ungraded": shape.unused, "used_map_bytes": 4 * len(shape.numels) if find and shape.exact else 0}


def _finds_unused(shape: ModelShape, knobs: PlanKnobs) -> bool:
    """DDP's ``find_unused_parameters``: as given, else whether a traced step leaves a parameter ungraded."""
    return knobs.find_unused_parameters if knobs.find_unused_parameters is not None else bool(shape.unused)


def _ddp_comm(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    return {"buckets": ddp_buckets(shape, knobs), "buffer_broadcasts": buffer_broadcasts(shape.buffers),
            **_ddp_unused(shape, knobs)}


def _zro_comm(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    """DDP's buckets, then ZeroRedundancyOptimizer's broadcasts: one per owned parameter, rank by rank, or with
    ``parameters_as_bucket_view`` one per rank's bucket (an empty one included)."""
    numels = shape.numels
    if not shape.exact:
        broadcasts = (shape.numel,)
    else:
        owned = [[numels[i] for i in o] for o in owner_assignment(numels, world_size)]
        broadcasts = tuple(sum(o) for o in owned) if knobs.parameters_as_bucket_view else \
            tuple(k for o in owned for k in o)
    return {"buckets": ddp_buckets(shape, knobs), "broadcasts": broadcasts,
            "buffer_broadcasts": buffer_broadcasts(shape.buffers), **_ddp_unused(shape, knobs)}


def _one_bucket(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    return {"buckets": (shape.numels if shape.exact else (shape.numel,),)}


_MIXED = frozenset({"fp32", "bf16", "fp16"})
_OS, _OS_G, _OS_G_P = frozenset({"optim"}), frozenset({"optim", "grad"}), frozenset({"optim", "grad", "param"})
_OFF = [frozenset({"none"}), frozenset({"none", "optimizer"}), frozenset({"none", "optimizer", "full"})]
#: FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state on the host (no
#: optimizer-only offload in FSDP2)
_OFF_FSDP2 = frozenset({"none", "full"})


def _twice_unless_root(root: bool, knobs: PlanKnobs) -> int:
    return 1 if root else 2  # FSDP1 FULL_SHARD keeps the root unit after forward (_post_forward_reshard)


def _twice(root: bool, knobs: PlanKnobs) -> int:
    # FSDP2 reshard_after_forward=True passed explicitly: the root too; None (its default) keeps the root
    return 1 if root and knobs.root_kept_after_forward else 2


def _twice_always(root: bool, knobs: PlanKnobs) -> int:
    return 2  # FSDP2 HSDP passes reshard_after_forward=True: the root too, whatever the planner's fsdp2_full knob


#: Every row the planner knows, by name; ``strategy.layout`` of each registered strategy names one. The order is the
#: ZeRO ladder the report lists cells in: the paper's stages, then replicated first and what each stage shards
#: (ZeRO-0; ZeRO-1, PyTorch's then zeroexp's; ZeRO-2; SHARD_GRAD_OP; FULL_SHARD, each FSDP1 then FSDP2), DeepSpeed's.
LAYOUTS: dict[str, StateLayout] = {
    "zero_stage0": StateLayout("baseline (paper)", 0, frozenset(), "mixed", "none", all_reduce_buckets,
                               comm=_one_bucket, precisions=_MIXED, source="[ZeRO] 5.1, 7.1, Figure 1",
                               reference=True),
    "zero_stage1": StateLayout("P_os (paper)", 1, _OS, "mixed", "flat", scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]", reference=True),
    "zero_stage2": StateLayout("P_os+g (paper)", 2, _OS_G, "mixed", "flat", scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]", reference=True),
    "zero_stage3": StateLayout("P_os+g+p (paper)", 3, _OS_G_P, "mixed", "flat", gather_shards_twice, "largest",
                               precisions=_MIXED, offloads=_OFF[2], gathers_per_unit=_twice_unless_root,
                               source="[ZeRO] 5.1, 7.2.2, Figure 1; [OFFLOAD]", reference=True),
    # ddp / zro under bf16 / fp16: autocast, so parameters, gradients and what is all-reduced stay fp32
    "ddp": StateLayout("DDP", 0, frozenset(), "never", "none", all_reduce_buckets, fp32_at_rest=True,
                       fp32_on_the_wire=True, precisions=_MIXED, comm=_ddp_comm, source="zeroexp.strategies.ddp",
                       peak_flow="new", init_kind="replica"),
    "zro": StateLayout("DDP + ZeroRedundancyOptimizer", 1, _OS, "never", "owners", all_reduce_then_broadcast,
                       fp32_at_rest=True, fp32_on_the_wire=True, precisions=_MIXED, comm=_zro_comm,
                       source="zeroexp.strategies.zro", peak_flow="new", ranks_differ=True, init_kind="replica"),
    "zero1": StateLayout("zeroexp ZeRO-1", 1, _OS, "always", "buckets", scatter_gather, precisions=_MIXED,
                         casts_buffers=True, source="zeroexp.strategies.sharding", peak_flow="in_place",
                         init_kind="replica"),
    "zero2": StateLayout("zeroexp ZeRO-2", 2, _OS_G, "always", "buckets", scatter_gather_each_micro_batch,
                         precisions=_MIXED,
                         casts_buffers=True, source="zeroexp.strategies.sharding", peak_flow="bucket",
                         init_kind="replica"),
    "fsdp_grad_op": StateLayout("FSDP SHARD_GRAD_OP", 2, _OS_G_P, "never", "units",
                                gather_units(kept_under_no_sync=True), "all",
                                fp32_at_rest=True, precisions=_MIXED, casts_buffers=True,
                                source="zeroexp.strategies.fsdp; [FSDP]", peak_flow="fsdp1",
                                no_sync_accumulation=True, init_kind="fsdp1", min_world_size=2),
    "fsdp2_grad_op": StateLayout("FSDP2 reshard_after_forward=False", 2, _OS_G_P, "never", "rows",
                                 gather_units(dtensor_grads=True), "all", fp32_at_rest=True, padded_moments=False,
                                 precisions=_MIXED, offloads=_OFF_FSDP2, unit_hooks="fsdp2",
                                 source="zeroexp.strategies.fsdp2; [FSDP2]", peak_flow="fsdp2", init_kind="fsdp2",
                                 min_world_size=2),
    "fsdp_full": StateLayout("FSDP FULL_SHARD", 3, _OS_G_P, "never", "units", gather_units(), "largest",
                             fp32_at_rest=True, precisions=_MIXED, gathers_per_unit=_twice_unless_root,
                             casts_buffers=True, source="zeroexp.strategies.fsdp; [FSDP]", peak_flow="fsdp1",
                             reshard_after_forward=True, init_kind="fsdp1", min_world_size=2),
    "fsdp2_full": StateLayout("FSDP2 reshard_after_forward=True", 3, _OS_G_P, "never", "rows",
                              gather_units(dtensor_grads=True), "largest", fp32_at_rest=True, padded_moments=False,
                              precisions=_MIXED, offloads=_OFF_FSDP2, gathers_per_unit=_twice, unit_hooks="fsdp2",
                              post_forward_group=True, source="zeroexp.strategies.fsdp2; [FSDP2]", peak_flow="fsdp2",
                              reshard_after_forward=True, init_kind="fsdp2", min_world_size=2),
    # hybrid sharding: FULL_SHARD (SHARD_GRAD_OP for _HYBRID_SHARD_ZERO2) within shard_size ranks, replicated across
    "fsdp__HYBRID_SHARD_ZERO2": StateLayout("FSDP _HYBRID_SHARD_ZERO2", 2, _OS_G_P, "never", "units",
                                            hybrid_units(kept_under_no_sync=True),
                                            "all", fp32_at_rest=True, precisions=_MIXED, hybrid=True,
                                            casts_buffers=True, peak_flow="fsdp1",
                                            source="zeroexp.strategies.fsdp_hybrid; [FSDP]; zeroexp.formulas.hybrid",
                                            min_world_size=2),
    "fsdp_HYBRID_SHARD": StateLayout("FSDP HYBRID_SHARD", 3, _OS_G_P, "never", "units", hybrid_units(), "largest",
                                     fp32_at_rest=True, precisions=_MIXED, gathers_per_unit=_twice_unless_root,
                                     hybrid=True,
                                     casts_buffers=True, peak_flow="fsdp1", reshard_after_forward=True,
                                     source="zeroexp.strategies.fsdp_hybrid; [FSDP]; zeroexp.formulas.hybrid",
                                     min_world_size=2),
    "fsdp2_hybrid": StateLayout("FSDP2 HSDP reshard_after_forward=True", 3, _OS_G_P, "never", "rows",
                                hybrid_units(dtensor_grads=True), "largest", fp32_at_rest=True, padded_moments=False,
                                precisions=_MIXED, offloads=_OFF_FSDP2, gathers_per_unit=_twice_always,
                                unit_hooks="fsdp2", hybrid=True,
                                source="zeroexp.strategies.fsdp2_hybrid; [FSDP2]; zeroexp.formulas.hybrid",
                                peak_flow="fsdp2", reshard_after_forward=True, min_world_size=2),
    **{f"deepspeed_stage{row.deepspeed_stage}": row for row in DEEPSPEED_ROWS},
}

#: What a name no row has resolves to: a row of no model (every field the peak model reads at its default).
_NO_ROW = StateLayout("no such row", 0, frozenset(), "never", "none", all_reduce_buckets)


def row_of(name: str) -> StateLayout:
    """The row ``name`` names (``strategy.layout``): what the planner reads of a strategy, in place of its name; for
    a name no row has, a row of no model (``peak_flow`` None)."""
    return LAYOUTS.get(name, _NO_ROW)


def rows_where(predicate) -> list[str]:
    """The names of the rows for which ``predicate(row)`` holds, in ``LAYOUTS`` order."""
    return [name for name, row in LAYOUTS.items() if predicate(row)]
