"""torch's DDP and ZeroRedundancyOptimizer internals, and Lightning's strategy and precision hooks, as zeroexp's
adapters read or call them. A leaf: it imports nothing of zeroexp, nor any library (it calls methods of the objects
it is given)."""

from __future__ import annotations

from typing import Any

__all__ = ["ddp_grad_buckets", "zero_partitions", "zero_buckets", "register_ddp_hooks", "after_closure"]


def ddp_grad_buckets(model: Any) -> list[Any]:
    """A ``DistributedDataParallel``'s gradient buckets as its Reducer holds them now, each with ``parameters()``:
    ``model.reducer._get_zeros_like_grad_buckets()`` (private; torch 2.13)."""
    return model.reducer._get_zeros_like_grad_buckets()


def zero_partitions(optimizer: Any) -> list[Any]:
    """A ``ZeroRedundancyOptimizer``'s parameters per owning rank (a list of param groups per rank):
    ``optimizer._partition_parameters()`` (private; torch 2.13)."""
    return optimizer._partition_parameters()


def zero_buckets(optimizer: Any) -> list[Any]:
    """A ``ZeroRedundancyOptimizer``'s broadcast buckets with ``parameters_as_bucket_view`` (per device, per owner):
    ``optimizer._buckets`` (private; torch 2.13)."""
    return optimizer._buckets


def register_ddp_hooks(strategy: Any) -> None:
    """Lightning's ``DDPStrategy._register_ddp_hooks()`` (private; Lightning 2.6): the communication hook of the
    strategy's ``ddp_comm_hook`` settings on its wrapped model, as Lightning's own ``configure_ddp`` does."""
    strategy._register_ddp_hooks()


def after_closure(precision: Any, model: Any, optimizer: Any) -> Any:
    """Lightning's ``Precision._after_closure(model, optimizer)`` (private; Lightning 2.6): the
    ``on_before_optimizer_step`` hooks and gradient clipping, run by a precision plugin's ``optimizer_step`` once the
    closure (forward and backward) ran."""
    return precision._after_closure(model, optimizer)
