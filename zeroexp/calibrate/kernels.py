"""The operation microbenchmarks of ``python -m zeroexp.calibrate`` (``compute.kernels``): what one call of each kind of
operation a step runs takes on this machine, on every rank at once as a cell's ranks share it, so that the op-level
compute (:class:`zeroexp.formulas.time.kernels.MeasuredKernels`) costs a model never calibrated from its traced
operations, not from one model's step.

- ``matmul``: ``torch.mm`` of [m, k] x [k, n] over the grid :data:`MATMUL_DIMS` cubed, in fp32: a CPU's GEMM rate
  depends on each dimension (its micro-kernel's tiles, the packing of each operand), not on the FLOPs alone;
- ``memory``: ``torch.add`` of two fp32 vectors into a new one over :data:`MEMORY_ELEMENTS`, its bytes moved
  (3 x 4 B an element) from the first level of the cache to beyond the rank's share of the last;
- ``pointwise`` (schema 11): each operation of :data:`~zeroexp.formulas.time.kernels.POINTWISE` (GELU, SiLU, softmax,
  log-softmax, layer norm, forward and backward) over :data:`POINTWISE_ELEMENTS`, rows of :data:`ROW` elements, its
  bytes moved counted as the traced step counts an operation's (every tensor argument and output);
- ``attention`` (schema 11): ``scaled_dot_product_attention`` (the CPU's fused flash kernel) forward and backward,
  causal and not, at each of :data:`ATTENTION_HEADS` batch x heads over :data:`ATTENTION_SEQ` x
  :data:`ATTENTION_DIMS`;
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
from zeroexp.formulas.time.kernels import ATTENTION_CALLS, POINTWISE

__all__ = ["MATMUL_DIMS", "MEMORY_ELEMENTS", "measure_kernels"]

#: The dimensions of the matmul grid (m, k and n each): from a vector to beyond the micro-kernel's blocking.
MATMUL_DIMS = (1, 8, 32, 128, 512)
#: The sizes of the memory-bound operation, in elements of each operand (x 12 B moved): 3 KiB to 48 MiB moved.
MEMORY_ELEMENTS = tuple(256 * 4**i for i in range(8))
#: Seconds a timed block lasts at least (short calls repeated until it does) and the blocks a point is timed over.
BLOCK_S, BLOCKS = 2e-4, 7
#: Measurement design: the sizes of the pointwise operations, in elements of their input (256 to 4,194,304: 2 KiB
#: to 48 MiB moved, the caches then memory, as ``MEMORY_ELEMENTS``), in rows of ``ROW`` (a softmax's or a norm's row;
#: a transformer's are its width or its sequence, 64 and more).
POINTWISE_ELEMENTS = tuple(256 * 4**i for i in range(8))
ROW = 128
#: Measurement design: the attention grid, two batch x heads counts (the slope between them is the work per head, the
#: intercept the call's own cost), query (and key) lengths, head dimensions.
ATTENTION_HEADS, ATTENTION_SEQ, ATTENTION_DIMS = (8, 32), (16, 48, 128), (16, 64, 128)


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
    """``compute.kernels``' tables (see the module), the slowest rank's at each point."""
    labels: list[tuple] = []
    own: list[float] = []

    def point(label: tuple, fn: Callable[[], Any]) -> None:
        dist.barrier()
        own.append(_per_call(fn, device))
        labels.append(label)

    for m in MATMUL_DIMS:
        for k in MATMUL_DIMS:
            for n in MATMUL_DIMS:
                a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
                point(("mm", m, k, n), lambda: torch.mm(a, b))
    for elements in MEMORY_ELEMENTS:
        x, y = torch.randn(elements, device=device), torch.randn(elements, device=device)
        point(("add", elements), lambda: torch.add(x, y))
    pointwise = _pointwise_calls(device)
    for name, calls in pointwise.items():
        for nbytes, fn in calls:
            point((name, nbytes), fn)
    for name, backward, causal in ATTENTION_CALLS:
        for h in ATTENTION_HEADS:
            for s in ATTENTION_SEQ:
                for d in ATTENTION_DIMS:
                    point((name, h, s, d), _attention_call(backward, causal, h, s, d, device))
    at = dict(zip(labels, slowest_each(own, device)))
    return {"dtype": "float32",
            "matmul": {"op": "torch.mm", "dims": list(MATMUL_DIMS),
                       "seconds": [[[at["mm", m, k, n] for n in MATMUL_DIMS] for k in MATMUL_DIMS]
                                   for m in MATMUL_DIMS]},
            "memory": {"op": "torch.add", "bytes": [12 * e for e in MEMORY_ELEMENTS],
                       "seconds": [at["add", e] for e in MEMORY_ELEMENTS]},
            "pointwise": {name: {"bytes": [b for b, _ in calls], "seconds": [at[name, b] for b, _ in calls]}
                          for name, calls in pointwise.items()},
            "attention": {"op": "torch.nn.functional.scaled_dot_product_attention", "heads": list(ATTENTION_HEADS),
                          "seq": list(ATTENTION_SEQ), "head_dim": list(ATTENTION_DIMS),
                          "seconds": {name: [[[at[name, h, s, d] for d in ATTENTION_DIMS] for s in ATTENTION_SEQ]
                                             for h in ATTENTION_HEADS] for name, _, _ in ATTENTION_CALLS}}}


def _attention_call(backward: bool, causal: bool, heads: int, seq: int, dim: int, device: torch.device
                    ) -> Callable[[], Any]:
    """One call of the fused attention kernel, forward or backward, causal or not, on queries, keys and values of
    [1, ``heads``, ``seq``, ``dim``]; the backward through autograd on a kept graph."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, heads, seq, dim, device=device, requires_grad=backward) for _ in range(3))
    if not backward:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)


