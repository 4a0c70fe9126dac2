"""A step's time from its groups: compute per phase, each collective placed where its strategy issues and waits for
it, one communication channel, and the device's overlap rule (:func:`~zeroexp.formulas.time.rates.overlap_possible`).

The collectives are the one model's (:func:`~zeroexp.formulas.step_collectives`: calls and payload per op); the
groups say where in the step each call is issued and by when it must be done. Compute is a timeline: forward F,
backward B, the optimizer O, spread over the parameters by their numel (a Linear's time scales with its numel
[KAPLAN]); the channel runs one collective at a time, in issue order. Where the device cannot overlap, every
collective's time adds to the step. The overlap rules, by what a row's groups hold (``StateLayout.groups``):

- ``none`` / ``owners`` (DDP, ZeroRedundancyOptimizer): a gradient bucket's all_reduce is issued when backward has
  filled it (gradient-ready order) and waited for before the optimizer, so all but the last overlap backward
  (torch/csrc/distributed/c10d/reducer.cpp); ZeroRedundancyOptimizer broadcasts each owner's parameters after its
  step (``_sync_params``), nothing left to overlap with.
- ``buckets`` (zeroexp's ZeRO-1/2, :mod:`zeroexp.strategies.sharding`): a bucket's reduce_scatter is issued by a
gradient hook
  when backward has filled it, waited for before the optimizer; its all_gather is issued after the step and waited
  for in the forward pre-hook of the bucket's first module (the step's start here, in steady state).
- ``units`` / ``rows`` (FSDP, FSDP2): a unit's all_gather is issued one unit ahead in forward (limit_all_gathers
  lets two be in flight) and waited for in its pre-forward hook; in backward a resharded unit is gathered again:
  ``pre`` issues the next unit's gather when the current unit's backward starts, ``post`` when it ends (before the
  current unit's reduce_scatter), ``none`` in the next unit's own pre-backward hook (after that reduce_scatter)
  (torch/distributed/fsdp/_runtime_utils.py, ``_prefetch_handle``); each unit's reduce_scatter is issued when its
  gradients are ready and waited for before the optimizer. FSDP2 prefetches as ``pre``; its explicit prefetch
  (``PlanKnobs.forward_prefetch`` / ``backward_prefetch``, k units) issues unit i's forward all_gather k units ahead
  and its backward one k units ahead of its own pre-backward hook (``_fsdp_state.py`` ``_pre_forward``,
  ``_pre_backward``: each unit's hook issues its targets' unshards).
- DeepSpeed stages 2-3 with ``overlap_comm`` on a GPU: each bucket's reduction issued when backward has filled it,
  waited for when the next bucket is reduced (stage 2) or the third after it (stage 3), the last at backward's end
  (``zeroexp.formulas.families.deepspeed``).
- any other row (DeepSpeed's without ``overlap_comm``, zeroexp's default, and on a CPU; the paper's): no rule, every
  collective is counted exposed.

A call issued after the rank computed for a while pays the calibration's waking (:class:`~zeroexp.formulas.time.rates.
WakeCurve`: the backend's idle threads woken and scheduled again) on top of its own time, and a call that follows
another pays at least what a call of a stream of sync calls pays beyond one alone (its floor: the peer's trailing
work of the call before, which a barrier hides; a calibration's ``stream_mean_s``): :func:`channel_step`.

Activation checkpointing (``activation_checkpointing=full``) adds one more forward of each checkpointed unit inside
its backward (torch.utils.checkpoint, non-reentrant: the unit's forward is rerun when backward first needs its saved
tensors): :func:`recompute_seconds`. Gradient accumulation (``grad_accum=K``) runs K micro-batches of forward and
backward before one optimizer step; each op's calls are spread over the micro-batches that issue it, read from the
one model's counts at K and at 1 (``repeats``: an op the strategy sends every micro-batch is K x its count at K=1,
one it sends once is not): a repeated op is placed in every micro-batch as in one step, one sent once in the last
micro-batch (a gradient reduction at the boundary, a broadcast after the step) or, an all_gather, in the first
(FSDP's SHARD_GRAD_OP keeps its units gathered to the end of the step; zeroexp's ZeRO gathers after the step, waited
for in the next forward).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, NamedTuple

from zeroexp.formulas.time.framework import FrameworkCost, framework_time
from zeroexp.formulas.layout import (STEP_BYTES, Groups, PlanKnobs, StateLayout, rank_state_bytes,
                                     step_collectives)
from zeroexp.formulas.paper import Collectives
from zeroexp.formulas.peak.checkpointing import Checkpointing, mode_of
from zeroexp.formulas.time.rates import ComputeRate

__all__ = ["Slot", "StepTime", "collective_slots", "simulate_step", "channel_step", "predict_step",
           "optimizer_elements", "optimizer_tensors", "recompute_seconds", "checkpointed_numel", "micro_batch_slots",
           "accumulation_repeats", "compute_seconds", "step_floor"]

#: (op, payload bytes S, calls) -> seconds: a calibration's fit, or a network preset's two-level ring.
CollectiveTime = Callable[[str, float, float], float]
#: (mesh dimension, group size) -> the :data:`CollectiveTime` of a call over that process group (hybrid sharding's
#: shard and replicate groups: a node's ranks, or one rank a node across the nodes).
GroupTime = Callable[[str, int], CollectiveTime]


class Slot(NamedTuple):
    """One collective call in the step: issued when compute reaches ``issue_s``, must be done before compute passes
    ``need_s`` (seconds of compute time); ``order`` breaks ties among calls issued at the same point."""

    op: str
    weight: float  # its share of the op's payload (elements)
    issue_s: float
    need_s: float
    order: int = 0
    burst: bool = False  # issued async together with the op's other burst slots (timed by the burst's per-call cost)
    group: str = ""  # the process group it runs over where the op's calls differ by group (FSDP2's post_forward)


@dataclass(frozen=True)
class StepTime:
    """A predicted step: its time, the communication not hidden behind compute, each phase's compute, the
    framework's own work (:mod:`zeroexp.formulas.time.framework`, by term) (seconds)."""

    step_s: float
    exposed_comm_s: float
    comm_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    rule: str
    recompute_s: float = 0.0  # activation checkpointing: the checkpointed units' forward again, inside backward
    micro_batches: int = 1  # forward_s, backward_s, recompute_s and framework_s are over all of them
    framework_s: float = 0.0
    framework_terms: tuple = ()  # (name, seconds) for one micro-batch's forward and backward and the step's optimizer
    framework_notes: tuple = ()
    # the calls' waking after idle gaps (:class:`~zeroexp.formulas.time.rates.WakeCurve`), in exposed_comm
    wake_s: float = 0.0

    def by_phase_ms(self) -> dict[str, float]:
        return {k: 1e3 * getattr(self, f"{k}_s") for k in ("forward", "backward", "recompute", "optimizer", "framework",
                                                             "comm", "wake", "exposed_comm")}


