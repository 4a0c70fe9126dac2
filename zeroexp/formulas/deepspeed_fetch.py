"""DeepSpeed stage 3's parameter fetch and release schedule: the ``PartitionedParameterCoordinator`` of DeepSpeed 0.19.8
(runtime/zero/partitioned_param_coordinator.py) replayed over a step's module calls [DS-FETCH].

[DS-FETCH] DeepSpeed registers a pre- and a post-forward hook on every module of the engine's module
(parameter_offload.py ``_register_deepspeed_module``), and in backward a pre-backward hook on each module's outputs
(``PreBackwardFunctionForModule``) and a post-backward one on its inputs that need a gradient
(``PostBackwardFunctionModule``). Each pre hook is ``fetch_sub_module``: the module's own parameters not yet available
are gathered in one ``all_gather`` (``__all_gather_params``); once the trace is complete (from the third step on:
``reset_step`` records it in the second) the parameter queue (the trace's modules' parameters, in order, each module's
by ``ds_id``) is popped past this module's parameters, then a prefetch pops it on, gathering the ones not available in
one more ``all_gather``, until ``min(stage3_max_live_parameters - available, stage3_prefetch_bucket_size)`` elements are
gathered (available ones popped, not counted). Each post hook is ``release_sub_module``: the module's parameters that
are not persistent (``ds_numel <= stage3_param_persistence_threshold``), whose later use no prefetch has popped, and
that no module within ``stage3_max_reuse_distance`` elements of the trace onward uses, are released (``partition``)
unless another active module holds them. A module whose inputs need no gradient has no post-backward hook: its
parameters wait for the step (``release_backward_leftovers``, ``_partition_all_parameters``), as do the persistent ones;
every step (every micro-batch: its backward ends in ``reset_step``) starts with none available.

[DS-RECOMPUTE] Under activation checkpointing (torch's non-reentrant ``checkpoint``) a checkpointed unit's forward
runs again inside its backward, DeepSpeed's forward hooks with it: each recomputed call's pre-forward hook is
``fetch_sub_module`` (``forward=True``; a parameter released after forward is gathered again) and its post-forward
hook ``release_sub_module``, both counted in the trace (``record_module``: the recorded step holds the recompute's
modules, so the next steps' order matches it, ``trace_prologue`` invalidates nothing and the trace is complete from
the third step as without). The recompute starts at the first backward node that saved a tensor: the pre-backward
hooks of the unit's call and of its last calls down to the last one (each output's gradient passes a residual add,
which saves none) fire first, the last call's own node then unpacks. Its forward stops once every saved tensor is
made again (``checkpoint``'s early stop): inside the last call, after its pre-forward hook, so that call and the
calls around it release nothing there. A parameter the recompute releases stays allocated: the saved tensors the
recompute made again are views of its gathered tensor (``checkpoint`` keeps ``x.detach()``), itself a view of its
all_gather's flat buffer (``_all_gather_coalesced``), until the module's backward consumes them; its pre-backward
hook, finding it released, gathers it again (both held at once). Every module of a checkpointed unit is taken to
save one of its parameters (a Linear its weight, a norm its weight): one that saves none frees its buffer earlier.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import NamedTuple

__all__ = ["ModuleCall", "FetchEvent", "Stage3Schedule", "ds_stage3_events", "ds_stage3_schedule"]


class ModuleCall(NamedTuple):
    """One forward call of a module, as the step made it: ``module`` (which module: a repeated call names it again),
    ``params`` (its own parameters' indices, ``ds_id`` order), ``grad_input`` (an input needs a gradient: the
    post-backward hook fires), ``reached`` (its output needs one: the pre-backward hook fires), ``depth`` (its
    nesting: the calls inside it follow it with a greater depth)."""

    module: int
    params: tuple[int, ...]
    grad_input: bool
    reached: bool
    depth: int = 0


class FetchEvent(NamedTuple):
    """One coordinator hook in a step: ``phase`` (forward / backward / recompute: a checkpointed unit's forward hooks
    run again inside backward, [DS-RECOMPUTE]), ``call`` (the index of its
    :class:`ModuleCall`), ``fetch`` (a pre hook; else a release), ``gathered`` (the parameters each ``all_gather`` it
    issued holds), ``released`` (the parameters it released); after it, ``whole`` (the parameters whose unsharded
    tensor exists: a gather's are made at once, at the first wait on it, ``AllGatherCoalescedHandle.wait``) and
    ``flats`` (the all_gathers, by their index in the step, whose flat buffer is still held: until the last of its
    parameters is waited for, the in-flight registry holding the handle; one whose parameters the recompute released,
    until the module's post-backward hook); ``peak``: the two at its highest moment (a
    fetch: its waits done, before the handles are dropped, or its prefetch issued)."""

    phase: str
    call: int
    fetch: bool
    gathered: tuple[tuple[int, ...], ...]
    released: tuple[int, ...]
    whole: frozenset[int]
    flats: tuple[int, ...]
    peak: tuple[frozenset[int], tuple[int, ...]]


class Stage3Schedule(NamedTuple):
    """A step's all_gathers (each its parameters, in the order issued) and its hooks (:class:`FetchEvent`)."""

    gathers: tuple[tuple[int, ...], ...]
    events: tuple[FetchEvent, ...]


def ds_stage3_events(calls: tuple[ModuleCall, ...], recomputed: frozenset[int] = frozenset()
                     ) -> list[tuple[str, int, bool]]:
    """The coordinator's hooks of a step as ``(phase, call, fetch)``: forward each call's pre hook, the calls nested in
    it, its post hook; backward in reverse, a reached call's pre-backward hook before those of the calls nested in it
    (its output's gradient arrives first), its post-backward hook (where its input needs a gradient) after theirs.
    ``recomputed``: the calls of checkpointed units, whose forward backward runs again [DS-RECOMPUTE]."""
    forward = _nested(calls, range(len(calls)))
    backward = [(k, not fetch) for k, fetch in reversed(forward)
                if (calls[k].reached if not fetch else calls[k].reached and calls[k].grad_input)]
    events = [("forward", k, f) for k, f in forward]
    pending = {k: _subtree(calls, k) for k in recomputed}
    i = 0
    while i < len(backward):
        k, fetch = backward[i]
        events.append(("backward", k, fetch))
        i += 1
        root = next((r for r, sub in pending.items() if k in sub), None)
        if root is None or (i < len(backward) and backward[i][1] and backward[i][0] in pending[root]
                            and calls[backward[i][0]].depth > calls[k].depth):
            continue
        sub = pending.pop(root)  # the pre-backward hooks down the unit's last calls fired: its forward runs again
        replay = _nested(calls, sub)
        last = max(j for j, (_, fetch_) in enumerate(replay) if fetch_)
        events += [("recompute", j, f) for j, f in replay[:last + 1]]
    return events


def _subtree(calls: tuple[ModuleCall, ...], k: int) -> list[int]:
    """Call ``k`` and the calls nested in it, in order."""
    end = next((j for j in range(k + 1, len(calls)) if calls[j].depth <= calls[k].depth), len(calls))
    return list(range(k, end))


def _nested(calls: tuple[ModuleCall, ...], ks) -> list[tuple[int, bool]]:
    """The forward hooks ``(call, fetch)`` of the calls ``ks`` (in order): each call's pre hook, those nested in it,
    its post hook."""
    out: list[tuple[int, bool]] = []
    open_: list[int] = []
    for k in ks:
        c = calls[k]
        while open_ and calls[open_[-1]].depth >= c.depth:
            out.append((open_.pop(), False))
        out.append((k, True))
        open_.append(k)
    return out + [(k, False) for k in reversed(open_)]


@functools.lru_cache(maxsize=64)  # a pure function of its arguments: a search asks for the same schedule per row
def ds_stage3_schedule(calls: tuple[ModuleCall, ...], numels: tuple[int, ...], *, prefetch_bucket: int,
                       max_live: int, persistence: int, max_reuse: int,
                       recomputed: frozenset[int] = frozenset()) -> Stage3Schedule:
    """One step of the coordinator over ``calls`` (``numels``: every parameter's ``ds_numel``), its trace complete
    (module docstring); ``recomputed``: the calls of checkpointed units (:func:`ds_stage3_events`)."""
    events = ds_stage3_events(calls, recomputed)
    trace = [k for _, k, fetch in events if fetch]  # the modules in fetch order: the trace's submodule order
    queue = deque((p, step) for step, k in enumerate(trace) for p in sorted(set(calls[k].params)))
    available: set[int] = set()
    whole: set[int] = set()
    inflight: dict[int, int] = {}  # parameter -> its all_gather (the in-flight registry)
    made: dict[int, int] = {}  # parameter -> the all_gather whose flat buffer its tensor is a view of
    kept: dict[int, int] = {}  # all_gather -> the module whose backward frees its flat buffer [DS-RECOMPUTE]
    active: dict[int, set[int]] = {}
    recent: dict[int, int] = {}
    live, step, gathers, out = 0, 0, [], []

    def gather(params: list[int]) -> tuple[int, ...]:
        nonlocal live
        todo = tuple(p for p in dict.fromkeys(params) if p not in available)
        if todo:
            available.update(todo)
            inflight.update((p, len(gathers)) for p in todo)
            made.update((p, len(gathers)) for p in todo)
            live += sum(numels[p] for p in todo)
            gathers.append(todo)
            issued.append(todo)
        return todo

    def flats() -> tuple[int, ...]:
        return tuple(sorted(set(inflight.values()) | set(kept)))

    for phase, k, fetch in events:
        c, issued, released = calls[k], [], []
        own = set(c.params)
        peak = (frozenset(whole), flats())
        if fetch:
            gather(sorted(own))
            for p in own:
                active.setdefault(p, set()).add(c.module)
            for g in {inflight[p] for p in own if p in inflight}:  # the first wait makes a gather's tensors
                whole.update(q for q, h in inflight.items() if h == g)
            peak = (frozenset(whole), flats())
            for p in own:
                inflight.pop(p, None)
            fresh = {p for p in own if recent.get(p, -10**18) < step}  # not popped by an earlier prefetch
            popped: set[int] = set()
            while queue and len(popped) < len(fresh):
                p, at = queue.popleft()
                recent[p] = at
                popped.add(p)
            if popped != fresh:
                raise ValueError(f"the trace's parameter queue at step {step} does not start with call {k}'s")
            if prefetch_bucket > 0:
                room, ahead, numel = min(max_live - live, prefetch_bucket), [], 0
                while queue and numel < room:
                    p, at = queue.popleft()
                    if p not in available and p not in ahead:
                        ahead.append(p)
                        numel += numels[p]
                    recent[p] = max(recent.get(p, -10**18), at)
                if gather(ahead):
                    peak = max(peak, (frozenset(whole), flats()), key=lambda m: _size(m, numels, gathers))
            step += 1
        else:
            drop = {p for p in own if numels[p] > persistence and recent.get(p, -10**18) <= step}
            traversed = 0
            for later in trace[step:]:
                if traversed >= max_reuse:
                    break
                for p in calls[later].params:
                    drop.discard(p)
                    traversed += numels[p]
            for p in sorted(own):
                active.get(p, set()).discard(c.module)
                if p in drop and p in whole and not active.get(p):
                    available.discard(p)
                    whole.discard(p)
                    live -= numels[p]
                    released.append(p)
                    if phase == "recompute":  # the recompute's saved tensors still view its flat buffer
                        kept[made[p]] = c.module
            if phase == "backward":  # its backward consumed what its recompute saved
                for g in [g for g, m in kept.items() if m == c.module]:
                    del kept[g]
        out.append(FetchEvent(phase, k, fetch, tuple(issued), tuple(released), frozenset(whole), flats(), peak))
    return Stage3Schedule(tuple(gathers), tuple(out))


def _size(moment: tuple[frozenset[int], tuple[int, ...]], numels: tuple[int, ...], gathers: list) -> int:
    """Elements held at a moment (unsharded parameters and flat buffers, unpadded)."""
    params, flat = moment
    return sum(numels[p] for p in params) + sum(numels[p] for g in flat for p in gathers[g])
