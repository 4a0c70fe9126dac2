"""torch's ShardedTensor (``torch.distributed._shard``) made from this rank's pieces and every rank's pieces' places,
without a collective: how torch.distributed.checkpoint describes a tensor whose ranks each hold rectangular pieces of
it (zeroexp's ZeRO buckets cut a parameter at any element: a rank's part of one is a few rectangles, and every rank
knows every rank's from the bucket layout). DCP writes each local piece as one item and reshards on load. torch 2.13
warns that it is deprecating ShardedTensor (a FutureWarning on each use; DTensor cannot place a piece that is not a
chunk of one dimension): tests/test_lib_shims.py builds one, and fails the day the API goes."""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["sharded_tensor", "is_sharded_tensor"]


def sharded_tensor(pieces: Sequence[tuple[torch.Tensor, Sequence[int]]],
                   places: Sequence[tuple[Sequence[int], Sequence[int], int]], size: Sequence[int],
                   dtype: torch.dtype, rank: int, device: torch.device) -> Any:
    """A ShardedTensor of global ``size`` whose local shards are ``pieces`` (each a tensor and its offsets in the
    whole) and whose shards over all ranks are ``places`` (offsets, sizes, rank) on ``device``'s type; this rank's
    ``rank``."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    def placement(r: int) -> str:  # another rank's device is not checked here: this rank's stands for it
        return f"rank:{r}/{device}"

    local = [Shard(t, ShardMetadata(list(off), list(t.shape), placement(rank))) for t, off in pieces]
    meta = ShardedTensorMetadata([ShardMetadata(list(off), list(sz), placement(r)) for off, sz, r in places],
                                 torch.Size(size), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def is_sharded_tensor(value: Any) -> bool:
    """Whether ``value`` is a ShardedTensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)
