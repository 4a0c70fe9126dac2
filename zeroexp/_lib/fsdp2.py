"""FSDP2's internals (``torch.distributed.fsdp._fully_shard``, private) as zeroexp's dry run uses them. A leaf: it
imports nothing of zeroexp; torch's module is imported when the context is entered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["fsdp2_chunking", "fsdp2_post_forward_mesh_in", "fsdp2_param_group"]


@contextmanager
def fsdp2_chunking(chunk: Callable[..., Any]) -> Iterator[bool]:
    """While active, FSDP2 splits each parameter into its ranks' shards with ``chunk(tensor, num_chunks, dim,
    original)`` (``original``: torch's own function) instead of torch's
    ``torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty(tensor, num_chunks, dim)`` (private; torch
    2.6 to 2.13), the name FSDP2's parameter module calls; restored after. Yields True, or False (changing nothing)
    on a torch without that module (before 2.6, or moved)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        yield False
        return

    original = _fsdp_param._chunk_with_empty

    def chunk_with_empty(tensor: Any, num_chunks: int, dim: int) -> Any:
        return chunk(tensor, num_chunks, dim, original)

    _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield True
    finally:
        _fsdp_param._chunk_with_empty = original


@contextmanager
def fsdp2_post_forward_mesh_in(context: Callable[[], Any]) -> Iterator[bool]:
    """While active, FSDP2 builds an int ``reshard_after_forward``'s post-forward mesh inside ``context()`` (a dry run:
    real tensors, since ``_get_post_forward_mesh_info`` reads ``DeviceMesh.mesh``, a tensor FakeTensorMode refuses):
    ``torch.distributed.fsdp._fully_shard._fsdp_init._get_post_forward_mesh_info`` (private; torch 2.13), under its
    name in ``_fsdp_init`` and in ``_fully_shard``, which imports it; restored after. Yields True, or False (changing
    nothing) on a torch without those modules."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    except ImportError:
        yield False
        return

    modules = [m for m in (_fsdp_init, _fully_shard) if hasattr(m, "_get_post_forward_mesh_info")]
    original = _fsdp_init._get_post_forward_mesh_info

    def post_forward_mesh_info(*args: Any, **kwargs: Any) -> Any:
        with context():
            return original(*args, **kwargs)

    for m in modules:
        m._get_post_forward_mesh_info = post_forward_mesh_info
    try:
        yield True
    finally:
        for m in modules:
            m._get_post_forward_mesh_info = original


def fsdp2_param_group(module: Any) -> Any:
    """The FSDP2 parameter group (``FSDPParamGroup``: ``fsdp_params``, ``post_forward_mesh_info``) of a
    ``fully_shard`` unit that holds parameters, None for any other module: ``module._get_fsdp_state()
    ._fsdp_param_group`` (both private; torch 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    return module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
