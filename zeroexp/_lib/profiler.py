"""torch's profiler internals as zeroexp's probes and ZeRO read them. A leaf: it imports nothing of zeroexp."""

from __future__ import annotations

from typing import Any

import torch
from torch._C._profiler import _EventType

__all__ = ["profiler_enabled", "is_torch_op"]


def profiler_enabled() -> bool:
    """Whether an autograd profiler is recording now: ``torch.autograd._profiler_enabled()`` (private; torch 2.13)."""
    return torch.autograd._profiler_enabled()


def is_torch_op(event: Any) -> bool:
    """Whether a node of the profiler's event tree (``prof.profiler.kineto_results.experimental_event_tree()``) is an
    operator's record: its ``tag`` is ``torch._C._profiler._EventType.TorchOp`` (private; torch 2.13)."""
    return event.tag == _EventType.TorchOp
