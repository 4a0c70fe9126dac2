"""The one Lightning strategy that runs every adapter (imported only inside a rank: Lightning is heavy)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from zeroexp._lib.parallel import register_ddp_hooks


class CellStrategy(DDPStrategy):
    """``DDPStrategy`` whose model wrapping is the adapter's (DDP, FSDP, ...).

    ``DDPStrategy.setup`` moves the LightningModule to the device, calls :meth:`configure_ddp` and only then
    builds the optimizer, so the optimizer sees the wrapped module's parameters (FSDP flat parameters).
    """

    strategy_name = "zeroexp_cell"

    def __init__(self, adapter: Any, **kwargs: Any) -> None:
        # Every launcher (zeroexp's own, torchrun, SLURM via zeroexp.launch.cluster) exports RANK, WORLD_SIZE,
        # LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT: read those, never guess from SLURM_*
        # (a local cell inside an sbatch script is not a SLURM job of world_size tasks).
        kwargs.setdefault("cluster_environment", TorchElasticEnvironment())
        super().__init__(**kwargs)
        self.adapter = adapter

    def model_to_device(self) -> None:
        """Lightning moves the LightningModule to the device before wrapping; a model built on the meta device
        (``init=meta``) has nothing to move: the adapter materialises it on the device (``wrap_meta``). Nor has one
        already there (torch would swap each parameter with itself, which fails for a dry run's fake tensors)."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if not any(t.is_meta for t in tensors) and any(t.device != self.root_device for t in tensors):
            super().model_to_device()

    def configure_ddp(self) -> None:
        self.model = self.adapter.wrap_cell(self.model, self.root_device)
        if isinstance(self.model, DistributedDataParallel):
            register_ddp_hooks(self)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning enters it around the first K-1 micro-batches of ``grad_accum=K`` (``no_sync`` for DDP only,
        in its own ``DDPStrategy``): here the adapter's (``StrategyAdapter.no_sync``)."""
        with self.adapter.no_sync(self.model):
            yield

    def teardown(self) -> None:
        """Lightning's teardown moves the module to the CPU (``module.cpu()``), which for FSDP2's DTensor parameters
        swaps each tensor and fails while anything else still references it. References that only a reference cycle
        keeps (a profiler's, autograd's) are collected first: without a later probe's collection (a short run), the
        swap failed (``Couldn't swap FSDPLinear.weight``)."""
        import gc

        gc.collect()
        super().teardown()
