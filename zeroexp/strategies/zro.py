"""ZeRO-1 direction in PyTorch: DDP gradients plus ``ZeroRedundancyOptimizer`` (optimizer state by owner).

Each rank updates only the parameters it owns and then broadcasts them (ZeroRedundancyOptimizer docstring:
"each rank is only responsible for updating approximately 1 / world_size parameters and broadcasts those
parameters after each update"); see Rajbhandari et al., ZeRO, arXiv:1910.02054, section 5.1 (P_os).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from zeroexp.formulas import zero1_collectives
from zeroexp.strategies import register
from zeroexp.strategies.base import StateTensor
from zeroexp.strategies.ddp import DDPAdapter


@register
class ZROAdapter(DDPAdapter):
    name = "zro"
    semantics = (
        "ZeRO-1 (P_os): parameters and gradients replicated, Adam moments only on the owning rank; "
        "owners broadcast their updated parameters after the step."
    )
    zero_stage = 1

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """Replicated parameters and gradients, and only the owned moments: the wrapped local optimizer's state.

        ``ZeroRedundancyOptimizer.state`` itself stays empty; the owner state lives in ``optimizer.optim``.
        """
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        yield from super().state_tensors(model, local)

    def expected_collectives(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             world_size: int) -> dict[str, dict[str, int]]:
        """DDP's bucket all_reduces, then the owners' broadcasts as the optimizer partitioned them.

        ``ZeroRedundancyOptimizer._broadcast_params_from_rank``: one broadcast per owned parameter, or with
        ``parameters_as_bucket_view`` one per (device, owner) bucket, empty buckets included.
        """
        if optimizer.parameters_as_bucket_view:
            sent = [b.numel() * b.element_size() for device_buckets in optimizer._buckets for b in device_buckets]
        else:
            sent = [p.numel() * p.element_size() for owned in optimizer._partition_parameters()
                    for group in owned for p in group["params"]]
        return zero1_collectives(self.gradient_bucket_bytes(model), sent)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(
            list(params),
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=bool(self.scfg.parameters_as_bucket_view),
            **self.optimizer_kwargs(),
        )
