"""ZeRO-0: ``DistributedDataParallel`` with AdamW; parameters, gradients and moments replicated."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeroexp.formulas import ddp_collectives
from zeroexp.strategies import register
from zeroexp.strategies._checkpoint import load_full, load_sharded, save_full, save_sharded
from zeroexp.strategies.base import StrategyAdapter


@register
class DDPAdapter(StrategyAdapter):
    name = "ddp"
    semantics = "ZeRO-0 baseline: every rank holds the full parameters, gradients and Adam moments."
    zero_stage = 0
    #: Step 0 all-reduces every gradient in one bucket; the forward of step 1 rebuilds the buckets in
    #: gradient-ready order and broadcasts the new assignment from rank 0 (Reducer::rebuild_buckets, see
    #: torch/nn/parallel/distributed.py): the fingerprint is steady from step 2 on.
    min_warmup_steps = 2
    #: bf16 / fp16 by autocast (zeroexp.strategies._amp): parameters, gradients and moments stay fp32 (the fp32
    #: parameters are the master), matmuls run in the low precision; fp16 with a dynamic GradScaler. So the
    #: 2 + 2 + 12 bytes formula does not apply: the state is fp32 and its factors those of fp32 (semantics_for).
    precisions = frozenset({"fp32", "bf16", "fp16"})

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        """CellStrategy, with Lightning's autocast plugin for bf16 / fp16 (and a GradScaler for fp16)."""
        from zeroexp.strategies._amp import amp_precision

        strategy = super().lightning_strategy(timeout_s, backend)
        plugin = amp_precision(self.cfg, backend)
        if plugin is not None:
            strategy.precision_plugin = plugin
        return strategy

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        return DistributedDataParallel(
            module,
            device_ids=None if device.type == "cpu" else [device.index],
            bucket_cap_mb=float(self.scfg.bucket_cap_mb),
            gradient_as_bucket_view=bool(self.scfg.gradient_as_bucket_view),
        )

    checkpoint_kinds = frozenset({"full", "sharded"})

    def checkpoint_format(self, kind: str) -> str:
        if kind == "full":
            return "get_state_dict(full_state_dict, cpu_offload): rank 0 writes its replicated state to one file"
        return ("torch.distributed.checkpoint of the replicated state: the planner deduplicates each tensor "
                "and spreads the writes over the ranks (__<rank>_0.distcp, .metadata)")

    def save_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
        """full: rank 0 writes the state it already holds (no gather needed); sharded: DCP (zeroexp.strategies._checkpoint)."""
        return (save_full if kind == "full" else save_sharded)(path, model, optimizer)

    def load_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        (load_full if kind == "full" else load_sharded)(path, model, optimizer)

    def full_parameters(self, model: nn.Module) -> ContextManager[dict[str, torch.Tensor]]:
        """Every rank holds the full parameters: those of the module DDP wraps, without DDP's ``module.``."""
        return super().full_parameters(model.module if isinstance(model, DistributedDataParallel) else model)

    def gradient_bucket_bytes(self, model: nn.Module) -> list[int]:
        """Bytes of each steady gradient bucket, as DDP's Reducer rebuilds them after the first step.

        Parameters are bucketed in gradient-ready order, approximated (as DDP itself does for its initial
        buckets) by reverse definition order; ``bucket_cap_mb`` is passed explicitly, so DDP uses it for the
        first bucket too (``_BucketCapacityConfig``), not its 1 MiB first-bucket default.
        """
        module = model.module if isinstance(model, DistributedDataParallel) else model
        ready = [p for p in module.parameters() if p.requires_grad][::-1]
        cap = int(float(self.scfg.bucket_cap_mb) * 1024 * 1024)
        buckets, _ = dist._compute_bucket_assignment_by_size(ready, [cap, cap])
        return [sum(ready[i].numel() * ready[i].element_size() for i in bucket) for bucket in buckets]

    def expected_collectives(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             world_size: int) -> dict[str, dict[str, int]]:
        """One gradient all_reduce per bucket (zeroexp.formulas.ddp_collectives)."""
        return ddp_collectives(self.gradient_bucket_bytes(model))
