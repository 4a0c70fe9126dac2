"""torch.nn's and FSDP1's private names as zeroexp reads them. A leaf: it imports nothing of zeroexp; torch's modules
are imported when a function is called."""

from __future__ import annotations

from typing import Any

__all__ = ["conv_base", "hybrid_shard_zero2", "own_parameters", "own_buffers", "wrapper_prefixes"]


def conv_base() -> type:
    """The base class of torch's convolutions (``Conv1d`` to ``ConvTranspose3d`` and their lazy forms):
    ``torch.nn.modules.conv._ConvNd`` (private; torch 2.13)."""
    from torch import nn

    return nn.modules.conv._ConvNd


def hybrid_shard_zero2() -> Any:
    """FSDP1's ``ShardingStrategy._HYBRID_SHARD_ZERO2`` (private; torch 2.13): SHARD_GRAD_OP within each shard group,
    replicated across them."""
    from torch.distributed.fsdp import ShardingStrategy

    return ShardingStrategy._HYBRID_SHARD_ZERO2


def own_parameters(module: Any) -> dict[str, Any]:
    """A module's own parameters by name (``None`` for one registered empty), the module's live dict: reading it reads
    the module, assigning into it replaces a parameter without ``register_parameter``'s checks:
    ``nn.Module._parameters`` (private; torch 2.13)."""
    return module._parameters


def own_buffers(module: Any) -> dict[str, Any]:
    """A module's own buffers by name, the module's live dict (as :func:`own_parameters`): ``nn.Module._buffers``
    (private; torch 2.13)."""
    return module._buffers


def wrapper_prefixes() -> dict[str, str]:
    """The attribute names torch's wrappers put into every wrapped parameter's and buffer's path, each with its dot:
    ``fsdp``: FSDP1's ``FSDP_WRAPPED_MODULE`` (``torch.distributed.fsdp._common_utils``, private); ``checkpoint``:
    checkpoint_wrapper's ``_CHECKPOINT_WRAPPED_MODULE`` (``torch.distributed.algorithms._checkpoint``, private;
    torch 2.13)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_WRAPPED_MODULE
    from torch.distributed.fsdp._common_utils import FSDP_WRAPPED_MODULE

    return {"fsdp": FSDP_WRAPPED_MODULE + ".", "checkpoint": _CHECKPOINT_WRAPPED_MODULE + "."}


def strip_wrappers(name: str) -> str:
    """A parameter's, buffer's or module's path without the attributes torch's wrappers put into it
    (:func:`wrapper_prefixes`)."""
    for w in wrapper_prefixes().values():
        name = name.replace(w, "")
    return name
