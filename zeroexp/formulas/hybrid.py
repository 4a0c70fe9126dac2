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

from zeroexp.formulas.shapes import WORLD

__all__ = ["MESH_DIMS", "WORLD"]

#: The 2-D device mesh's dimension names, outer first: ``init_device_mesh(type, (N / shard_size, shard_size),
#: mesh_dim_names=MESH_DIMS)``; ``WORLD`` (:mod:`zeroexp.formulas.shapes`) names the default group.
MESH_DIMS = ("replicate", "shard")
