"""Gradient accumulation (``grad_accum=K``) in the peak model: what the K micro-batches of one optimizer step hold.

The memory probe measures each phase's peak as the highest over the step's micro-batches (zeroexp/probes/memory.py),
so a phase's prediction is the highest over the micro-batches' own: the first starts from the steady state as a step
without accumulation does, every later one starts with what the earlier ones left (the gradients accumulated so
far). Sources: torch's ``AccumulateGrad`` (an existing ``.grad`` is added into in place), DDP's ``no_sync``
(torch/nn/parallel/distributed.py: no bucket copy, no all_reduce), zeroexp's ``ShardedAdamW.accumulating``
(zeroexp/strategies/sharding.py).
"""

from __future__ import annotations

from zeroexp.formulas.peak.phases import StepTrace, highest_phases, phase_peaks

__all__ = ["accumulated_phase_peaks", "accumulated_grad_bytes", "fsdp_no_sync_phase_peaks"]


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


def fsdp_no_sync_phase_peaks(trace: StepTrace, unsharded: list[int], grads: list[int], *, root: int, root_grads: int,
                             steady_grad_bytes: int, optimizer_temporaries: int,
                             grads_held_into_backward: bool = False) -> dict[str, dict]:
    """FSDP1 SHARD_GRAD_OP under ``no_sync`` (``grad_accum=K``, ``sync_each_microbatch`` false), per phase, the bytes
    above steady at the peak over the K micro-batches, by category; ``unsharded`` and ``grads``: each non-root unit's
    padded FlatParameter and its parameters' own gradients (bytes, forward order); ``root``, ``root_grads``: the root
    unit's.

    torch/distributed/fsdp/_runtime_utils.py: under ``no_sync`` the post-backward hook neither reduce-scatters nor, for
    SHARD_GRAD_OP (``_should_free_in_backward``), reshards: after the first micro-batch every unit stays unsharded
    and keeps its unsharded gradient (the FlatParameter's ``.grad``, into which autograd adds in place) to the last
    micro-batch's post-backward hooks. Lower bounds at every moment:
      first micro-batch, backward: every unit unsharded, autograd's gradients new (``zero_grad`` freed the steady
        shards);
      later micro-batches, forward and backward until the first post-backward hook: every unit and every unsharded
        gradient held, autograd's gradients added in place; after unit u's hook in the last micro-batch: the units
        and gradients not yet reduced.
    Categories as the memory probe names them: the units held are ``unsharded``, the unsharded gradients held
    ``comm`` (each is its unit's reduce-scatter input in the last micro-batch), ``gradients`` the steady shards freed.
    Its forward is never below the first micro-batch's (which holds no more). Optimizer: AdamW's temporaries.
    ``grads_held_into_backward`` (``use_orig_params``): the first micro-batch's backward starts holding the steady
    shards, freed by the root's pre-backward hook (``StepTrace.backward_start``), every unit
    unsharded."""
    params, held = root + sum(unsharded), root_grads + sum(grads)
    best: dict[str, dict] = {}

    def keep(phase: str, cats: dict) -> None:
        cats = {c: int(b) for c, b in cats.items() if b}
        if phase not in best or best[phase]["bytes"] < sum(cats.values()):
            best[phase] = {"bytes": sum(cats.values()), "by_category": cats}

    loss = {"activations": -trace.loss_bytes}
    for s in (s for s in trace.segments if s.phase == "forward"):
        keep("forward", {**_plus(s.peak_by_category, loss), "unsharded": params, "gradients": -steady_grad_bytes,
                         "comm": s.peak_by_category.get("gradients", 0) + held})
    if grads_held_into_backward:  # every unit held; the traced gradients at the forward's end are unsharded ones
        start = trace.backward_start()
        keep("backward", {**_plus(start, {}), "unsharded": params, "comm": start.get("gradients", 0)})
    done = 0  # units whose last post-backward hook has run (their unit and gradient freed in the last micro-batch)
    order = list(range(len(unsharded)))[::-1]
    for s in (s for s in trace.segments if s.phase == "backward"):
        traced = s.peak_by_category.get("gradients", 0)
        keep("backward", {**_plus(s.peak_by_category, loss), "unsharded": params, "comm": traced,
                          "gradients": -steady_grad_bytes})  # the first micro-batch
        left = order[done:]
        keep("backward", {**_plus(s.peak_by_category, loss), "unsharded": root + sum(unsharded[i] for i in left),
                          "comm": root_grads + sum(grads[i] for i in left),
                          "gradients": -steady_grad_bytes})  # later ones
        if s.at == "end" and s.unit not in ("root", "loss"):
            done += 1
    best["optimizer"] = {"bytes": optimizer_temporaries, "by_category": {"optimizer_state": optimizer_temporaries}}
    return best


def _plus(cats: dict, more: dict) -> dict:
    out = {c: int(b) for c, b in cats.items() if c != "gradients"}
    for c, b in more.items():
        out[c] = out.get(c, 0) + int(b)
    return out
