"""The one device rule: whether a cell's ranks each get a GPU (``device`` = auto | cpu | cuda)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ranks_get_a_gpu", "local_world_size"]


def local_world_size(cfg: Any) -> int:
    """The ranks of this cell on this node: torchrun's and SLURM's ``LOCAL_WORLD_SIZE``, else every rank."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg["world_size"]))


def ranks_get_a_gpu(cfg: Any, local: int | None = None) -> bool:
    """``device=cuda``: yes; ``cpu``: no; ``auto``: CUDA is available with at least one GPU per rank of this node
    (``local``, default :func:`local_world_size`). A dry run plays its ranks on the CPU."""
    if cfg["device"] == "cpu" or cfg.get("dry_run"):
        return False
    if cfg["device"] == "cuda":
        return True
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= (local or local_world_size(cfg))
