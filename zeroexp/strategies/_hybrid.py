"""What the hybrid-sharding adapters share: ``strategy.shard_size`` and the 2-D device mesh (replicate, shard).

Rank r is shard r % shard_size of replica r // shard_size (``init_device_mesh`` row-major), as
:mod:`zeroexp.formulas.hybrid` models it; on a cluster a shard group is the GPUs of one node.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from zeroexp.errors import ConfigError
from zeroexp.formulas import MESH_DIMS

__all__ = ["check_shard_size", "hybrid_mesh", "mesh_dims"]


def check_shard_size(cfg: DictConfig) -> int:
    """``strategy.shard_size``: required, a divisor of ``world_size`` strictly between 1 and it; ConfigError naming it
    otherwise (before any rank starts)."""
    n = int(cfg.world_size)
    value = None if OmegaConf.is_missing(cfg.strategy, "shard_size") else cfg.strategy.get("shard_size")
    divisors = [d for d in range(2, n) if n % d == 0]
    accepted = (f"a divisor of world_size={n} strictly between 1 and {n}: {', '.join(map(str, divisors))}"
                if divisors else f"none at world_size={n} (hybrid sharding needs at least 2 replicas of 2 ranks)")
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("strategy.shard_size", value, accepted,
                          why="required: the ranks of one shard group (on a cluster, the GPUs of one node)")
    if value not in divisors:
        why = ("shard_size=world_size is one replica: strategy=fsdp_full / fsdp2_full" if value == n else
               "shard_size=1 shards nothing: strategy=ddp" if value == 1 else
               f"world_size={n} must be shard_size x replicas")
        raise ConfigError("strategy.shard_size", value, accepted, why=why)
    return value


def hybrid_mesh(device: torch.device, world_size: int, shard_size: int) -> Any:
    """The 2-D device mesh (replicate, shard) over the default group, on the rank's device type (``cpu``: gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // shard_size, shard_size), mesh_dim_names=MESH_DIMS)


def mesh_dims(mesh: Any) -> dict[str, str]:
    """``{process group name: mesh dimension}`` of this rank's groups of ``mesh``."""
    return {mesh.get_group(dim).group_name: dim for dim in MESH_DIMS}
