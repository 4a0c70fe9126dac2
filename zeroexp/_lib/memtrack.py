"""MemTracker as zeroexp uses it, in one place: the memory probe's CPU source (real tensors) and the planner's step
trace (fake tensors) follow storages with the same tracker and name its categories the same way.

Beside MemTracker's own categories the tracker names two of zeroexp's, by what a storage is used for in the step
(the collectives it meets: ``c10d::*`` ops, which every process group dispatches), not by where it was allocated:

- ``unsharded``: a storage the step allocates (or grows from zero bytes) that an all-gather writes as its output
  (FSDP1's unsharded FlatParameter ``_full_param_padded``; FSDP2's all-gather buffer, made by
  ``fsdp::all_gather_copy_in``) or that is copied out of one (FSDP2's unsharded parameters,
  ``fsdp::split_with_sizes_copy``'s outputs), or a clone of a part of such a storage (FSDP2's post-forward shard,
  ``reshard_after_forward=k``).
- ``comm``: a storage the step allocates that any other collective reads or writes, or an all-gather reads (reduce-
  scatter inputs and outputs, all-reduce buffers: zeroexp's ZeRO-2 buckets, FSDP's unsharded gradient), or that FSDP2
  packs for one (``fsdp::chunk_cat``'s output, the reduce-scatter input); and a storage alive since the step's start
  that no module or optimizer claims (``Other``) when an all-reduce or reduce-scatter uses it: DDP's gradient
  buckets, which live across steps (``comm`` in steady too).

Model state alive at the step's start keeps its label when a collective moves it in place (ZeroRedundancyOptimizer's
parameter broadcasts, zeroexp's ZeRO-1 gradient buckets, ZeRO-1/2's all-gather into the parameters and its master
shard as the input, an FSDP1 shard sent to its all-gather). A storage is counted in its category from its birth: a
collective names its buffers when it is called, after they were allocated, so each closed phase's peak snapshot is
corrected too (``close_phase``; a phase's total never changes). At the step's end (``settle``) a storage that is then
model state (a reduce-scatter's output kept as FSDP's sharded gradient) is counted as that state from its birth.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

__all__ = ["CATEGORIES", "ROLE_CATEGORIES", "totals", "born_at_peak", "mem_tracker", "step_mem_tracker"]

#: MemTracker's reference types and zeroexp's two roles -> the category names in memory.csv and the summary.
CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
              "Temp": "temporaries", "Optstate": "optimizer_state", "Other": "other", "Unsharded": "unsharded",
              "Comm": "comm"}
#: The categories zeroexp names itself (the rest are MemTracker's).
ROLE_CATEGORIES = ("unsharded", "comm")


def totals(snapshot: dict[torch.device, dict[Any, int]], device_type: str) -> tuple[int, dict[str, int]]:
    """Total bytes and bytes per category of a MemTracker snapshot, summed over devices of ``device_type``."""
    total, cats = 0, dict.fromkeys(CATEGORIES.values(), 0)
    for dev, snap in snapshot.items():
        if torch.device(dev).type != device_type:
            continue
        for key, nbytes in snap.items():
            name = key.value if isinstance(key, Enum) else str(key)
            if name == "Total":
                total += int(nbytes)
            elif name in CATEGORIES:
                cats[CATEGORIES[name]] += int(nbytes)
    return total, cats


#: How many of the largest modules and ops :func:`born_at_peak` names.
KEPT = 8


def _user_path(module: str) -> str:
    """A module's name as the user's model names it: ModTracker's root class name, the wrappers' attributes (DDP's
    ``module``, FSDP1's and checkpoint_wrapper's) and CellModule's ``net`` dropped; ``(model)`` for the root."""
    from zeroexp._lib.modules import strip_wrappers

    if module.startswith("("):
        return module
    name, _, backward = module.partition(" ")
    parts = strip_wrappers(name).split(".")[1:]  # ModTracker names the root by its class
    while parts and parts[0] in ("module", "net"):
        parts = parts[1:]
    return ".".join(parts) + (f" {backward}" if backward else "") if parts else "(model)" + (
        f" {backward}" if backward else "")


def born_at_peak(tracker: Any, phase: str) -> dict[str, Any]:
    """What the step made that was alive at ``phase``'s peak, from ``StepMemTracker.born_alive_at``: ``bytes`` in
    all, ``by_module`` and ``by_op`` (the :data:`KEPT` largest, bytes each), ``groups`` (every group of the storages
    by category, op and module, the module as the user's model names it: ``category``, ``op``, ``module``, ``count``,
    ``bytes``; by category, largest first)."""
    alive = [(b, CATEGORIES.get(c, c), op, _user_path(m)) for b, c, op, m in tracker.born_alive_at(phase)]
    by_module: dict[str, int] = {}
    by_op: dict[str, int] = {}
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for b, c, op, m in alive:
        by_module[m] = by_module.get(m, 0) + b
        by_op[op] = by_op.get(op, 0) + b
        g = grouped.setdefault((c, op, m), [0, 0])
        g[0], g[1] = g[0] + 1, g[1] + b
    groups = [{"category": c, "op": op, "module": m, "count": n, "bytes": b}
              for (c, op, m), (n, b) in sorted(grouped.items(), key=lambda kv: (kv[0][0], -kv[1][1]))]
    return {"bytes": sum(b for b, *_ in alive),
            "by_module": dict(sorted(by_module.items(), key=lambda kv: -kv[1])[:KEPT]),
            "by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:KEPT]), "groups": groups}


def import_mem_tracker() -> None:
    """Import ``torch.distributed._tools.mem_tracker`` (private; torch 2.13), which :func:`mem_tracker` and
    :func:`step_mem_tracker` use, and :mod:`zeroexp._lib.step_memtrack`, which subclasses it: the ranks' forkserver
    preload (zeroexp.launch.rank_preload)."""
    import torch.distributed._tools.mem_tracker  # noqa: F401

    import zeroexp._lib.step_memtrack  # noqa: F401


def mem_tracker() -> Any:
    """A new ``torch.distributed._tools.MemTracker()`` as torch makes it (private; torch 2.13): a dispatch mode that
    follows every tensor storage allocated while it is entered (the init peak probe's CPU source)."""
    from torch.distributed._tools import MemTracker

    return MemTracker()


def step_mem_tracker(block: int = 1) -> Any:
    """A MemTracker whose optimizer-state region is only the optimizer's update (see the memory probe), and which names
    the ``unsharded`` and ``comm`` storages (module docstring): a new ``zeroexp._lib.step_memtrack.StepMemTracker``;
    ``block`` > 1: each storage counted in blocks of that many bytes (CUDA's allocated bytes)."""
    from zeroexp._lib.step_memtrack import StepMemTracker

    return StepMemTracker(block)
