"""Hybrid sharding (HSDP): shard within a group of ``shard_size`` ranks, replicate across the N / shard_size groups.

The ranks form a 2-D device mesh (replicate, shard): rank r is shard r % shard_size of replica r // shard_size.
Every buffer is padded to and sharded over the shard group (:class:`~zeroexp.formulas.layout.Groups`
``shard_size``), so each replica holds one sharded copy of the state: the aggregate factors are N / shard_size
times FULL_SHARD's (SHARD_GRAD_OP's for the ZeRO-2 variant). Per unit and step: its all_gathers and one
reduce_scatter within the shard group, then one all_reduce of the reduced gradient shard across the replicas
(torch/distributed/fsdp/_runtime_utils.py ``_reduce_grad``: ``dist.all_reduce(..., group=state._inter_node_pg)``;
FSDP2 _fully_shard/_fsdp_collectives.py ``foreach_reduce``: ``all_reduce_group``).
"""

from __future__ import annotations

from zeroexp.formulas.layout import Groups, Payload, PlanKnobs
from zeroexp.formulas.paper import Collectives, add_collectives, clip_norm_all_reduces, fp16_inf_syncs
from zeroexp.formulas.shapes import WORLD

__all__ = ["MESH_DIMS", "WORLD", "hybrid_units"]

#: The 2-D device mesh's dimension names, outer first: ``init_device_mesh(type, (N / shard_size, shard_size),
#: mesh_dim_names=MESH_DIMS)``; ``WORLD`` (:mod:`zeroexp.formulas.shapes`) names the default group.
MESH_DIMS = ("replicate", "shard")


def hybrid_units(dtensor_grads: bool = False, kept_under_no_sync: bool = False) -> Payload:
    """HSDP [FSDP, FSDP2]: per unit of b padded bytes (padded to shard_size), its all_gathers S = b and one
    reduce_scatter S = b over the shard group, one all_reduce S = b / shard_size (the gradient shard) over the
    replicate group (both in FSDP2's ``reduce_dtype`` where set); fp16 adds the loss scaler's found_inf all_reduce
    over the world and, with DTensor gradients (FSDP2), DTensor's own over the shard group (:func:`fp16_inf_syncs`);
    clipping one norm all_reduce over the shard group (:func:`clip_norm_all_reduces`). ``grad_accum=K``: as FSDP's
    (:func:`~zeroexp.formulas.layout.gather_units`), every micro-batch gathers its units again
    (``kept_under_no_sync``, _HYBRID_SHARD_ZERO2 under ``no_sync``: once per step); the gradients are
    reduce-scattered and all-reduced once per step under ``no_sync``, every micro-batch with
    ``strategy.sync_each_microbatch``."""
    def payload(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
        s, k, each = g.shard_over, knobs.micro_batches, knobs.sync_each_microbatch
        r = knobs.reduce_itemsize(c) if dtensor_grads else c  # FSDP2's reduce_dtype; FSDP1 reduces in c
        shard, replicate = (MESH_DIMS[1], s), (MESH_DIMS[0], g.world_size // s)
        gathered, reduced = (1 if kept_under_no_sync and not each else k), (k if each else 1)
        model: Collectives = {}
        add_collectives(model, "all_gather", [u.numel * c for u in g.units for _ in range(u.gathers * gathered)],
                        shard)
        add_collectives(model, "reduce_scatter", [u.scattered * r for u in g.units if u.scattered] * reduced, shard)
        add_collectives(model, "all_reduce", [u.scattered // s * r for u in g.units if u.scattered] * reduced,
                        replicate)
        syncs = fp16_inf_syncs(dtensor_grads) if knobs.loss_scaling else 0
        # ShardedGradScaler's found_inf over the world; DTensor's own inf check (FSDP2) over the gradients' Partial
        # dimension, the shard group (torch/distributed/tensor/_dispatch.py found_inf_reduce_handler)
        add_collectives(model, "all_reduce", [4] * min(syncs, 1), (WORLD, g.world_size))
        add_collectives(model, "all_reduce", [4] * (syncs - 1), shard)
        # clipping: FSDP1's clip_grad_norm_ all-reduces its squared shard norm over its process group, the shard
        # group; FSDP2's get_total_norm(...).full_tensor() the stacked partial norms, one per gradient, over the same
        norms = clip_norm_all_reduces(len(g.numels), dtensor_grads) if knobs.clipping else []
        return add_collectives(model, "all_reduce", norms, shard)
    return payload
