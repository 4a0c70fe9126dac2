"""Gradient accumulation (``grad_accum=K``) in the peak model: what the K micro-batches of one optimizer step hold.

The memory probe measures each phase's peak as the highest over the step's micro-batches (zeroexp/probes/memory.py),
so a phase's prediction is the highest over the micro-batches' own: the first starts from the steady state as a step
without accumulation does, every later one starts with what the earlier ones left (the gradients accumulated so
far). Sources: torch's ``AccumulateGrad`` (an existing ``.grad`` is added into in place), DDP's ``no_sync``
(torch/nn/parallel/distributed.py: no bucket copy, no all_reduce), zeroexp's ``ShardedAdamW.accumulating``
(zeroexp/strategies/sharding.py).
"""

from __future__ import annotations

from zeroexp.formulas.peak.adamw import adamw_temporary_blocks
from zeroexp.formulas.peak.phases import (FsdpUnit, StepTrace, _add, _backward_ends, _backward_order, _fsdp_forward,
                                          _Highest, _unit_index, highest_phases, phase_peaks)

__all__ = ["accumulated_phase_peaks", "accumulated_grad_bytes", "fsdp1_no_sync_phase_peaks"]


def accumulated_phase_peaks(trace: StepTrace, micro_batches: int, *, live_grads: bool = False,
                            open_buckets: bool = False, **terms) -> dict[str, dict]:
    """:func:`zeroexp.formulas.peak.phases.phase_peaks` over the ``micro_batches`` micro-batches of one optimizer step:
    per
    phase the highest of the micro-batches' peaks (``terms``: phase_peaks' keywords, ``in_place`` the step traced with
    the gradients allocated). A flow whose gradients are new each step (DDP, ZeroRedundancyOptimizer on DDP, under
    ``no_sync``): the first micro-batch allocates them after ``zero_grad`` freed them, as without accumulation; every
    later one adds into them in place, so it holds the whole gradient from its start (the ``in_place`` flow). One
    whose gradients live across the step (``live_grads``: zeroexp's ZeRO-1's flat buffers accumulate; ZeRO-2's
    ``open_buckets`` reduce-scatter into the gradient shard and are released every micro-batch): every micro-batch
    as one step."""
    first = phase_peaks(trace, live_grads=live_grads, open_buckets=open_buckets, **terms)
    if micro_batches < 2 or live_grads:
        return first
    later = phase_peaks(trace, live_grads=True, **terms)
    return highest_phases(first, later)


def accumulated_grad_bytes(grad_bytes: int, live_grads: bool) -> int:
    """The gradient bytes the later micro-batches of a step hold from their start that a step without accumulation
    does not (``grad_bytes``: the rank's gradients in the steady state): new gradients are held whole (``zero_grad``
    frees them at K=1); live ones (``live_grads``) are held at K=1 too, or only as the steady gradient shard."""
    return 0 if live_grads else int(grad_bytes)


