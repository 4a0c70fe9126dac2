"""The one device rule: whether a cell's ranks each get a GPU (``device`` = auto | cpu | cuda); and how a rank
sets up its host: compute threads (:func:`rank_threads`) and the C allocator (:func:`pin_host_allocator`), the same
in a cell's ranks and a calibration's."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ranks_get_a_gpu", "local_world_size", "rank_threads", "usable_cores", "pin_host_allocator",
           "HOST_ALLOCATOR", "cuda_alloc_conf", "runs_expandable", "ALLOC_CONF_ENV"]

#: torch's CUDA caching allocator reads its settings from this variable at its first allocation
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"

#: glibc mallopt(3) settings of every rank: allocations below 32 MiB (the largest threshold glibc allows on 64-bit)
#: from the heap, and the heap's top never given back under 1 GiB. glibc's default moves the mmap threshold with
#: what was freed last and trims the heap, so whether a step's tensors page-fault anew depends on the process's
#: history: measured on the 2-core host (N=2, 8 x 768^2, batch 8), a bare rank's AdamW step took 11.2 ms by
#: default, 8.6 ms pinned; a calibration's compute moved by up to 2x with the buffers it had allocated before.
#: Pinned, a rank computes at the same rate whatever ran before it (a calibration, a cell's probes).
HOST_ALLOCATOR = {"M_MMAP_THRESHOLD": 32 * 2**20, "M_TRIM_THRESHOLD": 2**30, "M_TOP_PAD": 16 * 2**20}
_MALLOPT = {"M_TRIM_THRESHOLD": -1, "M_TOP_PAD": -2, "M_MMAP_THRESHOLD": -3}


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


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_threads(local_ranks: int) -> int:
    """A CPU rank's compute threads: the cores shared out among this node's ranks, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, int(local_ranks)))


def pin_host_allocator() -> dict[str, int] | None:
    """Set :data:`HOST_ALLOCATOR` in this process (glibc only); the settings, or None where the C library is not
    glibc or refused one."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    ok = all(libc.mallopt(_MALLOPT[k], v) == 1 for k, v in HOST_ALLOCATOR.items())
    return dict(HOST_ALLOCATOR) if ok else None


def _alloc_options(conf: str | None) -> dict[str, str]:
    """An allocator configuration's options (comma-separated ``key:value``), by key, in order."""
    pairs = [o.split(":", 1) for o in (conf or "").split(",") if o.strip()]
    return {p[0].strip(): (p[1].strip() if len(p) > 1 else "") for p in pairs}


def cuda_alloc_conf(expandable_segments: bool, current: str | None) -> str | None:
    """``PYTORCH_CUDA_ALLOC_CONF`` for a rank whose cell sets ``allocator.expandable_segments``: the variable's
    ``current`` options (comma-separated ``key:value``) with ``expandable_segments`` set to the cell's (the cell's key
    wins over the environment's); None where neither sets anything (torch's default, false)."""
    options = _alloc_options(current)
    if expandable_segments or "expandable_segments" in options:
        options["expandable_segments"] = str(expandable_segments)
    return ",".join(f"{k}:{v}" if v else k for k, v in options.items()) or None


def runs_expandable(environ: Any = None) -> bool:
    """Whether torch's caching allocator in a process of ``environ`` (default: this one's) maps expandable segments:
    ``PYTORCH_CUDA_ALLOC_CONF``'s option, else ``PYTORCH_ALLOC_CONF``'s (torch's device-generic name)."""
    env = os.environ if environ is None else environ
    conf = env.get(ALLOC_CONF_ENV, env.get("PYTORCH_ALLOC_CONF"))
    return _alloc_options(conf).get("expandable_segments", "").lower() == "true"
