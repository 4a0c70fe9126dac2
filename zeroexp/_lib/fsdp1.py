"""FSDP1's FlatParameter internals (``torch.distributed.fsdp._flat_param``, private; torch 2.13) as zeroexp's FSDP
adapter and meta init read them. A leaf: it imports nothing of zeroexp, nor torch (it reads the objects it is given).

A unit is a ``FullyShardedDataParallel`` module; its FlatParameter (``unit._handle.flat_param``) concatenates its
original parameters (``_param_infos``, ``_shared_param_infos`` for tied ones) with alignment padding between them
(``_numels_with_padding``, ``_is_padding_mask``), padded to the world size (``_padded_unsharded_size``); this rank's
shard covers parts of them (``_shard_param_infos``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["flat_param", "is_root", "param_infos", "shared_param_infos", "shard_param_infos", "numels",
           "numels_with_padding", "is_padding_mask", "padded_unsharded_numel", "full_param_padded", "orig_params",
           "allocated_by_size"]


@contextmanager
def allocated_by_size() -> Iterator[bool]:
    """While active, FSDP1 asks whether a FlatParameter's storage is allocated by its size, not its data pointer:
    ``torch.distributed.fsdp._flat_param._data_ptr_allocated`` (private; torch 2.13: ``data_ptr() > 0``), which
    ``_writeback_orig_params`` asserts of the unsharded FlatParameter where forward skipped the sharded views
    (``use_orig_params`` with a unit kept unsharded: SHARD_GRAD_OP). A fake tensor's storage (a dry run's
    FakeTensorMode) has no data pointer (0) but its size, which FSDP's ``_free_storage`` sets to 0. Restored after.
    Yields True, or False (changing nothing) on a torch without that name."""
    try:
        from torch.distributed.fsdp import _flat_param
    except ImportError:
        yield False
        return
    original = getattr(_flat_param, "_data_ptr_allocated", None)
    if original is None:
        yield False
        return
    _flat_param._data_ptr_allocated = lambda tensor: tensor.untyped_storage().nbytes() > 0
    try:
        yield True
    finally:
        _flat_param._data_ptr_allocated = original


def flat_param(unit: Any) -> Any:
    """The unit's FlatParameter: ``unit._handle.flat_param``; None for a unit without parameters of its own."""
    handle = unit._handle
    return None if handle is None else handle.flat_param


def is_root(unit: Any) -> bool:
    """Whether the unit is FSDP's root (``unit._is_root``), which FULL_SHARD does not reshard after forward."""
    return bool(unit._is_root)


def param_infos(flat: Any) -> Any:
    """Each original parameter's ``ParamInfo`` (``module``, ``param_name``): ``flat._param_infos``."""
    return flat._param_infos


def shared_param_infos(flat: Any) -> Any:
    """Each tied parameter's other names (``module``, ``param_name``, ``prim_module``, ``prim_param_name``):
    ``flat._shared_param_infos``."""
    return flat._shared_param_infos


def shard_param_infos(flat: Any) -> Any:
    """Per original parameter, its part of this rank's shard (``in_shard``, ``offset_in_shard``,
    ``numel_in_shard``): ``flat._shard_param_infos``."""
    return flat._shard_param_infos


def numels(flat: Any) -> Any:
    """The original parameters' numels, without padding: ``flat._numels``."""
    return flat._numels


def numels_with_padding(flat: Any) -> Any:
    """The numels of the FlatParameter's pieces in order, alignment padding included: ``flat._numels_with_padding``."""
    return flat._numels_with_padding


def is_padding_mask(flat: Any) -> Any:
    """Per piece of :func:`numels_with_padding`, whether it is padding: ``flat._is_padding_mask``."""
    return flat._is_padding_mask


def padded_unsharded_numel(flat: Any) -> int:
    """The unsharded FlatParameter's numel, padded to the world size: ``flat._padded_unsharded_size.numel()``."""
    return flat._padded_unsharded_size.numel()


def full_param_padded(flat: Any) -> Any:
    """The unsharded FlatParameter's buffer (the all-gather's output; freed storage when resharded), or None:
    ``flat._full_param_padded``."""
    return getattr(flat, "_full_param_padded", None)


def orig_params(flat: Any) -> Any:
    """The original parameters FSDP keeps with ``use_orig_params`` (``flat._params``), or None."""
    return getattr(flat, "_params", None)
