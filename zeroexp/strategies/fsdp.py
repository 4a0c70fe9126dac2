"""FSDP1 (``FullyShardedDataParallel``): SHARD_GRAD_OP and FULL_SHARD, one unit per wrapped module class.

FSDP flattens each unit's parameters into a FlatParameter, pads it to a multiple of the world size and keeps
one shard per rank (torch/distributed/fsdp/_flat_param.py). SHARD_GRAD_OP keeps the unsharded parameters from
forward until the end of backward; FULL_SHARD frees them after forward and all-gathers again in backward,
where ``BackwardPrefetch`` decides when the next unit's all-gather is issued.
On CPU, FSDP runs with gloo when given ``device_id=torch.device("cpu")``.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from zeroexp.strategies import register
from zeroexp.strategies.base import StrategyAdapter

_PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


def _import_class(path: str) -> type:
    module, _, attr = path.rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"strategy.wrap entry {path!r} is not an nn.Module class")
    return cls


class FSDPAdapter(StrategyAdapter):
    """Shared FSDP1 wrapping; subclasses fix the sharding strategy."""

    sharding: ShardingStrategy

    @classmethod
    def validate(cls, cfg) -> None:
        from zeroexp.config import ConfigError

        for i, path in enumerate(cfg.strategy.wrap):
            try:
                _import_class(str(path))
            except (ImportError, AttributeError, ValueError, TypeError) as e:
                raise ConfigError(f"strategy.wrap[{i}]", path, "import paths of nn.Module classes", why=str(e)) from e

    def backward_prefetch(self) -> BackwardPrefetch | None:
        return None

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        classes = {_import_class(str(p)) for p in self.scfg.wrap}
        return FullyShardedDataParallel(
            module,
            sharding_strategy=self.sharding,
            auto_wrap_policy=ModuleWrapPolicy(classes),
            backward_prefetch=self.backward_prefetch(),
            forward_prefetch=bool(self.scfg.forward_prefetch),
            limit_all_gathers=bool(self.scfg.limit_all_gathers),
            use_orig_params=bool(self.scfg.use_orig_params),
            device_id=device if device.type == "cpu" else device.index,
        )


@register
class FSDPGradOpAdapter(FSDPAdapter):
    name = "fsdp_grad_op"
    sharding = ShardingStrategy.SHARD_GRAD_OP
    semantics = (
        "FSDP SHARD_GRAD_OP: gradients and optimizer state sharded; parameters sharded outside computation "
        "(resharded after backward), so at the optimizer boundary the parameter factor is 1, unlike canonical "
        "ZeRO-2 which keeps parameters replicated."
    )


@register
class FSDPFullAdapter(FSDPAdapter):
    name = "fsdp_full"
    axes = frozenset({"prefetch"})
    sharding = ShardingStrategy.FULL_SHARD
    semantics = (
        "FSDP FULL_SHARD (ZeRO-3 direction): parameters, gradients and optimizer state sharded; each unit is "
        "all-gathered before forward and again before backward."
    )

    def backward_prefetch(self) -> BackwardPrefetch | None:
        return _PREFETCH[self.cfg.prefetch.name]
