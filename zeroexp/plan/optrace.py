"""The kernels one micro-batch's forward (with the loss) and backward run, each with its kind, FLOPs and bytes
(:class:`zeroexp.formulas.time.kernels.OpCost`): what the op-level step time costs on a GPU.

Traced on fake tensors of the CPU (nothing allocated), the module cast to the compute dtype (the bytes each kernel
moves are the dtype's), under a dispatch mode that sees every ATen call below autograd: views are left out (no
kernel); FLOPs are torch's own count (``torch.utils.flop_counter``'s registry, ``zeroexp._lib.flop_counts``; fused
experts' grouped matmul as :func:`zeroexp.plan.flops.grouped_mm_flops` counts it),
and for the CPU's fused attention kernel (which the registry lacks) its ``sdpa_flop_count`` of the same shapes, as
the GPU's flash kernel is counted, halved where causal (FlashAttention skips the masked blocks: the work its
published rates count, FlashAttention-2 paper section 4.1); bytes are every tensor argument's and output's. A deep
stack of identical blocks is derived from two, three and four blocks (each block's kernels the same multiset:
C(L) = C(2) + (L - 2) x the block's, checked at four), as :mod:`zeroexp.plan.flops` derives its counts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from zeroexp.cell.memo import memoized
from zeroexp.formulas.time.kernels import POINTWISE, OpCost, attention_name

__all__ = ["step_kernels", "ATTENTION_FORWARD", "ATTENTION_BACKWARD"]

#: The fused attention kernels (their names in torch's aten namespace), forward and backward: CPU's and the GPU's.
ATTENTION_FORWARD = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION_BACKWARD = tuple(f"{name}_backward" for name in ATTENTION_FORWARD)


def step_kernels(model_cfg: Mapping[str, Any], batch_size: int, dtype: str = "float32", derive: bool = True
                 ) -> tuple[Counter, Counter]:
    """(forward, backward): the kernels one micro-batch of ``batch_size`` runs with the module in ``dtype``, each
    :class:`OpCost` with its count; remembered for the invocation (and stored between, with the op counts)."""
    from zeroexp.plan.flops import _key

    key = _key(model_cfg, "kernels", int(batch_size), str(dtype), derive)
    return memoized("op_counts", key, lambda: _step_kernels(model_cfg, batch_size, dtype, derive))


def _step_kernels(model_cfg: Mapping[str, Any], batch_size: int, dtype: str, derive: bool) -> tuple[Counter, Counter]:
    from zeroexp.plan.stack import at_depth, stack_of

    stack = stack_of(model_cfg) if derive else None
    if stack is not None:
        argument, _, depth = stack
        two, three, four = (step_kernels(at_depth(model_cfg, argument, d), batch_size, dtype, False)
                            for d in (2, 3, 4))
        grown = []
        for b, c, d in zip(two, three, four):
            block = c - b
            if d - c != block or b - c:  # a block adds the same kernels, and takes none away
                break
            grown.append(b + Counter({op: n * (depth - 2) for op, n in block.items()}))
        if len(grown) == 2:
            return grown[0], grown[1]
    return _traced(model_cfg, batch_size, dtype)


def _arg(args: Any, kwargs: Any, at: int, name: str) -> Any:
    """A call's argument by position or keyword (None where absent)."""
    return args[at] if len(args) > at else (kwargs or {}).get(name)


#: The matmuls whose (batch, m, k, n) their two matrix arguments give, by name: the position of the first.
MATMUL_ARGS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}


def _dims(name: str, args: Any) -> tuple[int, ...]:
    """A matmul's (batch, m, k, n) from its arguments (:data:`MATMUL_ARGS`), () for any other FLOP-counted op."""
    at = MATMUL_ARGS.get(name)
    if at is None or len(args) < at + 2:
        return ()
    a, b = args[at].shape, args[at + 1].shape
    return (a[0] if len(a) == 3 else 1, int(a[-2]), int(a[-1]), int(b[-1]))


def _attention_dims(q: Any, k: Any) -> tuple[int, ...]:
    """A fused attention kernel's (batch x heads, query length, key length, head dimension) from its query and key
    shapes ([batch, heads, length, head dimension])."""
    return (int(q[:-2].numel()), int(q[-2]), int(k[-2]), int(q[-1]))


def _traced(model_cfg: Mapping[str, Any], batch_size: int, dtype: str) -> tuple[Counter, Counter]:
    import torch

    from zeroexp._lib.flop_counts import attention_flops, op_flops
    from zeroexp._lib.grouped_mm import grouped_mm_op
    from zeroexp.plan.flops import RAISED, dispatched_step, grouped_mm_flops

    grouped = grouped_mm_op()

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    def tensors_of(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in tensors_of(v)]
        if isinstance(x, dict):
            return [t for v in x.values() for t in tensors_of(v)]
        return []

    def cost(func: Any, args: Any, kwargs: Any, out: Any) -> OpCost:
        name = func.overloadpacket.__name__
        moved = sum(nbytes(t) for t in tensors_of((args, kwargs))) + sum(nbytes(t) for t in tensors_of(out))
        if name in ATTENTION_FORWARD:
            q, k, v = args[:3]
            causal = _arg(args, kwargs, 4, "is_causal")
            return OpCost("attention", attention_flops(q.shape, k.shape, v.shape) // (2 if causal else 1), moved,
                          _attention_dims(q.shape, k.shape), attention_name(False, bool(causal)))
        if name in ATTENTION_BACKWARD:
            grad, q, k, v = args[:4]
            causal = _arg(args, kwargs, 7, "is_causal")
            flops = attention_flops(q.shape, k.shape, v.shape, grad.shape)
            return OpCost("attention", flops // (2 if causal else 1), moved, _attention_dims(q.shape, k.shape),
                          attention_name(True, bool(causal)))
        if func.overloadpacket is grouped:  # fused experts' grouped matmul: torch's registry lacks it
            return OpCost("matmul", grouped_mm_flops(args[0].shape, args[1].shape, out_shape=out.shape), moved)
        flops = op_flops(func, args, kwargs, out)
        if flops is None:
            return OpCost("memory", 0, moved, name=name if name in POINTWISE else "")
        return OpCost("matmul", flops, moved, _dims(name, args))

    def kernel(func: Any, args: Any, kwargs: Any, out: Any) -> OpCost | None:
        if func.namespace == "prim" or func.is_view or out is RAISED:  # a view launches no kernel
            return None
        return cost(func, args, kwargs, out)

    forward, backward = dispatched_step(model_cfg, batch_size, "cpu", dtype, kernel)
    return Counter(forward), Counter(backward)
