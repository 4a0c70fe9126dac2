"""FSDP2's phase peaks (:func:`fsdp2_phase_peaks`): per-parameter units, their copy-in and copy-out, the implicit and
explicit prefetch, the reshard to a smaller group after forward (:func:`post_forward_bump`); the rest of the peak
model over units is :mod:`zeroexp.formulas.peak.phases`."""

from __future__ import annotations

from typing import Callable

from zeroexp.formulas.peak.adamw import adamw_temporary_blocks
from zeroexp.formulas.peak.phases import (FsdpUnit, StepTrace, _add, _backward_ends, _backward_order, _Highest,
                                          _unit_index, highest_phases)

__all__ = ["fsdp2_phase_peaks", "fsdp2_no_sync_phase_peaks", "fsdp2_sync_phase_peaks", "post_forward_bump"]


# [Note: FSDP2's phase peaks]
# FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, _fsdp_collectives.py) all-gathers a unit into one
# output buffer and copies it out into the unsharded parameters (``split_with_sizes_copy``). Forward: two unit-sizes
# while a unit computes, three at a unit's copy-out: the previous unit's all-gather output (the first unit's: the
# root's, gathered before any unit), kept as the ``AllGatherState``, is freed when the unit's ``wait_for_unshard``
# returns, after its copy-out (its local ``prev_all_gather_state`` holds it past ``comm_ctx.all_gather_state = None``;
# Python references, alike on every device: on CUDA FSDP2 guards the buffer with events, not ``record_stream``).
# Backward, as measured on torch 2.13 and modelled so: each unit's pre-backward issues the next unit's all-gather
# (implicit prefetch); a unit computes with its parameters, the prefetched buffer and, except the first, the previous
# unit's reduce-scatter input (FSDP2 keeps one, ``reduce_scatter_states``, until the next reduce; the memory probe's
# ``comm`` showed it); its post-backward hook reshards it and holds the parameters' own gradients, their padded
# concatenation (``chunk_cat``, the reduce-scatter's input), the output shard and, on gloo, the input's copy, beside
# the prefetched buffer; below fp32 the shard's up-cast follows ``unsharded_grads.clear()``, when of the unit's own
# gradients only the last is still referenced; the sharded gradients of the units done are kept. Each unit after the
# first in backward copies its prefetched output out in its pre-backward (``wait_for_unshard``): two of its sizes
# beside the previous unit's kept reduce-scatter input. The root unit (its own parameters) is held from its forward to
# the end of forward and through backward. Optimizer: AdamW's temporaries over the local shards (one per parameter).
# Categories: the all-gather outputs and the unsharded parameters are ``unsharded``; ``chunk_cat``'s output (the
# reduce-scatter's input) and the previous unit's, kept, ``comm``; the output shards ``gradients``. ``one_unit``: the
# model is one unit (``wrap: null``, ``strategy.wrap=[]``): no all-gather follows its forward's, whose output stays
# alive through backward beside the unsharded parameters, and it reduces in the root's final callback, after autograd
# (measured on torch 2.13, a 10-7-3 biased stack at N=2 and 3, both reshard settings). ``root_kept``
# (``reshard_after_forward=None``, FSDP2's default): the root's own parameters stay unsharded from its forward into its
# backward, so the loss and its backward run beside them (gathered again otherwise only when autograd reaches the
# root). ``ahead``: explicit prefetch, (forward, backward) units ahead (0: FSDP2's default, none in forward, its
# implicit one in backward; _fsdp_state.py ``_pre_forward``, ``_pre_backward``): a unit's pre-forward, after its own
# copy-out, all-gathers the next units not yet gathered, whose outputs stay alive (``_all_gather_result``) until each
# one's own copy-out: unit k computes beside the next ``ahead[0]`` outputs, and copies out beside the ``ahead[0] - 1``
# after it that unit k - 1 issued; in backward a unit computes and reduces beside the next ``ahead[1]`` units' outputs
# (the backward-order units before it in forward). ``post_forward`` (``reshard_after_forward=k``, ZeRO++'s hpZ): each
# unit, the root too, keeps 1/k of its unsharded bytes from the end of its forward (cloned parameter by parameter while
# the unit is still unsharded, :func:`post_forward_bump`: a moment of its own) until its backward's copy-out frees
# them.