def fsdp1_no_sync_phase_peaks(trace: StepTrace, units: list[FsdpUnit], grads: list[int], *, micro_batches: int,
                              reshard_after_forward: bool, root: int, root_grads: int, steady_grad_bytes: int,
                              prefetch: str, gloo: bool, optimizer_numels: tuple[int, ...], optimizer_itemsize: int,
                              foreach: bool, block: int = 1, grads_held_into_backward: bool = False) -> dict[str, dict]:
    """FSDP1 under ``no_sync`` (``grad_accum=K``, ``sync_each_microbatch`` false), FULL_SHARD
    (``reshard_after_forward``) or SHARD_GRAD_OP, per phase, the bytes above steady at the peak over the K
    micro-batches, by category; ``units`` as :func:`zeroexp.formulas.peak.phases.fsdp_phase_peaks` takes them,
    ``grads``: each one's unsharded gradient (its trained parameters' flat ``.grad``), ``root_grads`` the root unit's.

    torch/distributed/fsdp/_runtime_utils.py: ``_post_backward_hook`` returns after ``_post_backward_reshard`` while
    ``_sync_gradients`` is false, so each unit keeps its unsharded gradient (the FlatParameter's ``.grad``, in the
    compute dtype: autograd's), which ``_finalize_params`` leaves and _flat_param.py
    ``prepare_gradient_for_backward`` keeps (its size the unpadded unsharded one), and into which autograd's
    ``AccumulateGrad`` adds each later micro-batch's in place. ``_should_free_in_backward``: FULL_SHARD frees its units
    in backward as without accumulation (``RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES``; ``_post_forward_reshard`` after
    forward), so every micro-batch gathers as a step without accumulation does; SHARD_GRAD_OP keeps them unsharded from
    the first micro-batch's forward to the last one's post-backward hooks. Moments, each a lower bound:
      first micro-batch: the step's forward; in backward the unsharded gradients of the units done (``zero_grad``
        freed the steady shards), and at each unit's end its parameters' gradients concatenated into its new unsharded
        gradient (the split views' backward: its output beside its inputs);
      later micro-batches: every unsharded gradient held from the start (the steady shards gone), the concatenated
        new gradient beside them before ``AccumulateGrad`` adds it; the last one's post-backward hooks
        (``_reduce_grad``) reshard each unit and reduce-scatter its accumulated gradient (the input ``comm``, its output
        shard kept, up-cast below fp32 by ``_cast_grad_to_param_dtype``), then drop it.
    The steady shards ``zero_grad`` frees are the parameters' dtype (fp32: ``_cast_grad_to_param_dtype``), the
    unsharded gradients the compute dtype's. Gathers as :func:`zeroexp.formulas.peak.phases.fsdp_phase_peaks` (the
    root kept from forward into backward; ``prefetch``). Optimizer: AdamW's temporaries."""
    k_of = _unit_index(trace, units)
    best = _Highest()
    held, full = root_grads + sum(grads), [u.unsharded for u in units]
    _fsdp_forward(best.keep, trace, units, k_of, root=root, reshard_after_forward=reshard_after_forward,
                  grads_held_into_backward=grads_held_into_backward)  # the first micro-batch

    def later_forward(phase: str, cats: dict, **_: object) -> None:
        if phase == "forward":
            best.keep(phase, _add(_plus(cats, {}), {"comm": cats.get("gradients", 0) + held,
                                                    "gradients": -steady_grad_bytes}))
    if reshard_after_forward:
        _fsdp_forward(later_forward, trace, units, k_of, root=root, reshard_after_forward=True)
    else:  # every unit held from the first micro-batch
        for s in (s for s in trace.segments if s.phase == "forward"):
            later_forward("forward", _add(s.peak_by_category, {"activations": -trace.loss_bytes,
                                                               "unsharded": root + sum(full)}))
    segs, order = list(trace.segments), _backward_order(k_of)
    middle = micro_batches > 2  # a micro-batch neither first nor last: every gradient held throughout
    traced_done, flat_done, left, shards_done = 0, 0, held, 0
    ends = _backward_ends(segs)
    for pos, (name, k) in enumerate(order):
        i, u = ends[name], units[k]
        nxt = full[order[pos + 1][1]] if pos + 1 < len(order) else 0
        pending = sum(full[j] for _, j in order[pos + 1:])
        if reshard_after_forward:  # every micro-batch alike
            held_a = u.unsharded + (nxt if prefetch == "pre" else 0)
            held_b = nxt if prefetch in ("pre", "post") else 0
            before = u.unsharded if prefetch == "pre" and root else 0
            kept_a, kept_before = held_a, before
        else:  # the last micro-batch frees each unit at its hook; the others keep every unit
            held_a, held_b, kept_a = u.unsharded + pending, pending, sum(full)
            before, kept_before = held_a, kept_a
        for seg, on, kept in ((segs[i], held_a, kept_a), *(((segs[i - 1], before, kept_before),) if pos == 0 else ())):
            fresh = max(seg.peak_by_category.get("gradients", 0) - traced_done, 0)  # autograd's, not yet flat
            base = _plus(seg.peak_by_category, {"activations": -trace.loss_bytes})
            best.keep("backward", _add(base, {"unsharded": root + kept, "comm": flat_done + fresh,
                                              "gradients": -steady_grad_bytes}))
            best.keep("backward", _add(base, {"unsharded": root + on, "comm": left + fresh,
                                              "gradients": shards_done - steady_grad_bytes}))
            if middle:
                best.keep("backward", _add(base, {"unsharded": root + kept, "comm": held + fresh,
                                                  "gradients": -steady_grad_bytes}))
        after = segs[i + 1].end_by_category  # u's backward done
        t_act, t_temp = after.get("activations", 0) - trace.loss_bytes, after.get("temporaries", 0)
        t_root = max(after.get("gradients", 0) - traced_done - u.grads, 0)  # the root's, not yet flat
        a = {"activations": t_act, "temporaries": t_temp + u.grads}
        best.keep("backward", {**a, "unsharded": root + kept_a, "comm": t_root + flat_done + grads[k],
                               "gradients": -steady_grad_bytes})
        best.keep("backward", {**a, "unsharded": root + held_a, "comm": t_root + left + grads[k],
                               "gradients": shards_done - steady_grad_bytes})
        if middle:
            best.keep("backward", {**a, "unsharded": root + kept_a, "comm": t_root + held + grads[k],
                                   "gradients": -steady_grad_bytes})
        if u.scattered:  # the last micro-batch's reduction of u's accumulated gradient (padded: the input)
            copy = u.scattered if gloo else 0  # gloo's copy of the reduce-scatter input
            best.keep("backward", {"activations": t_act, "temporaries": t_temp + max(u.upcast, copy),
                                   "comm": t_root + left - grads[k] + max(u.scattered, grads[k]),
                                   "unsharded": root + held_b,
                                   "gradients": shards_done + u.shard - steady_grad_bytes})
            left -= grads[k]
            shards_done += u.upcast or u.shard
        traced_done += u.grads
        flat_done += grads[k]
    return best.phases(adamw_temporary_blocks(optimizer_numels, optimizer_itemsize, foreach, block))


def _plus(cats: dict, more: dict) -> dict:
    out = {c: int(b) for c, b in cats.items() if c != "gradients"}
    for c, b in more.items():
        out[c] = out.get(c, 0) + int(b)
    return out
