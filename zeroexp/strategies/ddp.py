"""ZeRO-0: ``DistributedDataParallel`` with AdamW; parameters, gradients and moments replicated."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeroexp.strategies import register
from zeroexp.strategies.base import StrategyAdapter


@register
class DDPAdapter(StrategyAdapter):
    name = "ddp"
    semantics = "ZeRO-0 baseline: every rank holds the full parameters, gradients and Adam moments."

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        return DistributedDataParallel(
            module,
            device_ids=None if device.type == "cpu" else [device.index],
            bucket_cap_mb=float(self.scfg.bucket_cap_mb),
            gradient_as_bucket_view=bool(self.scfg.gradient_as_bucket_view),
        )
