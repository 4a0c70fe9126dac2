"""What every strategy adapter provides, and the one Lightning strategy that runs them all.

Lightning's own ``FSDPStrategy`` refuses a CPU accelerator and passes no CPU device to FSDP, so zeroexp runs
every strategy through :class:`CellStrategy`, a ``DDPStrategy`` (process group, ranks, barriers, the forward
redirection to ``training_step``) whose wrapping step is delegated to the adapter. The process group backend
follows the device: gloo on CPU, NCCL on CUDA (one GPU per rank).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Iterable

import torch
from omegaconf import DictConfig
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class StrategyAdapter:
    """One data-parallel strategy: how to wrap the model and build the optimizer, and what it claims.

    Subclasses set ``name`` (the ``strategy=`` option) and ``axes`` (the optional cell axes that apply to
    it, e.g. ``{"prefetch"}``); only those axes enter the cell's identity.
    """

    name: ClassVar[str]
    axes: ClassVar[frozenset[str]] = frozenset()
    #: One sentence: which ZeRO semantics the strategy follows (reported beside the measurements).
    semantics: ClassVar[str] = ""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.scfg = cfg.strategy

    @classmethod
    def validate(cls, cfg: DictConfig) -> None:
        """Refuse settings this strategy cannot run (raise ``zeroexp.config.ConfigError``)."""

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """Wrap the LightningModule (already on ``device``) for training; called on every rank."""
        raise NotImplementedError

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over the wrapped module's parameters (AdamW unless the strategy shards it)."""
        return torch.optim.AdamW(params, **self.optimizer_kwargs())

    def optimizer_kwargs(self) -> dict[str, Any]:
        o = self.cfg.optimizer
        return {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}

    def lightning_strategy(self, timeout_s: float, backend: str) -> "CellStrategy":
        """The Lightning strategy that runs this adapter."""
        return CellStrategy(adapter=self, timeout=timedelta(seconds=timeout_s), process_group_backend=backend)


class CellStrategy(DDPStrategy):
    """``DDPStrategy`` whose model wrapping is the adapter's (DDP, FSDP, ...)."""

    strategy_name = "zeroexp_cell"

    def __init__(self, adapter: StrategyAdapter, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.adapter = adapter

    def configure_ddp(self) -> None:
        self.model = self.adapter.wrap(self.model, self.root_device)
        if isinstance(self.model, DistributedDataParallel):
            self._register_ddp_hooks()
