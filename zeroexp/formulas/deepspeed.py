"""DeepSpeed's runtime model [DS], [DS-COMM]: its buckets, fetches and partitions as groups, its payload (its rows:
:mod:`zeroexp.formulas.families.deepspeed`).

[DS-COMM] DeepSpeed 0.19.8: runtime/engine.py (allreduce_gradients -> buffered_allreduce_fallback ->
allreduce_no_retain, MEMORY_OPT_ALLREDUCE_SIZE); runtime/zero/stage_1_and_2.py (reduce_independent_p_g_buckets_and_
remove_grads, average_tensor, get_grad_norm_direct, has_overflow, step -> all_gather_dp_groups); runtime/zero/stage3.py
(__avg_scatter_grads -> reduce_scatter_coalesced, _get_norm_groups, has_overflow); partitioned_param_coordinator.py
(fetch_sub_module: the module's parameters, then a prefetch of the traced ones up to prefetch_bucket_size).
"""

from __future__ import annotations

from typing import NamedTuple

from zeroexp.formulas.deepspeed_fetch import ModuleCall, Stage3Schedule, ds_stage3_schedule
from zeroexp.formulas.layout import Groups, ModelShape, PlanKnobs, cut_buckets
from zeroexp.formulas.paper import Collectives, collectives_of, padded_numel

__all__ = ["DS_MEMORY_OPT_ALLREDUCE_SIZE", "DS_SUB_GROUP_SIZE", "DS_PREFETCH_BUCKET_SIZE", "DS_NORM_BYTES",
           "DS_OFFLOAD_NORM_BYTES", "ds_norm_bytes",
           "DS_PERSISTENCE_THRESHOLD", "DS_PERSISTENCE_REFUSED", "Stage3Limits", "ds_stage3_limits", "knobs_limits",
           "ds_persistent", "deepspeed_reduce_bucket_numel", "deepspeed_stage3_gathers", "stage3_calls",
           "REPLAYED_RECOMPUTE", "stage3_recomputed", "stage3_schedule", "deepspeed_buckets", "ds_reduce_order",
           "ds_allreduce_calls", "deepspeed_sub_groups", "deepspeed_gathers",
           "deepspeed_payload_limits", "deepspeed_comm", "deepspeed_payload", "ipg_buffers"]

#: The ``activation_checkpointing`` modes whose recompute the stage-3 replay runs ([DS-RECOMPUTE]).
REPLAYED_RECOMPUTE = frozenset({"full", "selective_layer", "selective_op"})

#: engine.py MEMORY_OPT_ALLREDUCE_SIZE: the elements per all_reduce of ZeRO-0's buffered_allreduce_fallback.
DS_MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000
#: runtime/zero/config.py defaults (DeepSpeedZeroConfig, 0.19.8), in elements: stage 3's optimizer sub-group (zeroexp's
#: ds_config leaves it alone), its prefetch bucket, live parameters and reuse distance (``max_reuse_distance``,
#: alias ``stage3_max_reuse_distance``: ``strategy.stage3_*``'s defaults), its persistence threshold (1e5: zeroexp
#: sets 0 unless ``strategy.stage3_param_persistence_threshold`` says otherwise, so that every parameter is
#: partitioned, ZeRO-3 as the paper counts it).
DS_SUB_GROUP_SIZE = 1_000_000_000
DS_PREFETCH_BUCKET_SIZE = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
DS_MAX_REUSE_DISTANCE = 1_000_000_000
DS_PERSISTENCE_THRESHOLD = 100_000
#: zeroexp's persistence threshold when the cell sets none: every parameter partitioned.
ZEROEXP_PERSISTENCE_THRESHOLD = 0


class Stage3Limits(NamedTuple):
    """Stage 3's coordinator limits, in parameter elements (partitioned_param_coordinator.py): ``prefetch_bucket``
    (``stage3_prefetch_bucket_size``), ``max_live`` (``stage3_max_live_parameters``), ``persistence``
    (``stage3_param_persistence_threshold``: a parameter of at most that many elements is never released between its
    modules), ``max_reuse`` (``stage3_max_reuse_distance``: a module's parameters that a module within that many
    elements of the trace onward uses are not released, ``__params_to_release``)."""

    prefetch_bucket: int = DS_PREFETCH_BUCKET_SIZE
    max_live: int = DS_MAX_LIVE_PARAMETERS
    persistence: int = ZEROEXP_PERSISTENCE_THRESHOLD
    max_reuse: int = DS_MAX_REUSE_DISTANCE

    def ds_config(self) -> dict[str, int]:
        """The ``zero_optimization`` keys that set them."""
        return {"stage3_prefetch_bucket_size": self.prefetch_bucket, "stage3_max_live_parameters": self.max_live,
                "stage3_param_persistence_threshold": self.persistence, "stage3_max_reuse_distance": self.max_reuse}


