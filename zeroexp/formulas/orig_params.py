"""FSDP1 with ``use_orig_params`` (its default here, as the seed's runs and Lightning's ``FSDPStrategy`` set it): what
the optimizer steps and when the previous step's gradients go [FSDP: torch/distributed/fsdp/_flat_param.py].

Each unit is still one FlatParameter, its original parameters 16-byte aligned in it (``zeroexp.formulas.layout``);
after backward each original parameter's ``.grad`` is a view of the rank's sharded gradient
(``_use_sharded_grad_views``), so AdamW steps one tensor per original parameter with elements in the rank's shard.

The previous step's gradients are still held when backward starts (the peak model's ``grads_held_into_backward``):
Lightning's closure calls ``zero_grad`` after the forward, before ``backward``
(lightning/pytorch/loops/optimization/automatic.py), and it sets only the original parameters' ``.grad`` (the views)
to None; the FlatParameter's gradient is freed by the root's pre-backward hook once all are None
(``_reset_flat_param_grad_info_if_needed``), a hook on the root's output: the loss, the root being the wrapped
LightningModule (zeroexp.strategies._lightning). Without ``use_orig_params`` ``zero_grad`` frees the
FlatParameter's gradient itself."""

from __future__ import annotations

from zeroexp.formulas.shapes import Groups, ModelShape, Shard

__all__ = ["view_numels", "views_per_rank", "orig_param_views"]


def view_numels(shard: Shard, parts: int, index: int) -> list[int]:
    """The elements of each of ``shard``'s spans in its chunk ``index`` of ``parts``: each original parameter's view
    of a rank's shard of its FlatParameter, the tensor AdamW steps (``_use_sharded_views``; 0: none, the parameter
    gets no ``.grad`` there and no optimizer state)."""
    size = shard.numel // parts
    lo, hi = index * size, (index + 1) * size
    return [max(0, min(b, hi) - max(a, lo)) for a, b in shard.spans]


def views_per_rank(groups: Groups) -> list[int]:
    """Per rank, the original parameters AdamW steps (:func:`view_numels` above 0 over the units' trained spans;
    hybrid sharding: rank r holds shard r % shard_size), so its 4-byte ``step`` scalars."""
    s = groups.shard_over
    starts = [0] * (s + 1)  # each span's views over a run of chunks: counted at its ends, summed once (O(spans + s))
    for sh in groups.trained_shards:
        size = sh.numel // s
        for a, b in sh.spans if size else ():
            first, last = a // size, min(s - 1, (b - 1) // size)  # the chunks [i*size, (i+1)*size) meeting [a, b)
            if a < b and first <= last:
                starts[first] += 1
                starts[last + 1] -= 1
    per, running = [], 0
    for d in starts[:s]:
        running += d
        per.append(running)
    return [per[r % s] for r in range(groups.world_size)]


def orig_param_views(groups: Groups, shape: ModelShape, members: list[list[int]], shard: int) -> tuple[int, ...]:
    """The elements of each trainable original parameter in shard ``shard`` of its unit's FlatParameter, in the
    model's parameter order, those with none left out: the tensors AdamW steps, one by one (``members``: each unit's
    parameter indices, as ``groups.shards``). A frozen parameter, or one outside the shard, has no ``.grad``; one
    forward does not use, in a unit backward reaches, has a zero gradient (``_reset_is_grad_none``) and is stepped."""
    local: dict[int, int] = {}
    for params, unit in zip(members, groups.shards):
        for i, k in zip(params, view_numels(unit, groups.shard_over, shard)):
            if shape.train(i):
                local[i] = k
    return tuple(local[i] for i in sorted(local) if local[i])

