"""The tensors gloo may free late on a CPU cell (an async collective's input or output released only when gloo's work
object goes away): the memory check allows one of them, named, above its prediction (zeroexp.plan.judge)."""

from __future__ import annotations

from zeroexp.formulas import Groups
from zeroexp.formulas.rows import row_of as _row
from zeroexp.plan.peak_deepspeed import ds_late_free, ds_stage

__all__ = ["late_free"]


def late_free(name: str, groups: Groups, itemsize: int, gloo: bool,
               micro_batches: int = 1) -> dict[str, list[tuple[str, int]]]:
    """Per phase, the tensors of which gloo may free one late (CPU cells), each with its bytes. zeroexp's ZeRO-1
    and ZeRO-2 below fp32: in forward a bucket's all-gather input, which the
    next forward drops when it waits for the bucket; their optimizer step: the reduced copy of a bucket gloo's
    reduce_scatter hands back at its wait (the model counts it at the wait), held on by gloo's work, and with
    ``micro_batches`` > 1 zero2's in backward (a micro-batch's reduce waited at its end: not modelled). FSDP1's and
    FSDP2's backward and optimizer step: a unit's
    reduce-scatter input, gloo's copy of it or its output; FSDP2's forward: a unit's all-gather input or output (gloo
    frees them when the
    work object goes, which may be after a later moment of the phase; docs/results.md measures how often)."""
    if not gloo:
        return {}
    row = _row(name)
    if ds_stage(name) is not None:
        return ds_late_free(name, groups, itemsize)
    if row.groups == "buckets" and row.peak_flow is not None and groups.shards:  # zeroexp's ZeRO
        late = {"forward": [(f"bucket {k}'s all-gather input (its fp32 master shard cast to the compute dtype)",
                             s.numel // groups.world_size * itemsize) for k, s in enumerate(groups.shards)
                            if itemsize < 4]}  # fp32: the master itself, no tensor of the all-gather's own
        # the reduced copy of a bucket gloo's reduce_scatter hands back at its wait (modelled at the wait) goes with
        # gloo's work object, which gloo's worker thread may still hold through AdamW's update
        late["optimizer"] = [(f"bucket {k}'s copy gloo's reduce_scatter made of its full gradient",
                              s.numel * itemsize) for k, s in enumerate(groups.shards)]
        # each micro-batch's reduce waited at its end (accumulating()):
        if row.peak_flow == "bucket" and micro_batches > 1:
            late["backward"] = [(f"bucket {k}'s copy gloo's reduce_scatter hands back at a micro-batch's end",
                                 s.numel * itemsize) for k, s in enumerate(groups.shards)]  # not modelled there
        return {ph: v for ph, v in late.items() if v}
    if row.peak_flow in ("fsdp1", "fsdp2") and groups.units:
        n = groups.shard_over
        sizes = sorted({u.numel * itemsize for u in groups.units} | {u.numel // n * itemsize for u in groups.units})
        unit = [("one unit's reduce-scatter tensor (its unsharded gradient, gloo's copy of it, or its sharded "
                 "output)", b) for b in sizes]
        # gloo's work object holds its input copy and its output together: one reduce-scatter's pair, freed as one
        # (measured: fsdp_grad_op fp16 N=2, 12,296 B above the prediction on one rank under load, a unit's 8,192 B
        # input and its 4,096 B output)
        unit += [("one unit's reduce-scatter work, its input copy and its output held together by gloo", b)
                 for b in sorted({u.numel * itemsize + u.numel // n * itemsize for u in groups.units})]
        # the last units' reductions are waited for at backward's end: gloo's work may hold one into the update
        # (measured once in the suite: fsdp_hybrid N=4, a unit's unsharded gradient through AdamW)
        late = {"backward": unit, "optimizer": unit}
        if row.peak_flow == "fsdp2":  # FSDP2 copies each shard into a fresh all-gather input (FSDP1 sends its shard)
            late["forward"] = [("one unit's all-gather input (a shard copied in) or output", b) for b in sizes]
        return late
    return {}
