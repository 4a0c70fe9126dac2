"""FSDP's units: the payload over them (FULL_SHARD, SHARD_GRAD_OP, FSDP2), what each unit gathers and reduces per
step [FSDP] [FSDP2] [ZeRO 7.2.2] (hybrid sharding's is :mod:`zeroexp.formulas.hybrid`), and what FSDP2's reshard to
a smaller group after forward holds at once (:func:`post_forward_bump`)."""

from __future__ import annotations

from typing import Callable

from zeroexp.formulas.paper import Collectives, add_collectives, clip_norm_all_reduces, collectives_of, fp16_inf_syncs
from zeroexp.formulas.shapes import POST_FORWARD, WORLD, Groups, PlanKnobs

__all__ = ["Payload", "gather_units", "post_forward_bump"]

#: A row's payload model: (groups, the wire's bytes per element, knobs) -> one rank's collectives per step.
Payload = Callable[[Groups, int, PlanKnobs], Collectives]

def gather_units(dtensor_grads: bool = False, kept_under_no_sync: bool = False) -> Payload:
    """FSDP [ZeRO 7.2.2]: per unit of padded bytes b, its all_gathers S = b (two when resharded after forward) and one
    reduce_scatter S = b; fp16 adds the loss scaler's found_inf all_reduces (:func:`fp16_inf_syncs`); clipping one
    fp32 all_reduce of the norms: FSDP1's ``clip_grad_norm_`` sums the squared norm of the rank's shards (4 bytes);
    FSDP2's ``get_total_norm`` stacks one partial norm per gradient DTensor, made whole by one all_reduce (4 bytes
    each). ``grad_accum=K``: every micro-batch gathers its units again (FSDP1 SHARD_GRAD_OP under ``no_sync``,
    ``kept_under_no_sync``, keeps them unsharded to the step's last instead: once per step); the gradients are
    reduce-scattered once per step under ``no_sync``, every micro-batch with ``strategy.sync_each_microbatch``;
    FSDP2's (``dtensor_grads``) in its ``reduce_dtype`` where set (:meth:`PlanKnobs.reduce_itemsize`); with
    ``Groups.post_forward_size`` its all_gathers by group: the world's, and the post-forward group's."""
    def payload(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
        k, each = knobs.micro_batches, knobs.sync_each_microbatch
        r = knobs.reduce_itemsize(c) if dtensor_grads else c  # FSDP2's reduce_dtype; FSDP1 reduces in c
        syncs = fp16_inf_syncs(dtensor_grads) if knobs.loss_scaling else 0
        norms = clip_norm_all_reduces(len(g.numels), dtensor_grads) if knobs.clipping else []
        gathered, narrow = (1 if kept_under_no_sync and not each else k), g.post_forward_size
        model = collectives_of(all_gather=[] if narrow else [u.numel * c for u in g.units
                                                            for _ in range(u.gathers * gathered)],
                               reduce_scatter=[u.scattered * r for u in g.units if u.scattered] * (k if each else 1),
                               all_reduce=[4] * syncs + norms)
        for group, gathers in (((WORLD, g.world_size), lambda u: u.gathers - u.post_forward),
                               ((POST_FORWARD, narrow), lambda u: u.post_forward)) if narrow else ():
            add_collectives(model, "all_gather", [u.numel * c for u in g.units for _ in range(gathers(u) * gathered)],
                            group)  # FSDP2 reshard_after_forward=k: a unit's gathers by group (Unit.post_forward)
        return model
    return payload


def post_forward_bump(params: tuple[int, ...], k: int) -> int:
    """The most bytes above a unit's unsharded parameters while FSDP2 reshards it to ``k`` ranks after forward, one
    parameter after another: its 1/k cloned (``to_sharded_post_forward``), then its unsharded storage freed."""
    best = run = 0
    for b in params:
        best, run = max(best, run + b // k), run + b // k - b
    return best
