"""FSDP2 hybrid sharding (HSDP): ``fully_shard`` on a 2-D device mesh (replicate, shard), reshard_after_forward=True.

Each parameter is chunked on dim 0 over the mesh's shard dimension (padded to a multiple of ``shard_size`` rows)
and replicated over its replicate dimension. Per unit: its all_gathers and one reduce_scatter in the shard group,
then one all_reduce of the gradient shards across the replicas (_fully_shard/_fsdp_collectives.py
``foreach_reduce``, ``all_reduce_group``). Formulas: :mod:`zeroexp.formulas.hybrid`.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from zeroexp.strategies import register
from zeroexp.strategies._hybrid import check_shard_size, hybrid_mesh, mesh_dims
from zeroexp.strategies.fsdp2 import FSDP2Adapter
from zeroexp.cell.strategy import FSDP2HybridConfig


@register
class FSDP2HybridAdapter(FSDP2Adapter):
    name = "fsdp2_hybrid"
    schema = FSDP2HybridConfig
    reshard_after_forward = True
    checkpoint_kinds = frozenset({"full", "sharded"})
    semantics = (
        "FSDP2 fully_shard on a 2-D mesh (replicate, shard), reshard_after_forward=True: FULL_SHARD's state within "
        "each shard group of strategy.shard_size ranks, replicated across the N / shard_size groups; per unit "
        "all_gather and reduce_scatter in the shard group, all_reduce across the replicas."
    )

    @classmethod
    def validate(cls, cfg) -> None:
        check_shard_size(cfg)
        super().validate(cfg)

    def setup(self, device: torch.device) -> None:
        """The 2-D device mesh (replicate, shard) over the default group, on the rank's device type."""
        if self._mesh is None:
            self._mesh = hybrid_mesh(device, dist.get_world_size(), int(self.config.shard_size))

    def mesh_dims(self) -> dict[str, str]:
        return {} if self._mesh is None else mesh_dims(self._mesh)

    def checkpoint_format(self, kind: str) -> str:
        if kind == "full":
            return ("get_state_dict(full_state_dict, cpu_offload): every DTensor made whole (all-gathered over the "
                    "shard group), rank 0 writes model and optimizer state to one file")
        return ("torch.distributed.checkpoint of the DTensor state dict (get_state_dict): "
                "a shard the replicas hold alike "
                "is written once, by one of them (DCP's deduplication), __<rank>_0.distcp; rank 0 the .metadata")
