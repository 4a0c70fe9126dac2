"""The layout arithmetic: a strategy's *groups* -> the bytes each rank keeps and the collectives it issues per step.

One model serves every check. A :class:`Groups` is plain data: the buffers a strategy shards (FSDP FlatParameters,
FSDP2 parameters, zeroexp's buckets, DeepSpeed's flat groups or partitioned parameters), the units FSDP gathers, the
gradient buckets DDP or DeepSpeed reduce, ZeroRedundancyOptimizer's owners. A strategy adapter reads them off its live
structure (``StrategyAdapter.groups``); the planner derives them from the model's shapes on the meta device
(:func:`derive_groups`); :func:`rank_state_bytes`, :func:`step_collectives` and :func:`state_factors` turn either
into numbers, and a test checks that the two kinds of groups are equal. A :class:`StateLayout` row (named by each
strategy's YAML, ``strategy.layout``) holds what the groups do not: which kinds are sharded, the dtypes, the payload
model.
"""

from __future__ import annotations

import functools

import heapq
import itertools

from zeroexp.formulas.paper import (COMPUTE_ITEMSIZE, Collectives, padded_numel)
from zeroexp.formulas.shapes import Cut, Groups, ModelShape, PlanKnobs, Shard, Unit, next_reached
from zeroexp.formulas.orig_params import views_per_rank

from zeroexp.formulas.families.base import StateLayout

__all__ = ["STATE_KINDS", "ModelShape", "PlanKnobs", "Shard", "Unit", "next_reached", "Groups", "Cut",
           "StateLayout", "cut_buckets", "pack", "owner_assignment", "derive_groups", "rank_state_bytes",
           "step_collectives", "state_factors", "unsharded_floor_bytes", "offloaded_kinds", "local_numels",
           "local_numels_by_rank",
           "MOMENT_BYTES", "MASTER_BYTES", "STEP_BYTES"]

#: The model-state kinds the planner predicts, named as the state probe names them.
STATE_KINDS = ("param", "grad", "optim", "master")
#: Bytes per element: Adam's fp32 exp_avg + exp_avg_sq; the fp32 master; Adam's ``step`` scalar per tensor.
MOMENT_BYTES, MASTER_BYTES, STEP_BYTES = 8, 4, 4


# --- cutting: the one bucket cutter, packing, owners ----------------------------------------------------------
def cut_buckets(sizes: list[int] | tuple[int, ...], cap: int, rule: str = "fit") -> list[list[int]]:
    """Indices of ``sizes`` cut, in order, into buckets of about ``cap`` (an item is never split).

    ``fit``: a new bucket before an item that would take the bucket past the cap (an item above the cap is a bucket
    alone): zeroexp.strategies.sharding's buckets, DeepSpeed's ``ipg`` buckets. ``reach``: a bucket closes as soon as
    it holds
    ``cap`` or more (DDP's ``compute_bucket_assignment_by_size``). ``exceed``: closes once it holds more than ``cap``
    (DeepSpeed's ``allreduce_no_retain``).
    """
    buckets: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if rule == "fit" and buckets[-1] and total + size > cap:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += size
        if (rule == "reach" and total >= cap) or (rule == "exceed" and total > cap):
            buckets.append([])
            total = 0
    return [b for b in buckets if b]


def pack(numels: list[int] | tuple[int, ...], align: int = 0) -> tuple[tuple[tuple[int, int], ...], int]:
    """Element ranges of ``numels`` laid out in one buffer, each starting at a multiple of ``align`` (0: packed),
    and the buffer's length before world-size padding [FSDP]."""
    spans, end = [], 0
    for n in numels:
        end += (align - end % align) % align if align else 0
        spans.append((end, end + n))
        end += n
    return tuple(spans), end


def owner_assignment(numels: list[int] | tuple[int, ...], world_size: int) -> list[list[int]]:
    """Indices of the parameters each rank owns under ZeroRedundancyOptimizer, in assignment order: largest first
    (a stable sort), each to the rank owning the fewest elements so far, the lowest rank on ties
    (``_partition_parameters``, torch/distributed/optim/zero_redundancy_optimizer.py)."""
    return [list(o) for o in owner_tuples(tuple(numels), int(world_size))]