def ds_stage3_limits(prefetch_bucket: int | None = None, max_live: int | None = None,
                     persistence: int | None = None, max_reuse: int | None = None) -> Stage3Limits:
    """The limits a cell's ``strategy.stage3_*`` keys (or the planner's knobs of the same values) set; None: the
    default (:class:`Stage3Limits`)."""
    d = Stage3Limits()
    return Stage3Limits(d.prefetch_bucket if prefetch_bucket is None else int(prefetch_bucket),
                        d.max_live if max_live is None else int(max_live),
                        d.persistence if persistence is None else int(persistence),
                        d.max_reuse if max_reuse is None else int(max_reuse))


#: Why a stage-3 cell with persistent parameters is refused (measured, DeepSpeed 0.19.8 on CPU / gloo, N=2, four
#: Linear(64, 64) under stage3_param_persistence_threshold=5000): each persistent parameter is gathered on its own (4
#: all_gathers where the coordinator's prefetch gathers 1) and stays unsharded through the step (65536 B of
#: param_unsharded at the optimizer boundary), which the state, collectives and peak models do not hold.
DS_PERSISTENCE_REFUSED = ("DeepSpeed keeps a parameter of at most stage3_param_persistence_threshold elements "
                          "unsharded through the step and gathers it on its own (measured: 4 all_gathers where 1 is "
                          "planned and 65536 B of unsharded parameters at the optimizer boundary on four Linear(64, "
                          "64) at N=2); zeroexp's state, collectives and peak models hold no persistent parameter")


def ds_persistent(numels: tuple[int, ...] | list[int], limits: Stage3Limits) -> tuple[int, ...]:
    """The parameters (indices) stage 3 keeps persistent: ``ds_numel`` at most the threshold
    (parameter_offload.py ``mark_persistent_parameters``; ``stage3_model_persistence_threshold`` left unbounded)."""
    return tuple(i for i, k in enumerate(numels) if k <= limits.persistence)


def knobs_limits(knobs: PlanKnobs) -> Stage3Limits:
    """:func:`ds_stage3_limits` of a cell's (or the planner's) knobs."""
    return ds_stage3_limits(knobs.ds_prefetch_bucket, knobs.ds_max_live, knobs.ds_persistence, knobs.ds_max_reuse)
#: Bytes of one gradient-norm scalar (all-reduced once per flat group or sub-group, then kept through the step):
#: stages 1-2 cast the squared norm to fp32 (stage_1_and_2.py ``get_grad_norm_direct``: ``.float()``), stage 3 keeps
#: ``get_norm_dtype()``'s float64 (stage3.py ``get_grad_norm_direct``).
DS_NORM_BYTES = {1: 4, 2: 4, 3: 8}
#: With the optimizer offloaded (``offload_optimizer``), every stage sums the parameters' host-side norms into one
#: fp32 scalar and all-reduces that (``complete_grad_norm_calculation_for_cpu_offload``: ``FloatTensor([total_norm])``,
#: stage_1_and_2.py and stage3.py).
DS_OFFLOAD_NORM_BYTES = 4


def ds_norm_bytes(stage: int, offload: str) -> int:
    """Bytes of the gradient-norm scalar stage ``stage`` all-reduces per flat group or sub-group under ``offload``
    (none, optimizer, full): :data:`DS_NORM_BYTES`, or :data:`DS_OFFLOAD_NORM_BYTES` with the optimizer offloaded."""
    return DS_NORM_BYTES[stage] if offload == "none" else DS_OFFLOAD_NORM_BYTES


def deepspeed_reduce_bucket_numel(bucket_cap_bytes: int) -> int:
    """DeepSpeed's ``reduce_bucket_size`` (and ``allgather_bucket_size``) for ``strategy.bucket_cap_mb`` MiB: that many
    bytes of 4-byte elements, rounded down to even (DeepSpeed asserts a multiple of its NCCL start alignment, 2)."""
    return bucket_cap_bytes // 4 // 2 * 2


