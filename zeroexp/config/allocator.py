"""``allocator.*``: torch's CUDA caching allocator on a cell's GPUs (and as the planner models it:
zeroexp.formulas.peak.allocator)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from zeroexp.errors import ConfigError

__all__ = ["AllocatorConfig", "check_allocator"]


@dataclass
class AllocatorConfig:
    """The caching allocator's mode."""

    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in every rank (the mode most LLM trainers set); false: torch's
    # default. A CPU cell has no caching allocator: true is refused there
    expandable_segments: bool = False


def check_allocator(cfg: DictConfig) -> None:
    """``allocator.expandable_segments=true`` where the ranks get no GPU (a CPU cell: no caching allocator)."""
    from zeroexp.devices import ranks_get_a_gpu

    if OmegaConf.select(cfg, "allocator.expandable_segments") and not ranks_get_a_gpu(cfg):
        raise ConfigError("allocator.expandable_segments", True, "false on the CPU (the CUDA caching allocator's "
                          "mode: true needs device=cuda, or auto with a GPU a rank)")