@functools.lru_cache(maxsize=64)
def owner_tuples(numels: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], ...]:
    """:func:`owner_assignment`, immutable, remembered for the ranks that each ask their own (a 512-rank row's)."""
    heap, owned = [(0, r) for r in range(world_size)], [[] for _ in range(world_size)]
    for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
        size, rank = heapq.heappop(heap)
        owned[rank].append(i)
        heapq.heappush(heap, (size + numels[i], rank))
    return tuple(tuple(o) for o in owned)


# --- the planner's groups, from shapes ------------------------------------------------------------------------
def derive_groups(name: str, layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
                  knobs: PlanKnobs = PlanKnobs()) -> Groups:
    """The groups ``layout`` makes of a model of ``shape`` at N = ``world_size``: what the adapter of the strategy
    would read off its live structure (equal, element for element, where the shapes are exact).

    Frozen parameters (``shape.trains``): FSDP and FSDP2 (``units``, ``rows``) and DeepSpeed stage 3 (``params``,
    which partitions every module parameter) shard them with the rest, their gradients and optimizer state only over
    the trainable ones (``grad_shards``), a unit reduce-scattering only what trains and gathering again for backward
    only where backward reaches it; every other layout is given the trainable parameters alone (as a user passes
    them to the optimizer) and holds the frozen ones as they are. ``layout.comm`` gets the shape the shards are cut
    from."""
    hybrid = layout.hybrid and 0 < knobs.shard_size < world_size
    n, family = knobs.shard_size if hybrid else world_size, layout.family  # n: ranks sharded over
    narrow = knobs.post_forward_over(n) if layout.post_forward_group else 0  # FSDP2's reshard_after_forward=k
    full, shape = shape, shape if family.cuts_frozen(layout) else shape.trainable()
    numels = shape.numels
    if not shape.exact:  # a count: one flat buffer, one unit
        cut = Cut([Shard(((0, shape.numel),), padded_numel(shape.numel, layout.pad * n))],
                  units=[family.unit(padded_numel(shape.numel, n), layout.gathers_per_unit(False, knobs),
                                     narrow=bool(narrow))])
    else:
        cut = family.cut(layout, shape, n, knobs, itemsize, narrow)
    extra = layout.comm(shape, n, knobs) if layout.comm is not None else {}
    trained = tuple(numels[i] for i in range(len(numels)) if shape.train(i))
    extra = {**extra, **family.extra_groups(layout, shape, full, cut)}
    return Groups(name, world_size, trained if shape.exact else (shape.numel,), tuple(cut.shards), tuple(cut.units),
                  owners=tuple(cut.owners), exact=shape.exact, shard_size=n if hybrid else 0,
                  frozen=full.frozen if shape.exact else (),
                  buffers=_held_buffers(layout, full.buffers, knobs.compute_dtype), post_forward_size=narrow,
                  **extra)