def checkpointed_numel(units: tuple[tuple[int, ...], ...], root: tuple[bool, ...], numels: tuple[int, ...],
                       mode: Checkpointing | bool = True, share: float = 1.0) -> int:
    """The parameters whose forward a step recomputes: those inside the wrap units ``mode`` checkpoints (True:
    every one, ``full``; ``selective_layer``: every k-th in order; the root unit's own parameters are never
    checkpointed), times ``share``, the part of their forward the recompute reruns (``selective_op``'s policy
    saves some ops' outputs: ``zeroexp.plan.flops.recompute_share``, counted FLOPs; 1 otherwise): a ``ModelShape``'s
    ``units``, ``root`` and ``numels``."""
    mode = mode_of(mode)
    wrapped = [members for members, is_root in zip(units, root) if not is_root]
    inside = sum(numels[i] for k, members in enumerate(wrapped) if mode.checkpointed(k) for i in members)
    return round(inside * share)


def recompute_seconds(forward_s: float, checkpointed: int, numel: int) -> float:
    """The recompute of activation checkpointing: the forward of the checkpointed units once more in backward, its
    time the forward's share of their parameters (compute scales with numel [KAPLAN])."""
    return forward_s * checkpointed / numel if numel else 0.0


def accumulation_repeats(layout: StateLayout, groups: Groups, itemsize: int, knobs: PlanKnobs,
                         at_k: Collectives | None = None) -> dict[str, float]:
    """Per op, how many times more calls a step of ``knobs.micro_batches`` micro-batches sends than a step of one:
    the one model's counts (:func:`~zeroexp.formulas.step_collectives`) at K over those at 1; ``at_k``: those at K
    where the caller has them."""
    from dataclasses import replace

    at_k = at_k if at_k is not None else step_collectives(layout, groups, itemsize, knobs)
    at_1 = at_k if knobs.micro_batches == 1 else step_collectives(layout, groups, itemsize,
                                                                  replace(knobs, micro_batches=1))
    return {op: e["count"] / at_1[op]["count"] for op, e in at_k.items() if at_1.get(op, {}).get("count")}


