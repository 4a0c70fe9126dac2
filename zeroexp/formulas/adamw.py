"""AdamW's temporaries: what torch's AdamW allocates above its state during one step, as bytes and as the allocations
they are (the peak model's optimizer phase, :mod:`zeroexp.formulas.peak`; DeepSpeed's, :mod:`zeroexp.formulas.
peak_deepspeed`)."""

from __future__ import annotations

from zeroexp.formulas.allocator import counted, counted_sum

__all__ = ["adamw_temporaries", "adamw_temporary_blocks"]


def adamw_temporaries(numels: tuple[int, ...] | list[int], itemsize: int, foreach: bool, block: int = 1) -> int:
    """Bytes torch's AdamW allocates above its state during one step (no amsgrad, no capturable, decoupled weight
    decay; torch/optim/adam.py). ``foreach``: one ``_foreach_sqrt`` list of every tensor's size alive at once, each
    counted in ``block``-byte blocks (CUDA's 512: :func:`zeroexp.formulas.allocator.counted`).
    Single-tensor (torch's default on CPU): per parameter ``denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`` holds
    the sqrt and the quotient at once, while the previous parameter's ``denom`` is still bound to the loop variable:
    max(2 n_0, n_{i-1} + 2 n_i) elements."""
    n = [int(x) for x in numels]  # an empty tensor (an uneven shard's last ranks) rebinds ``denom`` too
    if not any(n):
        return 0
    if foreach:
        return counted_sum((k * itemsize for k in n), block)
    return max([2 * n[0], *(a + 2 * b for a, b in zip(n, n[1:]))]) * itemsize


def adamw_temporary_blocks(numels: tuple[int, ...] | list[int], itemsize: int, foreach: bool,
                           block: int = 1) -> tuple[int, ...]:
    """:func:`adamw_temporaries` as the allocations they are (what the caching allocator places one by one): foreach's
    list, one tensor per parameter; the single-tensor update's moment, one figure (the CPU's: no allocator)."""
    if foreach:
        return tuple(counted(k * itemsize, block) for k in numels if k)
    total = adamw_temporaries(numels, itemsize, foreach, block)
    return (total,) if total else ()
