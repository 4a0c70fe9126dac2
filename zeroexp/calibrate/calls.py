"""Timing one collective call at a time, as :mod:`zeroexp.calibrate.measure` and
:mod:`zeroexp.calibrate.framework` both do: a barrier, then the call, per call the slowest rank's seconds."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["all_gather", "reduce_scatter", "sync", "from_barrier", "slowest_each", "time_calls", "trimmed_mean",
           "TRIM"]

#: The share of calls cut at each end of a trimmed mean: a step's time sums its calls, so the model uses
#: their mean; a rare stall of the host (tens of ms) is not a property of the link.
TRIM = 0.1

# The calls zeroexp.strategies.sharding makes (torch >= 2.13 names, else the older ones)
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def from_barrier(fn: Callable[[], object], device: torch.device) -> float:
    """This rank's seconds of one call of ``fn`` after a barrier (the device's queued work waited for)."""
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def slowest_each(own: list[float], device: torch.device) -> list[float]:
    """Per measurement of ``own`` (this rank's, in the same order on every rank), the slowest rank's; one all_reduce
    after the timed work, so it times nothing of its own."""
    t = torch.tensor(own, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def time_calls(fn: Callable[[], None], calls: int, device: torch.device) -> list[float]:
    """``calls`` calls of ``fn``, each timed alone from a barrier; per call the slowest rank's seconds."""
    return slowest_each([from_barrier(fn, device) for _ in range(calls)], device)


def trimmed_mean(seconds: list[float], cut: float = TRIM) -> float:
    """The mean of ``seconds`` without the ``cut`` share of the smallest and of the largest."""
    xs = sorted(seconds)
    k = int(len(xs) * cut)
    xs = xs[k:len(xs) - k] or xs
    return sum(xs) / len(xs)
