"""Gradient accumulation (``grad_accum=K``): the probes see whole optimizer steps, not micro-batches.

With ``K > 1`` Lightning runs K training batches (micro-batches of ``batch_size`` each) per optimizer step
(``Trainer(accumulate_grad_batches=K)``): it scales the loss by 1/K once (the automatic optimization's closure),
steps the optimizer on the K-th, and wraps the first K-1 in the strategy's ``block_backward_sync``, which zeroexp's
``CellStrategy`` hands to the adapter (``StrategyAdapter.no_sync``). Every probe measures per step, keyed by
``batch_idx``: :class:`OptimizerSteps` forwards the probes' hooks so that step ``s`` starts at the first micro-batch
of the optimizer step (``on_train_batch_start(batch_idx=s)``) and ends after its last (``on_train_batch_end``), so a
probe's window, profile, timing or state read spans every micro-batch's collectives and the step itself. Other hooks
pass through as they come. A callback that needs the micro-batches inside a step (the memory probe: its phases are
per micro-batch) defines ``on_micro_batch_start(trainer, pl_module, batch, step, micro)``, called at the start of
every micro-batch after the first (``micro`` = 1 .. K-1).
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning.pytorch as pl

__all__ = ["OptimizerSteps"]


class OptimizerSteps(pl.Callback):
    """One callback in front of ``callbacks`` for ``grad_accum`` micro-batches per optimizer step."""

    def __init__(self, callbacks: Sequence[pl.Callback], grad_accum: int) -> None:
        self.callbacks, self.k = list(callbacks), int(grad_accum)
        self._loss: Any = None  # the step's loss: the sum of its micro-batches' losses, each already / K

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx % self.k == 0:
            for c in self.callbacks:
                c.on_train_batch_start(trainer, pl_module, batch, batch_idx // self.k)
            return
        for c in self.callbacks:
            hook = getattr(c, "on_micro_batch_start", None)
            if hook is not None:
                hook(trainer, pl_module, batch, batch_idx // self.k, batch_idx % self.k)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """At the step's last micro-batch, with ``outputs["loss"]`` the step's loss: the mean of its micro-batches'
        (Lightning returns each divided by K)."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            loss = loss.detach()
            self._loss = loss if batch_idx % self.k == 0 or self._loss is None else self._loss + loss
        if batch_idx % self.k == self.k - 1:
            step_outputs = {**outputs, "loss": self._loss} if isinstance(outputs, dict) else self._loss
            for c in self.callbacks:
                c.on_train_batch_end(trainer, pl_module, step_outputs, batch, batch_idx // self.k)


def _forward(hook: str) -> Any:
    def call(self: OptimizerSteps, *args: Any, **kwargs: Any) -> None:
        for c in self.callbacks:
            getattr(c, hook)(*args, **kwargs)

    call.__name__ = hook
    return call


for _hook in ("setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
              "on_train_epoch_start", "on_train_epoch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad", "on_exception"):
    setattr(OptimizerSteps, _hook, _forward(_hook))
