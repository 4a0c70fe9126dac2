"""ZeRO-1 direction in PyTorch: DDP gradients plus ``ZeroRedundancyOptimizer`` (optimizer state by owner).

Each rank updates only the parameters it owns and then broadcasts them (ZeroRedundancyOptimizer docstring:
"each rank is only responsible for updating approximately 1 / world_size parameters and broadcasts those
parameters after each update"); see Rajbhandari et al., ZeRO, arXiv:1910.02054, section 5.1 (P_os).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from zeroexp.strategies import register
from zeroexp.strategies.ddp import DDPAdapter


@register
class ZROAdapter(DDPAdapter):
    name = "zro"
    semantics = (
        "ZeRO-1 (P_os): parameters and gradients replicated, Adam moments only on the owning rank; "
        "owners broadcast their updated parameters after the step."
    )

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(
            list(params),
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=bool(self.scfg.parameters_as_bucket_view),
            **self.optimizer_kwargs(),
        )
