"""MemTracker as zeroexp uses it, in one place: the memory probe's CPU source (real tensors) and the planner's step
trace (fake tensors) follow storages with the same tracker and name its categories the same way."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from torch import nn

__all__ = ["CATEGORIES", "totals", "step_mem_tracker"]

#: MemTracker's reference types -> the category names in memory.csv and the summary.
CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
              "Temp": "temporaries", "Optstate": "optimizer_state", "Other": "other"}


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


def step_mem_tracker() -> Any:
    """A MemTracker whose optimizer-state region is only the optimizer's update (see :class:`_TensorTracker`)."""
    from copy import deepcopy

    from torch.distributed._tools import MemTracker
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    class _StepMemTracker(MemTracker):
        # Lightning runs forward and backward inside ``optimizer.step(closure)``: MemTracker's global step
        # hooks would label every activation "optimizer state". The probe marks the update region instead.
        def _register_global_optimizer_hook(self) -> None:
            pass

        def set_in_optimizer_update(self, flag: bool) -> None:
            self._in_opt = flag

        def reset_peak(self) -> None:
            """Start a new peak from the bytes alive now (MemTracker only ever raises its peak)."""
            self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._curr_mem_snap.items()}
            self._peak_mem_snap = deepcopy(self._curr_mem_snap)

        # FSDP1 with use_orig_params=True exposes non-leaf parameter views in forward, on which MemTracker's
        # gradient hooks cannot be registered; their gradients land in the FlatParameter's, counted anyway.
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
            leaves = all(p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks and leaves)

    return _StepMemTracker()