def ipg_buffers(stage: int, knobs: PlanKnobs) -> int:
    """The ipg bucket's buffers of ``reduce_bucket_size`` elements stages 1-2 allocate at a backward's first gradient
    hook: at stage 2 two under ``overlap_comm`` (stage_1_and_2.py ``setup_buckets``, "double buffers": a bucket's
    reduction on the side stream reads one while the hooks fill the other), else one (stage 1 with it is refused:
    ``zeroexp.cell.strategy.check_ds_overlap_comm``; a planner's stage-1 row is planned without it). Stage 3's bucket
    is one, kept."""
    return 2 if knobs.overlap_comm and stage == 2 else 1


def deepspeed_buckets(stage: int, numels: list[int], bucket_numel: int) -> tuple[tuple[int, ...], ...]:
    """DeepSpeed's gradient reductions per step, each its gradients' numels, given them in reduce order (stage 0 and 1:
    parameter order; 2 and 3: backward order). Stage 0: chunks of more than ``DS_MEMORY_OPT_ALLREDUCE_SIZE``
    elements (``allreduce_no_retain``). Stages 1-3: the ``ipg`` buckets: before a gradient is added, a bucket it would
    take past ``bucket_numel`` is reduced (none when empty); a gradient larger than the bucket is a bucket alone, in its
    place: it flushes the bucket before it and the next gradient (or the epilogue) flushes it (stage_1_and_2.py
    ``reduce_independent_p_g_buckets_and_remove_grads``: ``bucket.elements + param.numel() > reduce_bucket_size``, the
    gradient kept in ``extra_large_param_to_reduce`` and counted in ``bucket.elements``; stage3.py
    ``reduce_independent_p_g_buckets_and_remove_grads``: the same test, ``and bucket.elements > 0``)."""
    numels = [k for k in numels if k]
    rule = "exceed" if stage == 0 else "fit"
    cap = DS_MEMORY_OPT_ALLREDUCE_SIZE if stage == 0 else bucket_numel
    return tuple(tuple(numels[i] for i in b) for b in cut_buckets(numels, cap, rule))


