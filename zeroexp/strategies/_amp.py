"""Mixed precision through Lightning's autocast plugin (DDP, ZeroRedundancyOptimizer) and FSDP's fp16 scaler.

Autocast keeps the parameters, gradients and Adam moments in fp32 (the fp32 parameters are the master) and
runs the matmuls of forward and backward in bf16 / fp16; fp16 scales the loss with a dynamic
``GradScaler`` (``precision.loss_scale`` initial, doubled after ``precision.growth_interval`` finite steps,
halved and the step skipped on an overflow). Imported only inside a rank: Lightning is heavy.
"""

from __future__ import annotations

from typing import Any

_LIGHTNING = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


def amp_precision(precision: Any, backend: str, sharded: bool = False) -> Any | None:
    """Lightning's ``MixedPrecision`` plugin for ``precision`` (a PrecisionPolicy; None for fp32); ``sharded``: FSDP1's
    ``ShardedGradScaler`` (gradients are shards: inf checks and unscaling per shard, found_inf all-reduced)."""
    name = precision.name
    if name not in _LIGHTNING:
        return None
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    device = "cuda" if backend == "nccl" else "cpu"
    scaler = None
    if name == "fp16":
        kwargs = {"init_scale": float(precision.loss_scale), "growth_interval": int(precision.growth_interval)}
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler(device=device, **kwargs)
        else:
            scaler = torch.amp.GradScaler(device=device, **kwargs)
    return MixedPrecision(_LIGHTNING[name], device=device, scaler=scaler)


def with_sharded_scaler(strategy: Any, precision: Any, backend: str) -> Any:
    """``strategy`` with Lightning's mixed-precision plugin and a ``ShardedGradScaler`` for fp16, for strategies
    whose gradients are shards (FSDP, FSDP2: their own mixed-precision policy casts, so bf16 needs no plugin)."""
    if precision.name == "fp16":
        strategy.precision_plugin = amp_precision(precision, backend, sharded=True)
    return strategy