def fsdp2_phase_peaks(trace: StepTrace, units: list[FsdpUnit], *, root: int, steady_grad_bytes: int, gloo: bool,
                      optimizer_numels: tuple[int, ...], optimizer_itemsize: int, foreach: bool,
                      block: int = 1, reshard_after_forward: bool = True, one_unit: bool = False,
                      root_kept: bool = False, ahead: tuple[int, int] = (0, 0),
                      post_forward: int = 0, root_params: tuple[int, ...] = (),
                      kept_units: tuple[bool, ...] | None = None, reduce: bool = True,
                      accumulated: int = 0, shards_held: bool = False,
                      all_reduce_held: bool = False) -> dict[str, dict]:
    """FSDP2 ``fully_shard`` (``units`` in forward order; ``unsharded``: a unit's padded rows, all-gathered into one
    buffer), per phase, the bytes above steady at the peak, by category [FSDP2] (the moments of each phase: [Note:
    FSDP2's phase peaks] above). ``reshard_after_forward=False`` (SHARD_GRAD_OP's FSDP2 form): every unit stays
    unsharded from its forward to its backward. ``one_unit``: the model is one unit; ``root_kept``
    (``reshard_after_forward=None``): the root's own parameters stay unsharded into backward; ``ahead``: explicit
    prefetch, (forward, backward) units ahead (0: FSDP2's default); ``post_forward``: ``reshard_after_forward=k``;
    ``kept_units``: each unit's kept unsharded from its forward to its backward (``strategy.reshard_policy``: per
    unit), else every unit as ``reshard_after_forward`` says. ``reduce=False``: a micro-batch under
    ``set_requires_gradient_sync(False)`` (:func:`fsdp2_no_sync_phase_peaks`): no unit reduces its gradients;
    ``accumulated``: the unsharded gradient bytes held from the micro-batch's start (a later micro-batch's, which the
    step traced with its gradients allocated counts in its start, not in its segments), each unit's freed by its
    reduction. ``shards_held``: a later micro-batch under ``strategy.sync_each_microbatch``
    (:func:`fsdp2_sync_phase_peaks`): every sharded gradient held from its start, each unit's reduction a transient
    added into them. ``all_reduce_held`` (HSDP): each unit's reduce-scatter output, all-reduced over the replicate
    group, is held by its param group (``FSDPParamGroup._all_reduce_state``) until ``finalize_backward`` at backward's
    end; where it is not the gradient itself (below fp32 the gradient is its up-cast copy; under ``shards_held`` it is
    added into the held gradient), it stays beside it through the rest of backward (comm)."""
    k_of = _unit_index(trace, units)
    best = _Highest()
    kept_k = list(kept_units) if kept_units is not None else [not reshard_after_forward] * len(units)
    kept = all(kept_k)
    # what each unit holds from its forward to its backward, and the root at the loss
    held = [u.unsharded if c else u.unsharded // post_forward if post_forward else 0 for u, c in zip(units, kept_k)]
    root_after = root if kept or root_kept else root // post_forward if post_forward else 0
    bump = [post_forward_bump(p, post_forward) if post_forward and not c else 0
            for p, c in zip([u.params for u in units] + [root_params], kept_k + [kept])]  # the units', the root's
    keep = best.keep
    if accumulated:  # a later micro-batch: the steady shards freed (zero_grad), the unsharded gradients held
        def keep(phase: str, cats: dict, **kw) -> None:
            best.keep(phase, _add(cats, {"gradients": accumulated - steady_grad_bytes}) if phase == "forward" else cats,
                      **kw)
    _fsdp2_forward(keep, trace, units, k_of, root=root, held=held, root_after=root_after, ahead=ahead[0],
                   bump=bump)
    _fsdp2_backward(keep, trace, units, k_of, root=root, steady_grad_bytes=steady_grad_bytes, gloo=gloo,
                    kept=kept_k, one_unit=one_unit, held=held, root_after=root_after, ahead=max(ahead[1], 1),
                    reduce=reduce, accumulated=accumulated, shards_held=shards_held, all_reduce_held=all_reduce_held)
    return best.phases(adamw_temporary_blocks(optimizer_numels, optimizer_itemsize, foreach, block))


def fsdp2_no_sync_phase_peaks(trace: StepTrace, in_place: StepTrace, micro_batches: int, accumulated: int,
                              **kwargs) -> dict[str, dict]:
    """FSDP2 under ``set_requires_gradient_sync(False)`` for the first ``micro_batches - 1`` micro-batches of a step
    (``grad_accum=K``, ``sync_each_microbatch`` false; zeroexp.strategies.fsdp2 ``no_sync``), per phase the highest
    over the micro-batches of :func:`fsdp2_phase_peaks` (``kwargs``: its keywords).

    torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``post_backward``: without gradient sync a unit reshards
    (``reshard_after_backward`` stays true) and reduces nothing; its parameters' unsharded gradients stay on the
    unsharded parameters (``_unsharded_param.grad``, the same Parameter each later all-gather refills), into which
    autograd adds in place in the next micro-batch; the last micro-batch reduces them unit by unit (``foreach_reduce``
    takes each ``unsharded_grad_data`` and sets ``.grad`` to None). So: the first micro-batch is the step ``trace``
    with no reduction (its gradients as autograd makes them, held); every later one runs the step traced with the
    whole gradient allocated before it (``in_place``: autograd allocates none), the last with its reductions, each
    freeing its unit's unsharded gradients. Where the reduce dtype is not the parameters' (below fp32) FSDP2 keeps a
    copy in it (``unsharded_accumulated_grad``): not this model (``Fsdp2Rows.mixed_accumulation_limit``).
    ``accumulated``: the unsharded gradients' bytes (every unit's, the root's)."""
    runs = [fsdp2_phase_peaks(trace, **kwargs, reduce=False),
            fsdp2_phase_peaks(in_place, **kwargs, reduce=True, accumulated=accumulated)]
    if micro_batches > 2:
        runs.append(fsdp2_phase_peaks(in_place, **kwargs, reduce=False, accumulated=accumulated))
    return highest_phases(*runs)


def fsdp2_sync_phase_peaks(trace: StepTrace, **kwargs) -> dict[str, dict]:
    """FSDP2 reducing every micro-batch of a step (``grad_accum=K`` with ``strategy.sync_each_microbatch``: gradient
    sync left on, as torchtitan accumulates), per phase the highest over the micro-batches of
    :func:`fsdp2_phase_peaks` (``kwargs``: its keywords).

    Each micro-batch runs the step ``trace`` (autograd's unsharded gradients are new each time: FSDP2's reduction sets
    them to None) and reduce-scatters unit by unit. The first starts as a step without accumulation (Lightning's
    ``zero_grad`` before its backward frees the sharded gradients, its reductions keep each output as the
    gradient); every later one holds every sharded gradient from its start (no ``zero_grad`` inside an accumulation:
    Lightning's closure), and each unit's reduce-scatter output is a transient: _fsdp_collectives.py ``foreach_reduce``
    adds it into the existing gradient (``sharded_param.grad._local_tensor += new_sharded_grad``) and drops it when it
    returns."""
    return highest_phases(fsdp2_phase_peaks(trace, **kwargs), fsdp2_phase_peaks(trace, **kwargs, shards_held=True))


def _fsdp2_forward(keep: Callable[..., None], trace: StepTrace, units: list[FsdpUnit], k_of: dict[str, int], *,
                   root: int, held: list[int], root_after: int, ahead: int = 0, bump: list[int] | None = None) -> None:
    """:func:`fsdp2_phase_peaks`' forward moments, each to ``keep``: unit k computing, its post-forward reshard, its
    copy-out, the loss (``held``: what each unit keeps from its forward to its backward, all of it when kept, 1/k
    under ``reshard_after_forward=k``; ``root_after``: the root's, at the loss; ``ahead``: the units each unit's
    pre-forward prefetches; ``bump``: each unit's most bytes above its parameters while it reshards to k ranks)."""
    full = [u.unsharded for u in units]
    act = {"activations": -trace.loss_bytes}
    last = None  # the last unit's end: what is alive when the root reshards (its all-gather output too)
    for s in (s for s in trace.segments if s.phase == "forward"):
        if s.unit == "loss":  # the root resharded at the end of its forward, and the units, but what they hold
            if bump and bump[-1] and last is not None:  # the root's post-forward shard cloned out of it
                keep("forward", _add(_add(last.end_by_category, act),
                                     {"unsharded": root + bump[-1] + sum(held) + full[k_of[last.unit]]}))
            keep("forward", _add(_add(s.peak_by_category, act), {"unsharded": root_after + sum(held)}))
            continue
        last = s if s.at == "end" else last
        k = k_of[s.unit]
        before = sum(held[:k])  # what the units before it hold since their forward
        if s.at == "end":  # unit k computing: its all-gather output and its unsharded parameters, the prefetched
            keep("forward", _add(_add(s.peak_by_category, act),
                                 {"unsharded": root + before + 2 * full[k] + sum(full[k + 1:k + 1 + ahead])}))
            if bump and bump[k]:  # its post-forward shard cloned out of it, parameter by parameter
                keep("forward", _add(_add(s.end_by_category, act), {
                    "unsharded": root + before + 2 * full[k] + bump[k] + sum(full[k + 1:k + 1 + ahead])}))
        else:  # unit k's copy-out: the previous all-gather output kept (unit 0: the root's), unit k-1's prefetched
            early = sum(full[k + 1:k + ahead]) if k else 0
            keep("forward", _add(_add(s.end_by_category, act),
                                 {"unsharded": root + before + 2 * full[k] + (full[k - 1] if k else root) + early}))


def _fsdp2_backward(keep: Callable[..., None], trace: StepTrace, units: list[FsdpUnit], k_of: dict[str, int], *,
                    root: int, steady_grad_bytes: int, gloo: bool, kept: list[bool], one_unit: bool,
                    held: list[int], root_after: int, ahead: int = 1, reduce: bool = True,
                    accumulated: int = 0, shards_held: bool = False, all_reduce_held: bool = False) -> None:
    """:func:`fsdp2_phase_peaks`' backward moments, each to ``keep``: per unit in backward order, the trace's own
    peaks (u computing; for the first unit, the loss's backward before it) and its post-backward reduction
    (``kept``: each unit's kept unsharded from its forward: not gathered again, nor prefetched; ``reduce=False``: no
    reduction, each unit's gradients held as the trace holds them; ``shards_held``: every sharded gradient held
    throughout, steady's, each reduction's output a transient added into it; ``all_reduce_held``: HSDP's all-reduce
    buffers kept to backward's end, :func:`fsdp2_phase_peaks`)."""
    full = [u.unsharded for u in units]
    if shards_held:  # nothing freed before backward; no reduction's output kept
        steady_grad_bytes = 0
    segs = list(trace.segments)
    order = _backward_order(k_of)
    shards_done, grads_done = 0, 0
    # HSDP: the reduced units' all-reduce buffers (foreach_reduce's reduce_output) that are not their gradients, held
    # in FSDPParamGroup._all_reduce_state until finalize_backward (_fsdp_param_group.py post_backward)
    ar_done = 0
    reduced: dict[str, int] = {}  # the previous unit's post-backward, its reduction done
    ends = _backward_ends(segs)
    for pos, (name, k) in enumerate(order):
        i = ends[name]
        u = units[k]
        after = segs[i + 1].end_by_category
        t_root = max(after.get("gradients", 0) - grads_done - u.grads, 0)
        prefetched = sum(full[j] for _, j in order[pos + 1:pos + 1 + ahead] if not kept[j])
        pending = sum(held[j] for _, j in order[pos + 1:])  # what the units after it hold since their forward
        # The previous unit's reduce-scatter input, kept until this unit's reduce (FSDP2's reduce_scatter_states, one
        # buffer): comm.
        rs_kept = units[order[pos - 1][1]].scattered if pos and not kept[k] and reduce else 0
        if pos and not kept[k] and not one_unit:
            # u's copy-out in its pre-backward (wait_for_unshard), before it prefetches the next unit: its all-gather
            # output (prefetched by the previous unit) beside its unsharded parameters and the units prefetched before
            # it, the previous unit's reduction done (as forward's copy-out)
            early = sum(full[j] for _, j in order[pos + 1:pos + ahead] if not kept[j])
            keep("backward", {**reduced, "comm": rs_kept + ar_done,
                              "unsharded": root + 2 * full[k] + early + pending + held[k]})
        # The trace's own peaks: u computing, and, for the first unit, the loss's backward before it (where only what
        # the units and the root hold since forward is unsharded).
        before = ((segs[i - 1], root_after + held[k] + pending, 0),) if pos == 0 else ()
        # A model that is one unit all-gathers nothing after its forward: that all-gather's output (AllGatherState)
        # is still alive through its backward, beside the unsharded parameters.
        ag_kept = full[k] if one_unit and not kept[k] else 0
        for seg, unsharded, comm in ((segs[i], root + u.unsharded + prefetched + pending + ag_kept, rs_kept + ar_done),
                                     *before):
            g = seg.peak_by_category.get("gradients", 0)
            keep("backward", _add(seg.peak_by_category, {
                "activations": -trace.loss_bytes, "unsharded": unsharded, "comm": comm,
                "gradients": shards_done - steady_grad_bytes - min(g, grads_done)
                + max(accumulated - grads_done, 0)}))
        if not reduce:  # resharded, nothing reduced: its gradients stay where the trace holds them
            reduced = {"activations": after.get("activations", 0) - trace.loss_bytes,
                       "temporaries": after.get("temporaries", 0),
                       "gradients": after.get("gradients", 0) - steady_grad_bytes + accumulated}
            continue
        # chunk_cat's output, the reduce-scatter's input, is comm; the output shard is kept as the gradient. gloo's
        # copy of the input (no collective's argument: temporaries) is alive at this moment only while gloo's worker
        # still holds it: the upper end of the range.
        copy = max(u.scattered - u.upcast, 0) if gloo else 0
        # A model that is one unit reduces in the root's final callback, after autograd: by gloo's copy of the input
        # the parameters' own gradients are freed but the last one (FSDP2's reduction still references it), and the
        # copy is alive.
        alone = one_unit and gloo
        # the output shard: kept as the gradient, or (``shards_held``) a transient the memory probe leaves ``comm``,
        # a collective's output freed before the step's end
        post = {"activations": after.get("activations", 0) - trace.loss_bytes,
                "comm": u.scattered + (u.shard if shards_held else 0) + ar_done,
                "unsharded": root + prefetched + pending,
                "gradients": t_root + shards_done + (0 if shards_held else u.shard) - steady_grad_bytes
                + (u.last_grad if alone else 0) + max(accumulated - grads_done - u.grads, 0)}
        note = (f"gloo's copy of unit {k}'s reduce-scatter input ({copy} B), alive at its post-backward only while "
                "gloo's worker holds it")
        keep("backward", {**post, "temporaries": after.get("temporaries", 0) + (copy if alone else u.grads)},
             timing={"temporaries": 0 if alone else copy}, note=note)
        if u.upcast:  # below fp32: the reduced shard's up-cast (foreach_reduce's _to_dtype_if_needed) comes after
            # unsharded_grads.clear() (_fsdp_collectives.py): of the unit's own gradients only the last is still
            # referenced then
            keep("backward", {**post, "temporaries": after.get("temporaries", 0) + u.upcast
                              + (0 if alone else u.last_grad)},
                 timing={"temporaries": 0 if alone else copy}, note=note)
        shards_done += 0 if shards_held else u.upcast or u.shard
        grads_done += u.grads
        ar_done += u.shard if all_reduce_held and u.scattered and (shards_held or u.upcast) else 0
        reduced = {"activations": after.get("activations", 0) - trace.loss_bytes, "comm": ar_done,
                   "temporaries": after.get("temporaries", 0),
                   "gradients": t_root + shards_done - steady_grad_bytes + max(accumulated - grads_done, 0)}


def post_forward_bump(params: tuple[int, ...], k: int) -> int:
    """The most bytes above a unit's unsharded parameters while FSDP2 reshards it to ``k`` ranks after forward, one
    parameter after another: its 1/k cloned (``to_sharded_post_forward``), then its unsharded storage freed."""
    best = run = 0
    for b in params:
        best, run = max(best, run + b // k), run + b // k - b
    return best
