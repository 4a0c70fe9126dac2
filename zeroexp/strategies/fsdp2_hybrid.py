"""FSDP2 hybrid sharding (HSDP): ``fully_shard`` on a 2-D device mesh (replicate, shard), reshard_after_forward=True.

Each parameter is chunked on dim 0 over the mesh's shard dimension (padded to a multiple of ``shard_size`` rows)
and replicated over its replicate dimension. Per unit: its all_gathers and one reduce_scatter in the shard group,
then one all_reduce of the gradient shards across the replicas (_fully_shard/_fsdp_collectives.py
``foreach_reduce``, ``all_reduce_group``). Formulas: :mod:`zeroexp.formulas.hybrid`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import MISSING

from zeroexp.strategies import register
from zeroexp.strategies._hybrid import check_shard_size, hybrid_mesh, mesh_dims
from zeroexp.strategies.fsdp2 import FSDP2Adapter, FSDP2Config


@dataclass
class FSDP2HybridConfig(FSDP2Config):
    """``strategy=fsdp2_hybrid``: ``shard_size`` ranks per shard group (required, divides world_size)."""

    shard_size: int = MISSING


@register
class FSDP2HybridAdapter(FSDP2Adapter):
    name = "fsdp2_hybrid"
    schema = FSDP2HybridConfig
    axes = frozenset({"shard_size"})  # the cell's name: fsdp2_hybrid-shard_size2_...
    reshard_after_forward = True
    zero_stage = 3
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
            self._mesh = hybrid_mesh(device, dist.get_world_size(), int(self.scfg.shard_size))

    def mesh_dims(self) -> dict[str, str]:
        return {} if self._mesh is None else mesh_dims(self._mesh)