def _held_buffers(layout: StateLayout, buffers: tuple[tuple[str, int], ...], dtype: str
                  ) -> tuple[tuple[str, int], ...]:
    """The module's buffers as the row holds them: floating ones in the compute dtype where it casts them
    (``casts_buffers``: zeroexp's ZeRO, FSDP1's MixedPrecision ``buffer_dtype``, DeepSpeed's low-precision engine)."""
    if not layout.casts_buffers or dtype == "float32":
        return buffers
    size = {**COMPUTE_ITEMSIZE, "float64": 8}  # the floating dtypes a cast reaches
    return tuple((dtype, b * size[dtype] // size[d]) if d in size else (d, b) for d, b in buffers)


# --- groups -> bytes per rank ---------------------------------------------------------------------------------
def _spread(shards: tuple[Shard, ...], world_size: int) -> tuple[list[int], list[int]]:
    """Per rank: elements of real parameters in its shards (logical) and the shards' length (physical)."""
    logical, step = [0] * (world_size + 1), [0] * (world_size + 1)  # step: a difference array of whole shards
    physical = 0
    for spans, padded in shards:
        shard = padded // world_size
        physical += shard
        for a, b in spans:
            if b <= a:  # a parameter of no elements holds none anywhere
                continue
            first, last = a // shard, (b - 1) // shard
            if first == last:
                logical[first] += b - a
                continue
            logical[first] += (first + 1) * shard - a
            logical[last] += b - last * shard
            step[first + 1] += shard
            step[last] -= shard
    whole = itertools.accumulate(step[:world_size])  # the whole shards each rank holds of the spans it is inside
    return [part + run for part, run in zip(logical, whole)], [physical] * world_size


@functools.lru_cache(maxsize=64)
def local_numels_by_rank(shards: tuple[Shard, ...], world_size: int) -> tuple[tuple[int, ...], ...]:
    """:func:`local_numels` of every rank at once (``world_size`` ranks a shard is cut over): each span against every
    rank's chunk in one array operation, not the difference arrays of each rank (a 512-rank plan's rows ask it of
    every rank); remembered for the rows and kinds that ask it again."""
    import numpy as np

    out = np.zeros((world_size, len(shards)), dtype=np.int64)
    starts = np.arange(world_size, dtype=np.int64)
    for j, (spans, padded) in enumerate(shards):
        chunk = padded // world_size
        for a, b in spans:
            out[:, j] += np.clip(np.minimum(b, (starts + 1) * chunk) - np.maximum(a, starts * chunk), 0, None)
    return tuple(tuple(int(v) for v in row) for row in out.tolist())


def local_numels(shards: tuple[Shard, ...], world_size: int, rank: int) -> tuple[int, ...]:
    """The elements of real parameters in rank ``rank``'s chunk of each of ``shards`` (the last ranks of an uneven
    FSDP2 parameter hold fewer rows, or none): the tensors that rank's optimizer steps. Hybrid sharding: rank r holds
    shard r % shard_size, so pass that."""
    return local_numels_by_rank(tuple(shards), world_size)[rank]


def _held_grads(shards: tuple[Shard, ...], world_size: int, ungraded: tuple[int, ...] = ()) -> list[int]:
    """Per rank, the elements of DeepSpeed ZeRO-1/2's gradient partition as stored [DS]: the full gradient of every
    parameter the rank's partition overlaps (``params_in_partition``: ``grads_in_partition``, made when the first of
    them with a gradient is reduced, none without one), plus the partition's padding as zeros; a parameter the step
    gave no gradient (``ungraded``: indices of the shards' spans in order) held again as a zeros tensor of its size
    (stage_1_and_2.py ``get_all_grad_tensors``)."""
    held = [0] * (world_size + 1)  # a difference array over ranks
    pads, zeros, graded = [0] * world_size, [0] * world_size, [False] * world_size
    idle, i = set(ungraded), 0
    for spans, padded in shards:
        shard = padded // world_size
        end = max((b for _, b in spans), default=0)
        for a, b in spans:
            if b > a:
                held[a // shard] += b - a
                held[(b - 1) // shard + 1] -= b - a
                for r in range(a // shard, (b - 1) // shard + 1):
                    if i in idle:
                        zeros[r] += b - a
                    else:
                        graded[r] = True
            i += 1
        for r in range(end // shard, world_size):
            pads[r] += min((r + 1) * shard, padded) - max(r * shard, end)
    out, run = [], 0
    for r in range(world_size):
        run += held[r]
        out.append((run if graded[r] else 0) + zeros[r] + pads[r])
    return out


def rank_state_bytes(layout: StateLayout, groups: Groups, itemsize: int, knobs: PlanKnobs = PlanKnobs(),
                     offload: str = "none") -> dict[str, list[tuple[int, int]]]:
    """Per kind, per rank: (logical, physical) bytes of model state at the optimizer boundary [ZeRO 5.1].

    ``param`` and ``grad`` in the compute dtype (``itemsize``; fp32 for ``fp32_at_rest``), ``optim`` Adam's two fp32
    moments, ``master`` the fp32 copy; each replicated or sharded as the layout says over ``groups``' shards (or its
    owners), physical with the padding. ``optim_scalar``: Adam's 4-byte ``step`` per optimizer tensor where the
    groups fix their number (a ``flat_optimizer`` layout: one per flat partition, ``layout.sub_groups``).
    """
    n, psi, s = groups.world_size, groups.numel, layout.sharded
    frozen = sum(groups.frozen)
    if groups.owners or (not groups.shards and groups.exact):
        owned = groups.owners or (groups.numels,) * n
        idle = _ungraded_per_rank(groups, n)  # no gradient, no optimizer state
        p_logical = p_physical = [sum(o) for o in owned]
        logical = physical = [sum(o) - i for o, (i, _) in zip(owned, idle)]
        full, tensors = psi, [len(o) - k for o, (_, k) in zip(owned, idle)]
        unused = sum(groups.numels[i] for i in groups.ungraded)  # a replicated kind: every rank's
    else:
        s_over = groups.shard_over  # hybrid: rank r holds shard r % shard_size (mesh (replicate, shard))
        trained = groups.trained_shards
        p_logical, p_physical = (x * (n // s_over) for x in _spread(groups.shards, s_over))
        logical, physical = (x * (n // s_over) for x in _spread(trained, s_over))
        unused = 0
        full = sum(sh.numel for sh in groups.shards) if layout.family.pads_count(layout) else psi
        tensors = [len(trained)] * n if groups.exact and layout.family.steps_per_shard else None

    def kind(sharded: bool, nbytes: int, param: bool = False) -> list[tuple[int, int]]:
        lo_, ph_ = (p_logical, p_physical) if param else (logical, physical)
        if sharded:
            return [(lo * nbytes, ph * nbytes) for lo, ph in zip(lo_, ph_)]
        if param:  # frozen parameters held beside the trained ones (a row that shards them shards "param")
            return [((psi + frozen) * nbytes, (full + frozen) * nbytes)] * n
        held = 0 if param else unused  # a parameter without gradient has no gradient or moments to replicate
        return [((psi - held) * nbytes, (full - held) * nbytes)] * n

    rest = 4 if layout.fp32_at_rest else itemsize
    out = {"param": kind("param" in s, rest, param=True), "grad": kind("grad" in s, rest),
           "optim": kind("optim" in s, MOMENT_BYTES)}
    offloaded = offload != "none" and layout.offload_grad != "none"
    if layout.whole_grads and "grad" in s and groups.exact and not offloaded:
        out["grad"] = [(lo, g * rest) for (lo, _), g in zip(out["grad"],
                                                             _held_grads(groups.shards, n, groups.ungraded))]
    if offloaded:  # the fp32 gradient partition on the host [DS]
        fp32 = kind("grad" in s, MASTER_BYTES)
        out["grad"] = fp32 if layout.offload_grad == "replace" else \
            [(a + c, b + d) for (a, b), (c, d) in zip(out["grad"], fp32)]
    if layout.master == "always" or (layout.master == "mixed" and itemsize != 4):
        out["master"] = kind("optim" in s, MASTER_BYTES)
    if knobs.use_orig_params and layout.family.views_with_orig_params:  # moments and steps per unpadded view [FSDP]
        out["optim"] = [(lo, lo) for lo, _ in out["optim"]]
        tensors = views_per_rank(groups) if groups.exact else None
    if not (layout.padded_moments or knobs.state_loaded_whole):
        out["optim"] = [(lo, lo) for lo, _ in out["optim"]]
    if layout.flat_optimizer and groups.exact:  # one flat fp32 partition (per sub-group) per rank [DS]
        parts = [sh.numel // n for sh in groups.trained_shards]
        tensors = [layout.sub_groups(parts)] * n
    if tensors is not None:
        out["optim_scalar"] = [(STEP_BYTES * t, STEP_BYTES * t) for t in tensors]
    if groups.buffers:  # every rank holds the module's buffers whole, in their own dtype
        out["buffers"] = [(sum(b for _, b in groups.buffers),) * 2] * n
    kept = [(sum(b - a for a, b in sh.spans), u.numel) for sh, u in zip(groups.shards, groups.units) if u.kept]
    if kept and layout.family.holds_kept_units:  # FSDP1 units never resharded: their unsharded FlatParameter at rest
        out["param_unsharded"] = [(sum(lo for lo, _ in kept) * rest, sum(ph for _, ph in kept) * rest)] * n
    return out


def _ungraded_per_rank(groups: Groups, n: int) -> list[tuple[int, int]]:
    """Per rank: the elements and the count of its parameters that get no gradient (``groups.ungraded``): every
    rank's for replicated state, each owner's own under ZeroRedundancyOptimizer (``owner_assignment``'s owners)."""
    if not groups.ungraded:
        return [(0, 0)] * n
    k, idle = groups.numels, set(groups.ungraded)
    if not groups.owners:
        return [(sum(k[i] for i in idle), len(idle))] * n
    return [(sum(k[i] for i in o if i in idle), sum(1 for i in o if i in idle)) for o in owner_assignment(k, n)]


def state_factors(layout: StateLayout, world_size: int, itemsize: int, offload: str = "none",
                  shard_size: int = 0, trained: float = 1.0) -> dict[str, float]:
    """The aggregate factors (sum over ranks of a kind's logical bytes / P, P = 4 Psi) ``layout`` claims at the
    optimizer boundary, in closed form [ZeRO 5.1]: a replicated kind N x its bytes per element / 4, a sharded one
    1 x (N / ``shard_size`` x for a ``hybrid`` layout: one sharded copy per replica); two fp32 moments; a master as
    its ``master`` rule says; FSDP leaves no unsharded buffer (``param_unsharded`` 0). :func:`rank_state_bytes`
    gives the same sums, per rank and with padding. ``trained``: the fraction of the parameters that train
    (``requires_grad``); gradients, moments and the master are kept for those alone."""
    n, s = float(world_size), layout.sharded
    r = n / shard_size if layout.hybrid and shard_size else 1.0  # hybrid: one sharded copy per replica
    c = 1.0 if layout.fp32_at_rest else itemsize / 4
    out = {"param": r * c if "param" in s else n * c, "grad": r * c if "grad" in s else n * c,
           "optim": 2.0 * r if "optim" in s else 2.0 * n}
    if offload != "none" and layout.offload_grad != "none":
        out["grad"] = 1.0 if layout.offload_grad == "replace" else out["grad"] + 1.0
    if layout.master == "always" or (layout.master == "mixed" and itemsize != 4):
        out["master"] = r if "optim" in s else n
    for k in ("grad", "optim", "master"):
        if k in out:
            out[k] *= trained
    if layout.family.gathers_units:
        out["param_unsharded"] = 0.0
    return out


# --- groups -> collectives per step ---------------------------------------------------------------------------
def step_collectives(layout: StateLayout, groups: Groups, itemsize: int,
                     knobs: PlanKnobs = PlanKnobs()) -> Collectives:
    """One rank's per-step collectives under ``layout`` over ``groups``, in the compute dtype [ZeRO 7] (fp32 for a
    layout ``fp32_on_the_wire``): count and payload S per op."""
    return layout.payload(groups, 4 if layout.fp32_on_the_wire else itemsize, knobs)


def unsharded_floor_bytes(layout: StateLayout, groups: Groups, itemsize: int) -> int | None:
    """Unsharded parameter bytes a rank holds on top of its state while computing, a floor under the peak: the
    largest FSDP unit (FULL_SHARD gathers one at a time), every unit (SHARD_GRAD_OP keeps them to the end of
    backward), 0 for replicated parameters; None when the units are unknown (a count)."""
    if layout.gather == "none":
        return 0
    units = [u.numel * itemsize for u in groups.units]
    if layout.gather == "all":
        return sum(units)
    return max(units) if groups.exact else None


def offloaded_kinds(layout: StateLayout, offload: str) -> frozenset[str]:
    """The kinds kept in host memory [OFFLOAD]: ``optimizer``: master and moments, and the gradient partition when
    gradients are sharded (ZeRO-Offload); ``full``: every kind (ZeRO-Infinity); ``none``: none."""
    kinds = {"none": frozenset(), "optimizer": frozenset({"optim", "master"}) | (layout.sharded & {"grad"}),
             "full": frozenset(STATE_KINDS)}
    if offload not in kinds:
        raise ValueError(f"offload must be none, optimizer or full, got {offload!r}")
    return kinds[offload]