def ds_reduce_order(numels: tuple[int, ...] | list[int], ungraded: tuple[int, ...], stage: int,
                    hooks: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Stages 1-2, the trainable parameters (indices) in the order their gradients are reduced: parameter order at
    stage 1 (``reduce_gradients``), at stage 2 the order their hooks fire (``hooks``: ``Groups.reduce_order``, as
    :func:`deepspeed_comm` gives :func:`deepspeed_buckets` them; none given: backward as a stack's, its reverse);
    none a step gives no gradient, nor an empty one."""
    skipped = set(ungraded)
    nonzero = [i for i, k in enumerate(numels) if k and i not in skipped]
    if stage != 1 and hooks:
        return tuple(i for i in hooks if numels[i] and i not in skipped)
    return tuple(nonzero if stage == 1 else nonzero[::-1])


def ds_allreduce_calls(buckets: tuple[tuple[int, ...], ...], order: tuple[int, ...], numels: tuple[int, ...],
                       partition_numel: int, bucket_numel: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Stages 1-2, per bucket (reduce order; ``order``: its parameters' indices, ``numels`` in parameter order), its
    all_reduce calls, each the gradient slices it flattens (elements). ``average_tensor`` cuts the bucket into one
    slice per parameter and partition it overlaps, merging a slice into the previous one of the same partition;
    ``allreduce_and_scatter`` (``numel_per_bucket=self.reduce_bucket_size``) all-reduces the slices gathered so far as
    soon as they total more than ``reduce_bucket_size``, the rest at the end: one call for a bucket within the size,
    and for a gradient larger than it (a bucket alone, ``extra_large_param_to_reduce``) one call per run of its
    partition slices whose total passes the size, the slices left over one call more."""
    start, offset = {}, 0
    for i, n in enumerate(numels):
        start[i], offset = offset, offset + n
    out, pos = [], 0
    for b in buckets:
        slices: list[list[int]] = []  # [rank, elements]
        for p in order[pos:pos + len(b)]:
            lo, hi = start[p], start[p] + numels[p]
            for rank in range(lo // partition_numel, (hi - 1) // partition_numel + 1):
                inside = min(hi, (rank + 1) * partition_numel) - max(lo, rank * partition_numel)
                if slices and slices[-1][0] == rank:
                    slices[-1][1] += inside
                else:
                    slices.append([rank, inside])
        calls, small, total = [], [], 0
        for _, k in slices:
            small.append(k)
            total += k
            if total > bucket_numel:
                calls.append(tuple(small))
                small, total = [], 0
        out.append(tuple(calls + ([tuple(small)] if small else [])))
        pos += len(b)
    return tuple(out)


def deepspeed_gathers(numels: list[int], own: int = 0) -> tuple[tuple[int, ...], ...]:
    """Stage 3's parameter all_gathers of a step before its module calls are known (a live engine before its first
    step): the root module's own ``own`` first parameters with it, then one prefetch of the rest (within one prefetch
    bucket; :func:`deepspeed_stage3_gathers` replays the coordinator over a step's calls)."""
    return tuple(g for g in (tuple(numels[:own]), tuple(numels[own:])) if g)


def stage3_calls(shape: ModelShape, knobs: PlanKnobs | None = None) -> tuple[ModuleCall, ...]:
    """The module calls of a step of ``shape`` as the engine's hooks see them: the root (the LightningModule around
    the model, no parameters of its own) first, the model's traced calls inside it (untraced: each module holding
    parameters once, in definition order); under activation checkpointing (``knobs.recompute_mode``) each checkpointed
    wrap unit's outermost call (the one holding exactly the unit's parameters; ``selective_layer``: every
    ``knobs.recompute_every``-th unit in forward order) inside the call of its checkpoint wrapper (torch's
    ``CheckpointWrapper``: a module without parameters, module index below -1), whose hooks run outside the
    checkpoint."""
    calls = shape.module_calls or tuple(ModuleCall(k, m, True, True) for k, m in enumerate(shape.modules))
    calls = (ModuleCall(-1, (), False, True, 0), *(c._replace(depth=c.depth + 1) for c in calls))
    if knobs is None or knobs.recompute_mode not in REPLAYED_RECOMPUTE or not shape.module_calls:
        return calls
    ends = [next((j for j in range(k + 1, len(calls)) if calls[j].depth <= c.depth), len(calls))
            for k, c in enumerate(calls)]
    below = [{p for j in range(k, ends[k]) for p in calls[j].params} for k in range(len(calls))]
    first = {}  # the first call holding exactly these parameters
    for k, b in enumerate(below):
        first.setdefault(frozenset(b), k)
    roots = {first.get(frozenset(unit))
             for unit, root in zip(shape.units, shape.root, strict=True) if not root and unit}
    if None in roots:
        raise ValueError("a checkpointed unit is no module call's")
    if knobs.recompute_mode == "selective_layer":  # Checkpointing.checkpointed
        roots = {r for i, r in enumerate(sorted(roots)) if (i + 1) % knobs.recompute_every == 0}
    out: list[ModuleCall] = []
    for k, c in enumerate(calls):
        if k in roots:
            out.append(ModuleCall(-2 - k, (), c.grad_input, c.reached, c.depth))
        out.append(c._replace(depth=c.depth + sum(r <= k < ends[r] for r in roots)))
    return tuple(out)


def stage3_recomputed(shape: ModelShape, knobs: PlanKnobs) -> frozenset[int]:
    """The :func:`stage3_calls` of ``shape`` (under ``knobs``) whose forward backward runs again: each one a checkpoint
    wrapper's call makes."""
    calls = stage3_calls(shape, knobs)
    return frozenset(k + 1 for k, c in enumerate(calls) if c.module < -1)


def stage3_schedule(shape: ModelShape, knobs: PlanKnobs) -> Stage3Schedule:
    """The coordinator's schedule of a step of ``shape`` under the knobs' limits (``shape.module_calls`` traced)."""
    limits = knobs_limits(knobs)
    return ds_stage3_schedule(stage3_calls(shape, knobs), shape.numels, prefetch_bucket=limits.prefetch_bucket,
                              max_live=limits.max_live, persistence=limits.persistence, max_reuse=limits.max_reuse,
                              recomputed=stage3_recomputed(shape, knobs))


def deepspeed_stage3_gathers(calls: tuple[ModuleCall, ...], numels: tuple[int, ...], limits: Stage3Limits,
                             recomputed: frozenset[int] = frozenset()) -> tuple[tuple[int, ...], ...]:
    """Stage 3's parameter all_gathers per step (each its parameters' ``ds_numel``), DeepSpeed's coordinator replayed
    over the step's module ``calls`` (``numels``: every parameter's, frozen ones too;
    :func:`zeroexp.formulas.deepspeed_fetch.ds_stage3_schedule`) under ``limits``."""
    schedule = ds_stage3_schedule(calls, numels, prefetch_bucket=limits.prefetch_bucket, max_live=limits.max_live,
                                  persistence=limits.persistence, max_reuse=limits.max_reuse, recomputed=recomputed)
    return tuple(tuple(numels[p] for p in g) for g in schedule.gathers)


def deepspeed_sub_groups(partition_numels: list[int] | tuple[int, ...], sub_group_size: int = DS_SUB_GROUP_SIZE) -> int:
    """How many optimizer sub-groups ZeRO-3 cuts one parameter group into (stage3.py ``_create_fp16_sub_groups``):
    one when the partitions total at most ``sub_group_size`` elements, else a new one each time a running total of
    the parameters' partitions reaches it."""
    if sum(partition_numels) <= sub_group_size:
        return 1
    groups, size = 0, 0
    for i, k in enumerate(partition_numels):
        size += k
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups, size = groups + 1, 0
    return groups


def deepspeed_comm(stage: int, shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    """The buckets (and stage 3's fetches) DeepSpeed makes of a model of ``shape``, as zeroexp configures it: the
    buckets hold the trainable parameters' gradients; stage 3 fetches every parameter of a module forward calls,
    frozen ones too (``shape`` is the whole model's there, the trainable parameters' at stages 0-2).

    A trainable parameter a step gives no gradient (``shape.unused``): stage 0's engine fills a zero gradient before
    its all_reduce (engine.py ``_get_gradients_for_reduction``), so nothing differs; stages 1-3 reduce none for it (no
    gradient hook fires: stage_1_and_2.py ``reduce_gradients`` skips a None gradient, stage 2's and 3's hooks never
    run) and fill its gradient partition with zeros at the boundary (stage_1_and_2.py ``get_all_grad_tensors``:
    ``torch.zeros_like``; stage3.py: ``grad_partitions_flat_buffer``, zeroed once at init, is never written there):
    ``ungraded`` (indices among the trainable parameters). Stage 3 fetches a module's parameters in its pre-forward
    hook: those of a module forward never calls (``shape.uncalled``) are never gathered."""
    trained = shape.trainable()
    idle = set(trained.unused) if stage else set()
    # stages 0-1: parameter order; 2-3: the order the gradients' hooks fire, the traced backward's (3: its F.linear)
    ready = ds_stage3_hooks(trained.ready_order, trained.linear_pairs) if stage == 3 else trained.ready_order
    order = [i for i in (ready if stage in (2, 3) else range(len(trained.numels))) if i not in idle]
    numels = [trained.numels[i] for i in order]
    out = {"buckets": deepspeed_buckets(stage, numels, deepspeed_reduce_bucket_numel(knobs.bucket_cap_bytes))}
    if stage in (2, 3):
        out["reduce_order"] = tuple(i for i in order if trained.numels[i])
    if idle:
        out["ungraded"] = tuple(sorted(idle))
    if stage == 3:
        out["gathers"] = deepspeed_stage3_gathers(stage3_calls(shape, knobs), shape.numels, knobs_limits(knobs),
                                                  stage3_recomputed(shape, knobs))
    return out


def ds_stage3_hooks(ready: tuple[int, ...], linear_pairs: tuple[tuple[int, int], ...]) -> list[int]:
    """Stage 3's gradient hooks in the order they fire, from torch's (``ready``): stage 3 overrides ``F.linear`` with
    ``LinearFunctionForZeroStage3`` (partition_parameters.py ``_enable_mem_efficient_linear``), whose backward returns
    the input's, the weight's, then the bias's gradient, so each biased Linear's (``linear_pairs``) weight fires just
    before its bias where torch's own linear fires the bias first."""
    out = list(ready)
    for w, b in linear_pairs:
        if w in out and b in out and out.index(b) < out.index(w):
            out.remove(w)
            out.insert(out.index(b), w)
    return out


def deepspeed_payload(stage: int, g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
    """Per-step collectives of one rank of DeepSpeed ZeRO ``stage`` [DS-COMM], S per [NCCL-TESTS].
    Stage 0: an all_reduce per chunk (P); in fp32 with ``strategy.clip_grad_norm``, the engine's ``clip_fp32_gradients``
    (runtime/utils.py ``clip_grad_norm_``) all-reduces the one-element fp32 norm over the data-parallel group (below
    fp32 its FP16_UnfusedOptimizer computes the norm without a collective). Stages 1-2: an all_reduce per bucket
    (every rank's slice in one call; P; a gradient above the bucket one per run of its partition slices past it,
    :func:`ds_allreduce_calls`), one fp32
    all_reduce of the squared norm per flat group, with bf16 / fp16 a uint8 overflow all_reduce, then one all_gather
    per padded flat group (P). Stage 3: a reduce_scatter per bucket (each gradient padded to N; P), one
    fp64 norm all_reduce per optimizer sub-group, fp16 a uint8 overflow flag, one all_gather per fetch (P, frozen
    parameters included: stage 3 partitions and fetches them with their modules). ``offload`` (``knobs.offload``:
    optimizer, or stage 3's full) sends the same gradients and parameters (the reduced partition is copied to the
    host after its collective, the updated one back before the all_gather); only the norm differs, an fp32 scalar per
    group or sub-group (:func:`ds_norm_bytes`; measured: stages 1-3, fp32 and bf16, N=2 and 3).
    ``gradient_accumulation_steps`` K (measured, 0.19.8): stages 2 and 3 reduce every micro-batch's buckets and stage
    3 fetches every micro-batch's parameters (K x); stages 0 and 1 reduce once, at the boundary; the norm, overflow
    and stage 1-2 parameter all_gather come once per optimizer step. At one rank stages 1-2 gather nothing
    (runtime/utils.py ``all_gather_into_tensor_dp_groups``: ``dp_world_size == 1``, "no groups share optimizer
    states"; measured: no all_gather at N=1); stage 3 starts at two ranks (its row's ``min_world_size``)."""
    n = g.world_size
    each = knobs.micro_batches if stage in (2, 3) else 1
    if stage == 0:
        return collectives_of(all_reduce=[sum(b) * c for b in g.buckets] + ([4] if knobs.clipping and c == 4 else []))
    if stage in (1, 2):
        norms = [ds_norm_bytes(stage, knobs.offload)] * len(g.shards)
        calls = ds_allreduce_calls(g.buckets, ds_reduce_order(g.numels, g.ungraded, stage, g.reduce_order), g.numels,
                                   g.shards[0].numel // n, deepspeed_reduce_bucket_numel(knobs.bucket_cap_bytes))
        grads = [sum(call) * c for b in calls for call in b]
        return collectives_of(all_reduce=grads * each + norms + ([1] if c != 4 else []),
                              all_gather=[sh.numel * c for sh in g.shards] if n > 1 else [])
    norms = deepspeed_sub_groups([sh.numel // n for sh in g.trained_shards])
    norm = ds_norm_bytes(stage, knobs.offload)
    return collectives_of(reduce_scatter=[sum(padded_numel(k, n) for k in b) * c for b in g.buckets] * each,
                          all_reduce=[norm] * norms + ([1] if knobs.loss_scaling else []),
                          all_gather=[sum(padded_numel(k, n) for k in f) * c for f in g.gathers] * each)


def deepspeed_payload_limits(stage: int, groups: Groups, knobs: PlanKnobs, precision: str, offload: str) -> list[str]:
    """Why the payload model is not DeepSpeed's real per-step payload for a cell (empty: it is, as the collectives
    probe measures it on CPU / gloo)."""
    reasons = []
    if precision == "fp16":
        reasons.append("fp16: DeepSpeed's overflow and loss-scale collectives are read, not measured (fp16 needs a "
                       "GPU)")
    if not groups.exact:
        reasons.append("a parameter count: DeepSpeed's buckets need the parameters' shapes")
        return reasons
    fetched, gathered = groups.numel + sum(groups.frozen), sum(sum(g) for g in groups.gathers)
    if stage == 3 and knobs.recompute and groups.frozen:
        # measured: a LoRA GPT (n_layer=2, N=2 and 3, bf16), 9 all_gathers a step where the replay finds 1
        reasons.append("stage 3 with activation checkpointing and frozen parameters: the recompute in backward "
                       "gathers the frozen modules' parameters again and hands them to the module being "
                       "differentiated (update_recompute_parameters), not replayed (measured 9 all_gathers a step on "
                       "a LoRA GPT where 1 is planned)")
    elif stage == 3 and knobs.recompute and gathered > fetched and knobs.recompute_mode not in REPLAYED_RECOMPUTE:
        reasons.append("stage 3 with activation checkpointing of an unknown mode and a parameter released before "
                       "backward (beyond the reuse distance or live-parameter limit): the recompute's fetches are "
                       "replayed only where the mode is known")
    return reasons
