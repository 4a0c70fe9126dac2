"""DeepSpeed stages 1-2: a rank's partition of a flat group (:class:`DsPartition`); stages 1-3: what the optimizer
offloaded keeps per partition parameter (:func:`ds_offload_norms`, :func:`ds3_offload_norms`), for the peak model of
:mod:`zeroexp.formulas.peak.deepspeed`.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import NamedTuple

__all__ = ["DsPartition", "ds_partition", "ds_partitions", "graded_pieces", "ds_offload_norms", "FP64"]

#: ``get_norm_dtype``: DeepSpeed's gradient norms accumulate in float64 (8 bytes) on a device that has it.
FP64 = 8


class DsPartition(NamedTuple):
    """Stages 1-2, one rank's share of the flat group: ``numel`` (the partition, ``partition_size``), ``overlapped``
    (the whole numel of the parameters it overlaps: ``grads_in_partition``), ``pieces`` (each overlapped parameter's
    elements inside it, the gradient views ``get_flat_partition`` returns), ``padding`` (its zeros tensor),
    ``params`` (the overlapped parameters' indices)."""

    numel: int
    overlapped: int
    pieces: tuple[int, ...]
    padding: int
    params: tuple[int, ...]


def ds_partition(numels: tuple[int, ...] | list[int], flat_numel: int, world_size: int, rank: int) -> DsPartition:
    """Rank ``rank``'s partition of a flat group of ``flat_numel`` elements (padded to 2N) holding ``numels`` in
    parameter order (stage_1_and_2.py ``get_partition_info``, ``get_flat_partition``)."""
    return ds_partitions(numels, flat_numel, world_size, (rank,))[0]


def ds_partitions(numels: tuple[int, ...] | list[int], flat_numel: int, world_size: int,
                  ranks: tuple[int, ...] | range | None = None) -> list[DsPartition]:
    """:func:`ds_partition` of each rank of ``ranks`` (None: every rank, in rank order), the parameters' offsets summed
    once: each rank reads only the parameters its range overlaps."""
    size = flat_numel // world_size
    starts = list(accumulate(numels, initial=0))
    ends = starts[1:]
    out = []
    for rank in range(world_size) if ranks is None else ranks:
        lo, hi = rank * size, (rank + 1) * size
        overlapped, pieces, params = 0, [], []
        for i in range(bisect_right(ends, lo), len(numels)):  # the first parameter ending past lo, then on
            offset, n = starts[i], numels[i]
            if offset >= hi:
                break
            inside = min(offset + n, hi) - max(offset, lo)
            if n and inside > 0:
                overlapped += n
                pieces.append(inside)
                params.append(i)
        out.append(DsPartition(size, overlapped, tuple(pieces), size - sum(pieces), tuple(params)))
    return out


def graded_pieces(part: DsPartition, ungraded: set[int] | frozenset[int] | tuple[int, ...]) -> dict[int, int]:
    """The partition's pieces by parameter index, those of parameters the step gives a gradient: what the offloaded
    optimizer copies to float64 and keeps a norm of."""
    return {i: x for i, x in zip(part.params, part.pieces) if i not in ungraded}


def ds_offload_norms(buckets: tuple[tuple[int, ...], ...], order: tuple[int, ...], part: DsPartition,
                   no_grad: set[int], itemsize: int) -> tuple[list[int], list[int]]:
    """Stages 1-2 with the optimizer offloaded (:func:`ds_stage12_phase_peaks`): the bytes of the float64 norms kept
    before each bucket's reduction (and, last, after every one), and per bucket the most one of its partition
    parameters adds over them while its piece is copied: the float64 copy and its norm (the norms of the bucket's
    parameters before it counted too). Below fp32 the fp32 copy of the piece that follows, beside the norm alone, is
    smaller than the float64 one, whatever ``itemsize``."""
    piece = graded_pieces(part, no_grad)
    bucket_of = [k for k, b in enumerate(buckets) for _ in b]
    mine: list[list[int]] = [[] for _ in buckets]
    for i, p in enumerate(order):
        if p in piece:
            mine[bucket_of[i]].append(piece[p])
    return _norms_and_copies(mine)


def _norms_and_copies(mine: list[list[int]]) -> tuple[list[int], list[int]]:
    """From each bucket's copied pieces (elements, in the order copied): the float64 norms kept before each bucket
    (and after the last), and per bucket the most one piece's float64 copy and its norm add over them."""
    norms = list(accumulate((len(m) * FP64 for m in mine), initial=0))
    copies = [max(((j + x + 1) * FP64 for j, x in enumerate(m)), default=0) for m in mine]
    return norms, copies


def ds3_offload_norms(buckets: tuple[tuple[int, ...], ...], world_size: int, rank: int, order: tuple[int, ...] = ()
                      ) -> tuple[list[int], list[int]]:
    """Stage 3 with the optimizer offloaded (``partition_grads`` -> ``_offload_grad_partition_at_boundary``): the
    bytes of the float64 norms kept before each bucket's partitioning (and, last, after every one), and per bucket the
    most one of its parameters adds over them while its partition is copied to float64 for its norm
    (``_constant_buffered_norm2``: the copy beside the norm it makes, the bucket's norms before it counted too). A
    bucket's parameters are partitioned in parameter order (``__avg_scatter_grads`` sorts them by ``ds_id``: ``order``,
    the parameters' indices in the buckets' order, sorted within each; none given: a stack's, each bucket reversed);
    a parameter whose partition on ``rank`` holds none of its elements
    (``contains_real_data`` false) is skipped. A partition copied is the rank's real elements of its ``ceil(numel /
    N)``-element chunk (``reduce_scatter_coalesced`` narrows its output to them: the last rank's may be shorter). The
    fp32 copy that follows below fp32 is never larger."""
    if len(order) == sum(len(b) for b in buckets):  # each bucket's numels by their parameters' indices
        starts = accumulate((len(b) for b in buckets), initial=0)
        ordered = [[x for _, x in sorted(zip(order[s:s + len(b)], b))] for s, b in zip(starts, buckets)]
    else:
        ordered = [list(reversed(b)) for b in buckets]

    def real(x: int) -> int:  # the rank's real elements of a parameter's ceil(x / N) chunk
        chunk = -(-x // world_size)
        return min(chunk, x - chunk * rank)
    return _norms_and_copies([[real(x) for x in b if real(x) > 0] for b in ordered])