def micro_batch_slots(slots: list[Slot], repeats: dict[str, float], micro_batches: int, micro_s: float) -> list[Slot]:
    """One step's ``slots`` (on one micro-batch's timeline, the optimizer after it) laid over ``micro_batches``
    micro-batches of ``micro_s`` seconds each, the optimizer after the last: an op with ``repeats[op]`` > 1 is
    placed in every micro-batch, one sent once in the first (all_gather) or the last (every other op)."""
    if micro_batches < 2:
        return slots
    out = []
    for s in slots:
        if repeats.get(s.op, 1.0) > 1:
            at = range(micro_batches)
        else:
            at = (0,) if s.op == "all_gather" else (micro_batches - 1,)
        op, weight, issue, need, order, burst, group = s  # a Slot built whole: _replace's keyword path costs more
        out += [Slot(op, weight, issue + j * micro_s, need + j * micro_s, order, burst, group) for j in at]
    return out


def optimizer_elements(layout: StateLayout, groups: Groups) -> int:
    """Elements AdamW updates on the busiest rank: the rank's owned parameters (ZeroRedundancyOptimizer), a 1/N
    shard of every sharded buffer where the optimizer state is sharded, else every parameter."""
    if groups.owners:
        return max(sum(o) for o in groups.owners)
    if "optim" in layout.sharded and groups.shards:
        return sum(sh.numel // groups.world_size for sh in groups.shards)
    return groups.numel


def optimizer_tensors(layout: StateLayout, groups: Groups, knobs: PlanKnobs = PlanKnobs()) -> int:
    """The parameter tensors AdamW steps on the busiest rank: where the groups fix their number, its step scalars
    (:func:`~zeroexp.formulas.layout.rank_state_bytes`' ``optim_scalar``: owned parameters, a unit's flat shard or
    its original parameters' views, a row's, a flat partition per sub-group); else every trained parameter."""
    scalars = rank_state_bytes(layout, groups, 4, knobs).get("optim_scalar")
    if scalars:
        return max(lo for lo, _ in scalars) // STEP_BYTES
    return len(groups.numels) - len(groups.ungraded)


def cumulative(sizes: list[int]) -> list[int]:
    """The running sums of ``sizes``, from 0."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def collective_slots(layout: StateLayout, groups: Groups, prefetch: str, f: float, b: float,
                     o: float, knobs: PlanKnobs = PlanKnobs()) -> tuple[list[Slot], str]:
    """Where each collective of the step is issued and waited for (the rules of the module docstring), on a compute
    timeline of forward ``f``, backward ``b`` and optimizer ``o`` seconds; and the rule's name. ``knobs``: the
    strategy's settings that move calls (FSDP2's explicit forward and backward prefetch, units ahead, 0 its default;
    DeepSpeed's ``overlap_comm``)."""
    return layout.family.collective_slots(layout, groups, prefetch, f, b, o, knobs)


def simulate_step(compute_s: float, calls: list[tuple[float, ...]], overlap: bool,
                  wake: Callable[[float], float] | None = None) -> float:
    """Wall time of a step of ``compute_s`` seconds of compute with ``calls`` (issue_s, need_s, order, seconds[,
    floor_s]) on one channel in issue order; compute stalls at a call's ``need_s`` until it is done. Without overlap
    every call's time adds to the step. ``wake``: a call's extra seconds after the channel sat idle
    (:class:`WakeCurve`); ``floor_s``: the least extra of a call that follows another (a stream's figure less the
    call's alone, :func:`predict_step`), 0 when absent."""
    return channel_step(compute_s, calls, overlap, wake)[0]


def channel_step(compute_s: float, calls: list[tuple[float, ...]], overlap: bool,
                 wake: Callable[[float], float] | None = None) -> tuple[float, float]:
    """:func:`simulate_step`'s wall time and the seconds of it the calls spent waking (each call's extra beyond
    its time alone: ``wake`` of its idle gap, at least its ``floor_s``). The gap before a call: without overlap the
    compute since the previous call was issued (compute stops while a call runs); with overlap the wall time the
    channel sat idle. The step repeats, so the first call's gap runs from the previous step's last call: its issue
    point (no overlap) or its end (overlap), less the step, plus this call's start."""
    order = [i for _, _, i in sorted((c[0], c[2], i) for i, c in enumerate(calls))]
    floors = [float(c[4]) if len(c) > 4 else 0.0 for c in calls]

    def extra_of(i: int, gap: float) -> float:  # a call's waking after its gap, or its stream floor if larger
        return max(wake(gap), floors[i]) if wake is not None else max(0.0, floors[i])
    if not overlap:
        issues = [calls[i][0] for i in order]
        gaps = [issues[0] + compute_s - issues[-1]] + [b - a for a, b in zip(issues, issues[1:])] if issues else []
        woken = sum(extra_of(i, g) for i, g in zip(order, gaps))
        return compute_s + sum(c[3] for c in calls) + woken, woken
    points = sorted({0.0, compute_s, *(c[0] for c in calls), *(c[1] for c in calls)})

    def run(first_extra: float) -> tuple[float, float, float, float]:
        """(step, woken, the first call's start, the last call's end) with the first call's extra given."""
        done: dict[int, float] = {}
        waiting: list[tuple[float, int]] = []  # issued calls not yet waited for, by the point that needs them
        woken = wall = pos = channel = first_start = 0.0
        k = 0

        def wait(q: float, wall: float) -> float:
            """The wall clock after waiting for every issued call needed by ``q`` (``wall`` only grows, so a call
            waited for once never moves it again: each is folded in once, not rescanned at every point)."""
            while waiting and waiting[0][0] <= q:
                wall = max(wall, done[heapq.heappop(waiting)[1]])
            return wall
        for q in points:
            wall += q - pos
            pos = q
            if waiting and waiting[0][0] <= q:
                wall = wait(q, wall)
            while k < len(order) and calls[order[k]][0] <= q:
                i = order[k]
                begin = max(wall, channel)
                extra = extra_of(i, begin - channel) if k else first_extra
                first_start = begin if not k else first_start
                woken += extra
                channel = done[i] = begin + extra + calls[i][3]
                heapq.heappush(waiting, (calls[i][1], i))
                k += 1
            if waiting and waiting[0][0] <= q:
                wall = wait(q, wall)
        return max([wall, *done.values()]), woken, first_start, channel

    if not order:
        return run(0.0)[:2]
    runs: dict[float, tuple[float, float, float, float]] = {}  # run is a function of the first call's extra

    def run_once(extra: float) -> tuple[float, float, float, float]:
        if extra not in runs:
            runs[extra] = run(extra)
        return runs[extra]

    def excess(extra: float) -> float:  # the first call's idle gap wraps around, from the previous step's last
        step, _, first, last = run_once(extra)  # call's end, which its own waking moves
        return extra_of(order[0], first + step - last) - extra

    # The fixed point e = wake(gap(e)): gap(e) does not grow with e, so excess falls from >= 0 at 0 to <= 0 at the
    # curve's largest value; bisection, as a steep curve makes plain iteration oscillate.
    low, high = 0.0, max(extra_of(order[0], first) for first in (0.0, 1e9))
    if excess(high) >= 0:
        low = high
    for _ in range(60 if low < high else 0):
        mid = (low + high) / 2
        low, high = (mid, high) if excess(mid) > 0 else (low, mid)
    step, woken, _, _ = run_once(low)
    return step, woken


def _op_seconds(op: str, entry: dict, share: float, seconds_of: CollectiveTime,
                group_seconds: GroupTime | None, one_call: bool = False) -> float:
    """``share`` of one op's calls and payload, timed over all ranks, or group by group where the entry names its
    process groups and ``group_seconds`` is given. ``one_call``: the share is one call of its own size (the op has
    a slot per call: DDP's buckets, FSDP's units, zeroexp's buckets), else calls of the op's mean size."""
    parts = entry.get("groups") if group_seconds is not None else None
    if not parts:
        return seconds_of(op, entry["payload_bytes"] * share, 1 if one_call else entry["count"] * share)
    return sum(group_seconds(dim, int(g["size"]))(
        op, g["payload_bytes"] * share, 1 if one_call and g["count"] == entry["count"] else g["count"] * share)
               for dim, g in parts.items())


def compute_seconds(rate: ComputeRate, psi: int, samples: int, ops: tuple[int, int] = (0, 0),
                    checkpointed: int = 0) -> tuple[float, float, float]:
    """(forward, its recompute, backward with the recompute) seconds of one micro-batch of ``samples`` over ``psi``
    trained parameters (:func:`predict_step`'s compute, before the framework's costs and the optimizer)."""
    f = rate.forward_s_per_param_sample * psi * samples + rate.call_seconds("forward", ops[0], psi)
    r = recompute_seconds(f, checkpointed, psi)
    return f, r, rate.backward_s_per_param_sample * psi * samples + rate.call_seconds("backward", ops[1], psi) + r


#: A step's floor below its micro-batches' compute (:func:`step_floor`): the float rounding of the simulated clock,
#: which sums the same seconds in another order.
FLOOR_ROUNDING = 1e-9


def step_floor(rate: ComputeRate, psi: int, samples: int, micro_batches: int, ops: tuple[int, int] = (0, 0),
               checkpointed: int = 0) -> float:
    """A lower bound of :func:`predict_step`'s ``step_s`` that needs no groups: every micro-batch's forward and
    backward (:func:`compute_seconds`), less :data:`FLOOR_ROUNDING`; the framework's costs, the optimizer and every
    exposed collective only add to it."""
    f, _, b = compute_seconds(rate, psi, samples, ops, checkpointed)
    return max(int(micro_batches), 1) * (f + b) * (1 - FLOOR_ROUNDING)


def predict_step(layout: StateLayout, groups: Groups, collectives: Collectives, rate: ComputeRate,
                 samples: int, seconds_of: CollectiveTime, overlap: bool, prefetch: str = "pre",
                 framework: FrameworkCost | None = None, itemsize: int = 4, checkpointed: int = 0,
                 micro_batches: int = 1, repeats: dict[str, float] | None = None,
                 group_seconds: GroupTime | None = None, wake: Callable[[float], float] | None = None,
                 burst_seconds: CollectiveTime | None = None, stream_seconds: CollectiveTime | None = None,
                 knobs: PlanKnobs = PlanKnobs(), ops: tuple[int, int] = (0, 0), tensors: int = 0,
                 orig_params: bool = False) -> StepTime:
    """The step time of ``layout`` over ``groups`` at ``samples`` per rank and micro-batch: compute from ``rate``
    (forward and backward over every parameter, as data parallelism computes the whole model on each rank, each call
    with its own cost once per micro-batch; AdamW over :func:`optimizer_elements`), each op of ``collectives`` (the
    one model's calls and payload) split over its slots by their weights and timed by ``seconds_of``, placed by
    :func:`collective_slots`, run by :func:`simulate_step`.
    An op the rule has no slot for is issued at the end of backward and waited for at once (exposed).
    ``framework``: the calibrated costs of :mod:`zeroexp.formulas.time.framework`, added to the phase each runs in (the
    rank's own work, like compute; forward and backward terms in every micro-batch); None: none (a device preset).
    ``checkpointed``: the parameters in checkpointed units (:func:`recompute_seconds` adds their forward to each
    backward); ``micro_batches``: ``grad_accum``, with ``repeats`` (op -> its count at K over its count at 1) placing
    each op's calls (:func:`micro_batch_slots`). ``group_seconds``: where an op's entry names the process groups its
    calls run over (``groups``: hybrid sharding), each group's part is timed at its own size and place; None: every
    call over all ranks (``seconds_of``). ``wake``: each call's extra after its idle gap (a calibration's
    :class:`~zeroexp.formulas.time.rates.WakeCurve`; None: none, a device preset), in the exposed communication.
    ``burst_seconds``: a call's time where its slot is one of an async burst (``Slot.burst``: calls issued together,
    which the backend runs side by side; a calibration's ``burst_mean_s``); None: ``seconds_of``.
    ``stream_seconds``: a call's time in a stream of sync calls (a calibration's ``stream_mean_s``): what it exceeds
    the call's time alone by is the call's floor (its extra is its waking or that, the larger: :func:`channel_step`);
    not for burst slots (their own figure) nor calls timed group by group; None: no floor. ``knobs``: the
    strategy's settings that move calls (:func:`collective_slots`). ``ops``: the operators the model's forward and its
    backward dispatch (``zeroexp.plan.flops.step_ops``), what each call's own cost is paid on
    (:meth:`~zeroexp.formulas.time.rates.ComputeRate.call_seconds`); ``tensors``: the parameter tensors AdamW steps on
    the
    busiest rank (:func:`optimizer_tensors`), each at its own cost
    (:meth:`~zeroexp.formulas.time.rates.ComputeRate.optimizer_seconds`); ``orig_params``: FSDP1 keeps its original
    parameters (:func:`~zeroexp.formulas.time.framework.framework_time`)."""
    f, r, b = compute_seconds(rate, groups.numel, samples, ops, checkpointed)
    o = rate.optimizer_seconds(tensors, optimizer_elements(layout, groups))
    fw = framework_time(layout, groups, itemsize, framework or FrameworkCost(), orig_params)
    bare = (f, b - r, o)
    f, b, o = f + fw.forward_s, b + fw.backward_s, o + fw.optimizer_s
    k = max(int(micro_batches), 1)
    slots, rule = collective_slots(layout, groups, prefetch, f, b, o, knobs)
    slots = micro_batch_slots(slots, repeats or {}, k, f + b)
    last_b = (k - 1) * (f + b) + f + b  # the end of the last micro-batch's backward
    calls: list[tuple[float, float, int, float, float]] = []
    for op, entry in collectives.items():
        mine = [s for s in slots if s.op == op]
        if not mine:
            mine = [Slot(op, 1.0, last_b, last_b)]
        total = sum(s.weight for s in mine) or 1.0
        one_call = len(mine) == entry["count"]  # a slot per call (per micro-batch where it repeats)
        # where each slot names the group it runs over (FSDP2's post_forward), it is timed as a share of that group's
        parts = entry.get("groups") if group_seconds is not None else None
        by_group = bool(parts) and {s.group for s in mine} == set(parts)
        timed: dict[tuple[float, bool, str], tuple[float, float]] = {}  # a slot's time is a function of these alone
        for s in mine:
            share = s.weight / total
            burst = s.burst and burst_seconds is not None
            if (share, burst, s.group) not in timed:
                if by_group:
                    same, g = [x for x in mine if x.group == s.group], parts[s.group]
                    share = s.weight / (sum(x.weight for x in same) or 1.0)
                    seconds = _op_seconds(op, {**g, "groups": {s.group: g}}, share, seconds_of, group_seconds,
                                          len(same) == g["count"])
                else:
                    seconds = _op_seconds(op, entry, share, burst_seconds if burst else seconds_of, group_seconds,
                                          one_call)
                floor = 0.0
                if stream_seconds is not None and not burst and not (group_seconds is not None
                                                                     and entry.get("groups")):
                    floor = max(0.0, _op_seconds(op, entry, share, stream_seconds, None, one_call) - seconds)
                timed[s.weight / total, burst, s.group] = (seconds, floor)
            seconds, floor = timed[s.weight / total, burst, s.group]
            calls.append((s.issue_s, s.need_s, s.order, seconds, floor))
    compute = k * (f + b) + o
    step, woken = channel_step(compute, calls, overlap, wake)
    return StepTime(step_s=step, wake_s=woken, exposed_comm_s=step - compute, comm_s=sum(c[3] for c in calls),
                    forward_s=k * bare[0], backward_s=k * bare[1], optimizer_s=bare[2], recompute_s=k * r,
                    micro_batches=k, rule=rule if overlap else "no overlap on this device: " + rule,
                    framework_s=k * (fw.forward_s + fw.backward_s) + fw.optimizer_s,
                    framework_terms=tuple(fw.terms.items()), framework_notes=fw.notes)
