"""torch's FLOP counts of one ATen call, for the op-level step time (zeroexp.plan.optrace): the registry
``torch.utils.flop_counter.flop_registry`` (an op packet -> its counting function, called as ``FlopCounterMode`` calls
it: the call's own arguments and ``out_val=`` its output) and the attention counts ``sdpa_flop_count`` and
``sdpa_backward_flop_count`` (shapes of query, key, value; and the gradient's), none of them in the module's
``__all__`` (torch 2.13). A leaf: it imports nothing of zeroexp."""

from __future__ import annotations

from typing import Any

__all__ = ["op_flops", "attention_flops"]


def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
    """The FLOPs torch's registry counts for the call ``func(*args, **kwargs) -> out``; None where it counts none
    (an op without an entry: elementwise ops, copies)."""
    from torch.utils.flop_counter import flop_registry

    count = flop_registry.get(func.overloadpacket)
    return None if count is None else int(count(*args, **(kwargs or {}), out_val=out))


def attention_flops(query: Any, key: Any, value: Any, grad: Any = None) -> int:
    """Scaled-dot-product attention's FLOPs over these shapes: the forward's (``grad`` None), else the backward's
    (the scores recomputed: 2.5 forwards)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if grad is None:
        return int(sdpa_flop_count(query, key, value))
    return int(sdpa_backward_flop_count(grad, query, key, value))
