"""The operation microbenchmarks of ``python -m zeroexp.calibrate`` (``compute.kernels``): what one call of each kind of
operation a step runs takes on this machine, on every rank at once as a cell's ranks share it, so that the op-level
compute (:class:`zeroexp.formulas.time.kernels.MeasuredKernels`) costs a model never calibrated from its traced
operations, not from one model's step.

- ``matmul``: ``torch.mm`` of [m, k] x [k, n] over the grid :data:`MATMUL_DIMS` cubed, in fp32: a CPU's GEMM rate
  depends on each dimension (its micro-kernel's tiles, the packing of each operand), not on the FLOPs alone;
- ``memory``: ``torch.add`` of two fp32 vectors into a new one over :data:`MEMORY_ELEMENTS`, its bytes moved
  (3 x 4 B an element) from the first level of the cache to beyond the rank's share of the last;
- each a call's whole time, the allocation of its output included (as a step's operators allocate theirs): the
  smallest call's is the dispatch the model prices per operator apart (the calibration's operator stacks).

Each point: a block of calls back to back (at least :data:`BLOCK_S` of them), :data:`BLOCKS` blocks, the median
block's time per call, on every rank from a barrier, the slowest rank's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeroexp.calibrate.calls import slowest_each, sync

__all__ = ["MATMUL_DIMS", "MEMORY_ELEMENTS", "measure_kernels"]

#: The dimensions of the matmul grid (m, k and n each): from a vector to beyond the micro-kernel's blocking.
MATMUL_DIMS = (1, 8, 32, 128, 512)
#: The sizes of the memory-bound operation, in elements of each operand (x 12 B moved): 3 KiB to 48 MiB moved.
MEMORY_ELEMENTS = tuple(256 * 4**i for i in range(8))
#: Seconds a timed block lasts at least (short calls repeated until it does) and the blocks a point is timed over.
BLOCK_S, BLOCKS = 2e-4, 7


def _per_call(fn: Callable[[], Any], device: torch.device) -> float:
    """This rank's seconds of one call of ``fn``: the median of :data:`BLOCKS` blocks of calls back to back."""
    fn()  # warm: the first call's allocations and code paths
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    calls = max(1, int(BLOCK_S / max(time.perf_counter() - t0, 1e-7)))
    blocks = []
    for _ in range(BLOCKS):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        blocks.append((time.perf_counter() - t0) / calls)
    return statistics.median(blocks)


def measure_kernels(device: torch.device) -> dict[str, Any]:
    """``compute.kernels``' ``matmul`` and ``memory`` tables (see the module), the slowest rank's at each point."""
    own = []
    for m in MATMUL_DIMS:
        for k in MATMUL_DIMS:
            for n in MATMUL_DIMS:
                a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
                dist.barrier()
                own.append(_per_call(lambda: torch.mm(a, b), device))
    for elements in MEMORY_ELEMENTS:
        x, y = torch.randn(elements, device=device), torch.randn(elements, device=device)
        dist.barrier()
        own.append(_per_call(lambda: torch.add(x, y), device))
    times = slowest_each(own, device)
    d = len(MATMUL_DIMS)
    grid = [[[times[(i * d + j) * d + k] for k in range(d)] for j in range(d)] for i in range(d)]
    return {"dtype": "float32",
            "matmul": {"op": "torch.mm", "dims": list(MATMUL_DIMS), "seconds": grid},
            "memory": {"op": "torch.add", "bytes": [12 * e for e in MEMORY_ELEMENTS], "seconds": times[d**3:]}}