def _pointwise_calls(device: torch.device) -> dict[str, list[tuple[int, Callable[[], Any]]]]:
    """Per operation of :data:`POINTWISE`, (bytes moved, a call) at each of :data:`POINTWISE_ELEMENTS`, each through
    its ATen operation as the traced step names it."""
    out: dict[str, list[tuple[int, Callable[[], Any]]]] = {name: [] for name in POINTWISE}
    for elements in POINTWISE_ELEMENTS:
        for name, (fn, inputs) in _pointwise_at(elements, device).items():
            result = fn()
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            out[name].append((sum(t.numel() * t.element_size() for t in (*inputs, *outputs)
                                  if isinstance(t, torch.Tensor)), fn))
    return out


def _pointwise_at(elements: int, device: torch.device) -> dict[str, tuple[Callable[[], Any], tuple]]:
    """Each operation of :data:`POINTWISE` on ``elements`` in rows of :data:`ROW`: (a call, its tensor inputs)."""
    aten = torch.ops.aten
    x, g = (torch.randn(elements // ROW, ROW, device=device) for _ in range(2))
    w, b = torch.ones(ROW, device=device), torch.zeros(ROW, device=device)
    y = aten._softmax(x, -1, False)
    _, mean, rstd = aten.native_layer_norm(x, [ROW], w, b, 1e-5)
    calls = {"gelu": (lambda: aten.gelu(x), (x,)),
             "gelu_backward": (lambda: aten.gelu_backward(g, x), (g, x)),
             "silu": (lambda: aten.silu(x), (x,)),
             "silu_backward": (lambda: aten.silu_backward(g, x), (g, x)),
             "_softmax": (lambda: aten._softmax(x, -1, False), (x,)),
             "_softmax_backward_data": (lambda: aten._softmax_backward_data(g, y, -1, x.dtype), (g, y)),
             "_log_softmax": (lambda: aten._log_softmax(x, -1, False), (x,)),
             "_log_softmax_backward_data": (lambda: aten._log_softmax_backward_data(g, y, -1, x.dtype), (g, y)),
             "native_layer_norm": (lambda: aten.native_layer_norm(x, [ROW], w, b, 1e-5), (x, w, b)),
             "native_layer_norm_backward": (lambda: aten.native_layer_norm_backward(
                 g, x, [ROW], mean, rstd, w, b, [True, True, True]), (g, x, mean, rstd, w, b))}
    assert set(calls) == set(POINTWISE)
    return calls
