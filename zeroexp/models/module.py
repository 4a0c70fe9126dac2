"""The LightningModule that trains any ``nn.Module`` of a cell on its seeded synthetic batches."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Mapping

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

from zeroexp.models import LOSSES, make_batch


class CellModule(pl.LightningModule):
    """``net`` + the model config's loss + the strategy adapter's optimizer and gradient clipping."""

    def __init__(self, net: nn.Module, loss: str, optimizer_factory: Callable[[Iterable[nn.Parameter]], Any],
                 clip_gradients: Callable[[nn.Module], None] | None = None, log_loss: bool = True) -> None:
        super().__init__()
        self.log_loss = log_loss  # Cell.logs_loss; False in a dry run (a fake loss has no value to log)
        self.net = net
        self.loss_fn = LOSSES[loss]
        self.optimizer_factory = optimizer_factory
        self.clip_gradients = clip_gradients

    def forward(self, batch: torch.Tensor) -> Any:
        return self.net(batch)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.loss_fn(self.net(batch), batch)
        if self.log_loss:  # rank-local, logged by rank 0 only; no sync_dist (an all_reduce every step)
            self.log("train/loss_rank0", loss.detach(), on_step=True, prog_bar=False, logger=True)
        return loss

    def configure_optimizers(self) -> Any:
        return self.optimizer_factory([p for p in self.parameters() if p.requires_grad])  # as a user passes them

    def cpu(self) -> "CellModule":
        """Nothing to move when every parameter and buffer is on the CPU already (Lightning's teardown calls it):
        torch would still swap each parameter with itself, which fails for a tensor something else references
        weakly (fake tensors in a dry run, FSDP2's DTensors)."""
        if all(t.device.type == "cpu" for t in itertools.chain(self.parameters(), self.buffers())):
            return self
        return super().cpu()

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        """Lightning's hook between backward (fp16: after unscaling) and the optimizer step: the adapter clips the
        wrapped model's gradients (``StrategyAdapter.clip_gradients``); the Trainer's own clipping stays off."""
        if self.clip_gradients is not None:
            self.clip_gradients(self.trainer.strategy.model)


class SyntheticBatches(Dataset):
    """``steps`` batches for one rank; item ``i`` is :func:`zeroexp.models.make_batch` at step ``start + i`` (with
    ``grad_accum=K``: ``steps`` x K micro-batches, item ``s * K + k`` the k-th of optimizer step s; ``start``: the
    micro-batches a run resumed from a checkpoint has already trained, ``Cell.first_step`` x K)."""

    def __init__(self, model_cfg: Mapping[str, Any], batch_size: int, seed: int, rank: int, steps: int,
                 start: int = 0) -> None:
        self.model_cfg, self.batch_size, self.seed, self.rank, self.steps = model_cfg, batch_size, seed, rank, steps
        self.start = start

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> torch.Tensor:
        return make_batch(self.model_cfg, self.batch_size, self.seed, self.start + step, self.rank)


def cell_trainer(**settings: Any) -> pl.Trainer:
    """The one Lightning ``Trainer`` of zeroexp (a cell's ranks, the calibration's framework run): one epoch of
    ``max_steps``, none of Lightning's own checkpoints, progress bar, model summary, sanity or validation steps, or
    distributed sampler (the batches are zeroexp's own), a metric every step; and no SIGTERM flag broadcast before each
    step (zeroexp._lib.trainer: not the strategy's traffic, and the launcher ends ranks itself). ``settings``: the
    rest (accelerator, devices, strategy, callbacks, logger...)."""
    from zeroexp._lib.trainer import skip_sigterm_broadcast

    trainer = pl.Trainer(max_epochs=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1,
                         use_distributed_sampler=False, **settings)
    skip_sigterm_broadcast(trainer)
    return trainer
