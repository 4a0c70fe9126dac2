"""The one training loop of zeroexp: a cell's Lightning ``Trainer`` with its probes, for a rank of a real run and
for the rank a dry run plays (zeroexp.rank.dryrun), so both measure the same steps the same way."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import lightning.pytorch as pl

from zeroexp.models.module import CellModule, cell_trainer


def fit_cell(ctx: Any, module: CellModule, batches: Iterable[Any], callbacks: Sequence[pl.Callback], *, steps: int,
             per_batch: Sequence[pl.Callback] = (), logger: Any = False, root: str | None = None, devices: int = 1,
             num_nodes: int = 1, backend: str = "gloo") -> pl.Trainer:
    """Train ``module`` for ``steps`` optimizer steps of ``grad_accum`` micro-batches each (``batches``: an
    iterable of the micro-batches, a ``DataLoader`` in a real run) under the adapter's Lightning strategy
    (``ctx.adapter.lightning_strategy``), ``callbacks`` seeing whole optimizer steps (zeroexp.rank.microbatches),
    ``per_batch`` Lightning's own batches; return the trainer."""
    accum = ctx.cell.grad_accum
    callbacks = list(callbacks)
    if accum > 1:  # the probes (and the rest) see optimizer steps, each spanning its micro-batches
        from zeroexp.rank.microbatches import OptimizerSteps

        callbacks = [OptimizerSteps(callbacks, accum)]
    callbacks += list(per_batch)
    trainer = cell_trainer(
        accelerator="gpu" if ctx.device.type == "cuda" else "cpu", devices=devices, num_nodes=num_nodes,
        strategy=ctx.adapter.lightning_strategy(ctx.cfg.timeout.collective_s, backend),
        precision="32-true", max_steps=steps, accumulate_grad_batches=accum, logger=logger,
        callbacks=callbacks, default_root_dir=root,
    )
    trainer.fit(module, train_dataloaders=batches)
    return trainer


def make_logger(cfg: Any, cell: Any) -> Any:
    """Rank 0's Lightning logger: a CSV logger for ``logger=csv``; False otherwise (``logger=wandb``: the launching
    process logs the cell's W&B run once its ranks are done, zeroexp.launch.wandb_cell)."""
    if cfg.logger.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(cell), name="csv", version="")
    return False
