"""FSDP1 hybrid sharding: ``HYBRID_SHARD`` (FULL_SHARD within a shard group) or ``_HYBRID_SHARD_ZERO2``
(SHARD_GRAD_OP within it), replicated across the groups.

FSDP takes a 2-D device mesh (replicate, shard) (``device_mesh=``: its shard dimension is the unit's process group,
its replicate dimension ``_inter_node_pg``); each FlatParameter is padded to a multiple of ``shard_size``, not of N.
After each unit's reduce_scatter in the shard group FSDP all-reduces the gradient shard across the replicas
(torch/distributed/fsdp/_runtime_utils.py ``_reduce_grad``). Formulas: :mod:`zeroexp.formulas.hybrid`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

from zeroexp._lib.modules import hybrid_shard_zero2
from zeroexp.errors import ConfigError
from zeroexp.strategies import register
from zeroexp.strategies._hybrid import check_shard_size, hybrid_mesh, mesh_dims
from zeroexp.strategies.fsdp import PREFETCH, FSDPAdapter
from zeroexp.cell.policy import CellPolicy
from zeroexp.cell.strategy import FSDPHybridConfig

#: ``strategy.sharding`` -> FSDP's strategy (its row ``fsdp_<sharding>`` holds the ZeRO stage within a shard group)
_SHARDINGS = {"HYBRID_SHARD": ShardingStrategy.HYBRID_SHARD, "_HYBRID_SHARD_ZERO2": hybrid_shard_zero2()}


@register
class FSDPHybridAdapter(FSDPAdapter):
    name = "fsdp_hybrid"
    schema = FSDPHybridConfig
    semantics = (
        "FSDP1 HYBRID_SHARD (_HYBRID_SHARD_ZERO2: SHARD_GRAD_OP) within each shard group of strategy.shard_size ranks, "
        "replicated across the N / shard_size groups: every kind of state N / shard_size times FULL_SHARD's "
        "(SHARD_GRAD_OP's); per unit all_gather and reduce_scatter in the shard group, all_reduce across replicas."
    )

    def __init__(self, policy: CellPolicy) -> None:
        super().__init__(policy)
        self.sharding = _SHARDINGS[str(self.config.sharding)]
        self._mesh: Any = None

    @classmethod
    def validate(cls, cfg) -> None:
        if str(cfg.strategy.get("sharding")) not in _SHARDINGS:
            raise ConfigError("strategy.sharding", cfg.strategy.get("sharding"), ", ".join(_SHARDINGS),
                              why="strategy=fsdp_hybrid shards within a group and replicates across groups")
        check_shard_size(cfg)
        super().validate(cfg)

    def setup(self, device: torch.device) -> None:
        """The 2-D device mesh (replicate, shard), before any model exists (a dry run fakes tensors after it)."""
        if self._mesh is None:
            self._mesh = hybrid_mesh(device, dist.get_world_size(), int(self.config.shard_size))

    def process_groups(self, device: torch.device) -> dict[str, Any]:
        self.setup(device)
        return {"device_mesh": self._mesh}

    def mesh_dims(self) -> dict[str, str]:
        return {} if self._mesh is None else mesh_dims(self._mesh)

    def backward_prefetch(self) -> BackwardPrefetch | None:
        return PREFETCH[self.policy.prefetch]

    def checkpoint_format(self, kind: str) -> str:
        """FSDPAdapter's save and load (bit-identical at N=4, shard_size=2, tests/test_hybrid_checkpoint.py); under a
        device mesh FSDP1's state dicts hold DTensors, so a sharded save writes each shard once, not per replica."""
        if kind == "full":
            return super().checkpoint_format(kind) + " (gathered within rank 0's shard group)"
        return ("SHARDED_STATE_DICT (DTensors on the (replicate, shard) mesh) through torch.distributed.checkpoint: a "
                "shard the replicas hold alike is written once, by one of them (DCP's deduplication), "
                "__<rank>_0.distcp; rank 0 the .metadata")
