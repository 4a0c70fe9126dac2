"""The tensors gloo may free late on a CPU cell (an async collective's input or output released only when gloo's work
object goes away): the memory check allows one of them, named, above its prediction (zeroexp.plan.check.judge)."""

from __future__ import annotations

from zeroexp.formulas import Groups
from zeroexp.formulas.rows import row_of as _row

__all__ = ["late_free"]


def late_free(name: str, groups: Groups, itemsize: int, gloo: bool, micro_batches: int = 1,
              bucket_cap_bytes: int = 0) -> dict[str, list[tuple[str, int]]]:
    """Per phase, the tensors of which gloo may free one late (CPU cells), each with its bytes (the row's family's:
    :meth:`zeroexp.formulas.families.Family.late_free`). zeroexp's ZeRO-1
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
    return row.family.late_free(row, groups, itemsize, micro_batches, bucket_cap_bytes)
