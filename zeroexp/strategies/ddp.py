"""ZeRO-0: ``DistributedDataParallel`` with AdamW; parameters, gradients and moments replicated."""

from __future__ import annotations

from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zeroexp._lib.parallel import ddp_grad_buckets
from zeroexp.errors import ConfigError
from zeroexp.formulas import Groups, buffer_broadcasts
from zeroexp.strategies import register
from zeroexp.strategies.base import StrategyAdapter, buffer_record
from zeroexp.cell.strategy import DDPConfig


@register
class DDPAdapter(StrategyAdapter):
    name = "ddp"
    schema = DDPConfig
    semantics = "ZeRO-0 baseline: every rank holds the full parameters, gradients and Adam moments."
    #: Step 0 all-reduces every gradient in one bucket; the forward of step 1 rebuilds the buckets in
    #: gradient-ready order and broadcasts the new assignment from rank 0 (Reducer::rebuild_buckets, see
    #: torch/nn/parallel/distributed.py): the fingerprint is steady from step 2 on.
    min_warmup_steps = 2
    #: bf16 / fp16 by autocast (zeroexp.strategies._amp): parameters, gradients and moments stay fp32 (the fp32
    #: parameters are the master), matmuls run in the low precision; fp16 with a dynamic GradScaler. So the
    #: 2 + 2 + 12 bytes formula does not apply: the state is fp32 and its factors those of fp32 (semantics_for).

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        """CellStrategy, with Lightning's autocast plugin for bf16 / fp16 (and a GradScaler for fp16)."""
        from zeroexp.strategies._amp import amp_precision

        strategy = super().lightning_strategy(timeout_s, backend)
        plugin = amp_precision(self.policy.precision, backend)
        if plugin is not None:
            strategy.precision_plugin = plugin
        return strategy

    @classmethod
    def validate_model(cls, cfg: Any, shape: Any = None) -> None:
        """Refuse ``strategy.find_unused_parameters=false`` for a model whose step leaves trainable parameters
        without a gradient (found from the meta-device step before launch): DDP's reducer would wait for their
        gradients and fail in the ranks."""
        if cfg.strategy.get("find_unused_parameters") is not False:
            return
        from zeroexp.models import unused_parameters

        unused = unused_parameters(cfg.model)
        if unused:
            raise ConfigError("strategy.find_unused_parameters", False, "true or null (found from the model)",
                              why=f"{len(unused)} trainable parameter(s) get no gradient in a step "
                                  f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''})")

    def find_unused(self) -> bool:
        """``strategy.find_unused_parameters``, or, when null, whether the model's meta-device step leaves a trainable
        parameter without a gradient (``CellPolicy.ungraded``, read before launch; else read here)."""
        value = self.config.find_unused_parameters
        if value is None:
            value = self.policy.ungraded
        if value is None:  # not read before launch
            from zeroexp.models import unused_parameters

            value = bool(unused_parameters(self.policy.model))
        return bool(value)

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        return DistributedDataParallel(
            module,
            device_ids=None if device.type == "cpu" else [device.index],
            bucket_cap_mb=float(self.config.bucket_cap_mb),
            gradient_as_bucket_view=bool(self.config.gradient_as_bucket_view),
            find_unused_parameters=self.find_unused(),
        )

    checkpoint_kinds = frozenset({"full", "sharded"})
    moved_kinds = frozenset({"full", "sharded"})

    def settle_restored(self, model: nn.Module, loss_fn: Any, batch: torch.Tensor) -> None:
        """DDP's Reducer buckets the gradients in reverse parameter order until its first backward, then rebuilds
        its buckets in the order the gradients became ready (at the next forward), so a freshly wrapped model's first
        step reduces in another bucket layout than the trained model's; at N >= 3 gloo's ring then sums some elements
        in another rank order, and the two steps differ by rounding. One forward and backward with every module in
        eval mode (no BatchNorm statistic moves), its gradients dropped and no optimizer step, gives the restored
        model the trained one's layout; its parameters and optimizer state are untouched."""
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.enable_grad():
                loss_fn(model(batch), batch).backward()
        finally:
            for m, training in modes:
                m.train(training)
        model.zero_grad(set_to_none=True)

    def checkpoint_format(self, kind: str) -> str:
        if kind == "full":
            return "get_state_dict(full_state_dict, cpu_offload): rank 0 writes its replicated state to one file"
        return ("torch.distributed.checkpoint of the replicated state: the planner deduplicates each tensor "
                "and spreads the writes over the ranks (__<rank>_0.distcp, .metadata)")

    def full_parameters(self, model: nn.Module) -> ContextManager[dict[str, torch.Tensor]]:
        """Every rank holds the full parameters: those of the module DDP wraps, without DDP's ``module.``."""
        return super().full_parameters(model.module if isinstance(model, DistributedDataParallel) else model)

    def gradient_buckets(self, model: nn.Module) -> tuple[tuple[int, ...], ...]:
        """DDP's gradient buckets as its Reducer holds them now (rebuilt after the first step in gradient-ready
        order, ``Reducer::rebuild_buckets``): each bucket's parameters' numels, in bucket order."""
        if not isinstance(model, DistributedDataParallel):
            raise NotImplementedError("the model is not wrapped in DistributedDataParallel: no buckets to read")
        return tuple(tuple(p.numel() for p in bucket.parameters())
                     for bucket in ddp_grad_buckets(model))

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """Replicated state; one all_reduce per live gradient bucket; with ``broadcast_buffers`` (DDP's default) rank
        0's buffers broadcast before each forward, coalesced by dtype."""
        module = model.module if isinstance(model, DistributedDataParallel) else model
        numels = tuple(p.numel() for p in self.trainable(module.parameters()))
        frozen = tuple(p.numel() for p in module.parameters() if not p.requires_grad)
        buffers = buffer_record(module)
        broadcasts = buffer_broadcasts(buffers, model.broadcast_bucket_size) \
            if getattr(model, "broadcast_buffers", False) else ()
        trained = self.trainable(module.parameters())
        ungraded = tuple(i for i, p in enumerate(trained) if p.grad is None)  # read after a step's backward
        used_map = 4 * len(trained) if getattr(model, "find_unused_parameters", False) else 0
        return Groups(self.layout, dist.get_world_size(), numels, buckets=self.gradient_buckets(model), frozen=frozen,
                      buffers=buffers, buffer_broadcasts=broadcasts, ungraded=ungraded, used_map_bytes=used_map)
