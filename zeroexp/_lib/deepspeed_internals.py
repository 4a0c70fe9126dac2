"""DeepSpeed's private attributes as zeroexp's DeepSpeed checkpoints read them (zeroexp.strategies.
_deepspeed_checkpoint). A leaf: it imports nothing of zeroexp, nor DeepSpeed (it reads the objects it is given)."""

from __future__ import annotations

from typing import Any

__all__ = ["link_optimizer_state", "linked_to_fp32_partition"]


def link_optimizer_state(optimizer: Any) -> bool:
    """Link each parameter's fp32 fragment to the optimizer's moment tensors, as DeepSpeed does after the first step:
    ``optimizer._lazy_init_hp_params_optimizer_state()`` (private; DeepSpeed 0.19's ``DeepSpeedZeroOptimizer``,
    stages 1 and 2, and ``BF16_Optimizer``). False, calling nothing, for an optimizer without it (stage 0, 3)."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is None:
        return False
    link()
    return True


def linked_to_fp32_partition(p: Any) -> bool:
    """Whether the stage 1/2 or BF16 optimizer linked parameter ``p`` to its fp32 partition: the ``_hp_mapping``
    attribute it sets on every parameter (private; DeepSpeed 0.19; None where this rank holds none of it)."""
    return hasattr(p, "_hp_mapping")
