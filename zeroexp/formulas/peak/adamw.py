"""AdamW's temporaries: what torch's AdamW allocates above its state during one step, as bytes and as the allocations
they are (the peak model's optimizer phase, :mod:`zeroexp.formulas.peak.phases`; DeepSpeed's, :mod:`zeroexp.formulas.
peak_deepspeed`)."""

from __future__ import annotations

from zeroexp.formulas.peak.allocator import counted

__all__ = ["adamw_temporaries", "adamw_temporary_blocks", "update_phase"]


def adamw_temporary_blocks(numels: tuple[int, ...] | list[int], itemsize: int, foreach: bool | str,
                           block: int = 1) -> tuple[int, ...]:
    """What torch's AdamW allocates above its state during one step (no amsgrad, no capturable, decoupled weight
    decay; torch/optim/adam.py), as the allocations the caching allocator places one by one. ``foreach``: the update
    path, ``"single"``, ``"foreach"`` or ``"fused"`` (``optimizer.impl``; a bool: foreach or single-tensor, the
    device's default). Fused (``_fused_adam``: ``torch._fused_adamw_``, one kernel over every tensor, on CUDA and on
    the CPU): each element updated in place, nothing allocated above the state. Foreach: one
    ``_foreach_sqrt`` list of every tensor's size alive at once, one allocation per tensor, each counted in
    ``block``-byte blocks (CUDA's 512: :func:`zeroexp.formulas.peak.allocator.counted`). Single-tensor (torch's default
    on
    CPU): per parameter ``denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`` holds the sqrt and the quotient at once,
    while the previous parameter's ``denom`` is still bound to the loop variable: max(2 n_0, n_{i-1} + 2 n_i)
    elements, one figure (the CPU's: no allocator)."""
    n = [int(x) for x in numels]  # an empty tensor (an uneven shard's last ranks) rebinds ``denom`` too
    impl = foreach if isinstance(foreach, str) else "foreach" if foreach else "single"
    if not any(n) or impl == "fused":
        return ()
    if impl == "foreach":
        return tuple(counted(k * itemsize, block) for k in n if k)
    return (max([2 * n[0], *(a + 2 * b for a, b in zip(n, n[1:]))]) * itemsize,)


def adamw_temporaries(numels: tuple[int, ...] | list[int], itemsize: int, foreach: bool | str, block: int = 1
                      ) -> int:
    """The bytes of :func:`adamw_temporary_blocks`."""
    return sum(adamw_temporary_blocks(numels, itemsize, foreach, block))


def update_phase(temporaries: tuple[int, ...], master_grads: int = 0, one_by_one: bool = True) -> dict:
    """The optimizer phase: AdamW's temporaries (:func:`adamw_temporary_blocks`) and ``master_grads``, optimizer
    state; where it is AdamW's list alone (``one_by_one``: no other term is subtracted from it later), its tensors
    one by one as ``blocks`` (:func:`zeroexp.formulas.peak.allocator.allocations`)."""
    total = sum(temporaries) + master_grads
    rec = {"bytes": total, "by_category": {"optimizer_state": total}}
    if one_by_one and len(temporaries) > 1 and not master_grads:
        rec["blocks"] = {"optimizer_state": tuple(temporaries)}
    return rec
