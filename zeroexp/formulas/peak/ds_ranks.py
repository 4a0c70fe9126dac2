"""DeepSpeed stages 1-2: the rank whose largest phase is highest, found without each rank's phases.

:func:`zeroexp.formulas.peak.deepspeed.ds_stage12_phase_peaks` gives one rank's phases; its ranks differ only by their
partitions (:class:`~zeroexp.formulas.peak.deepspeed.DsPartition`). Each of its moments is a sum of terms that do not
depend on the rank (the trace's segments, the bucket, the flat all_reduce copies: every rank's partition has the same
``numel``) and a few that do: the partition's ``grads_in_partition`` (``gip``, held from just after the first bucket
holding one of its gradients, ``f``, is reduced: a moment of bucket or reduction index ``k`` holds it where ``k > f``,
and the moment ``k == f`` is its making), the epilogue's zero gradients, the padding, each piece's float64 copy, and
under accumulation what a later micro-batch carries. :class:`DsStage12Ranks` sums the rank-independent terms of every
moment once, keeps per index ``k`` the highest of those held with the partition and of those held without it, and
their prefix and suffix maxima: each rank's highest moment per phase is then a few look-ups (``phase_bytes``), the
same bytes the direct evaluation keeps (a phase's ``bytes``: the highest of its moments' sums). The caller evaluates
the winning rank's phases directly (:meth:`zeroexp.formulas.families.deepspeed.DeepSpeedPartitions.worst_rank`).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate

from zeroexp.formulas.deepspeed import DS_NORM_BYTES
from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.deepspeed import (FP64, DsPartition, _at_hook, _being_made, _closed, ds_accumulation,
                                             ds_allreduce_copies, ds_partitions)
from zeroexp.formulas.peak.phases import StepTrace

__all__ = ["DsStage12Ranks", "ds_partitions", "ds_worst_rank"]

_NONE = float("-inf")


class _Indexed:
    """Moments at an index ``k`` (a bucket, or the buckets reduced before a segment) that hold ``gip`` where
    ``k > f``: per index the highest rank-independent sum, with prefix and suffix maxima over the sorted indices."""

    def __init__(self) -> None:
        self.best: dict[int, int] = {}

    def add(self, k: int, value: int) -> None:
        if k not in self.best or self.best[k] < value:
            self.best[k] = value

    def freeze(self) -> None:
        self.keys = sorted(self.best)
        values = [self.best[k] for k in self.keys]
        self.prefix = list(accumulate(values, max))  # prefix[j]: the highest of keys[: j + 1]
        self.suffix = list(accumulate(reversed(values), max))[::-1]  # suffix[j]: the highest of keys[j:]

    def highest(self, f: int | None, gip: int) -> float:
        """The highest moment: with ``gip`` where the index is above ``f`` (None: below every index, ``gip`` 0)."""
        if not self.keys:
            return _NONE
        if f is None:
            return self.prefix[-1]
        j = bisect_right(self.keys, f)  # keys[j:] are above f
        below = self.prefix[j - 1] if j else _NONE
        above = self.suffix[j] + gip if j < len(self.keys) else _NONE
        return max(below, above)


class DsStage12Ranks:
    """:func:`~zeroexp.formulas.peak.deepspeed.ds_stage12_phase_peaks`' phases' bytes for any partition of the same
    flat group (the same arguments but ``part``; ``partition_numel``: every rank's ``part.numel``), each moment's
    rank-independent terms summed once (see the module)."""

    def __init__(self, trace: StepTrace, *, stage: int, buckets: tuple[tuple[int, ...], ...],
                 order: tuple[int, ...], numels: tuple[int, ...], partition_numel: int, bucket_numel: int,
                 itemsize: int, foreach: bool = False, ungraded: tuple[int, ...] = (), later: bool = False,
                 ipg_buffers: int = 1) -> None:
        c = itemsize
        self.stage, self.later, self.c, self.numel = stage, later, c, partition_numel
        self.no_grad = set(ungraded)
        self.numels = numels
        bucket = ipg_buffers * bucket_numel * c
        graded = sum(k for i, k in enumerate(numels) if i not in self.no_grad) * c
        # what every forward and backward moment holds beside its own terms: less the loss, and a later micro-batch's
        # carried terms (stage 2's depend on the partition: added per rank)
        carried = ds_accumulation(stage, bucket, 0, graded) if later and stage == 1 else {}
        self.loss = -trace.loss_bytes + sum(carried.values())
        sizes = [k * c for k in ds_allreduce_copies(buckets, order, numels, partition_numel, bucket_numel)]
        big = {k: b[0] * c for k, b in enumerate(buckets) if len(b) == 1 and b[0] > bucket_numel}
        edges = list(accumulate((sum(b) * c for b in buckets), initial=0))
        bucket_of = [k for k, b in enumerate(buckets) for _ in b]
        self.first_bucket: dict[int, int] = {}  # parameter -> the first bucket (reduce order) holding it
        for p, k in zip(order, bucket_of):
            self.first_bucket[p] = min(k, self.first_bucket.get(p, k))

        forward = [sum(s.peak_by_category.values()) for s in trace.segments if s.phase == "forward"]
        self.forward = max(forward) if forward else None
        self.plain = _NONE  # backward moments without gip
        self.held, self.making = _Indexed(), {}  # with gip where k > f; the moment k == f (gip made)
        before, backward = 0, [s for s in trace.segments if s.phase == "backward"]
        for i, s in enumerate(backward):
            peak = sum(s.peak_by_category.values())
            if stage == 2:
                grads = s.peak_by_category.get("gradients", 0)
                done = _closed(edges, before)
                self.held.add(done, peak + _being_made(edges, big, grads) - grads + (bucket if before else 0))
                after = s.end_by_category.get("gradients", 0)
                at_hook = sum(_at_hook(backward, i).values())
                for k in range(done, _closed(edges, after)):
                    base = at_hook + buckets[k + 1][0] * c + big.get(k, 0) - after + bucket
                    self.held.add(k, base + sizes[k])
                    self.making[k] = max(self.making.get(k, _NONE), base)
            else:
                self.plain = max(self.plain, peak + (bucket if before and not later else 0))
            before = s.end_by_category.get("gradients", 0)
        end = trace.segments[-1].end_by_category
        end_grads = end.get("gradients", 0) + carried.get("gradients", 0)
        first = 0 if stage == 1 else len(buckets) - 1
        epilogue_bucket = 0 if later and stage == 1 else bucket
        end_sum = sum(end.values())
        for k in range(first, len(buckets)):
            pending = (edges[-1] - edges[k + 1] if stage == 1 else 0) + big.get(k, 0)
            base = end_sum + pending - end_grads + epilogue_bucket
            self.held.add(k, base + sizes[k])
            self.making[k] = max(self.making.get(k, _NONE), base)
        self.held.freeze()
        self.last = end_sum - end_grads + epilogue_bucket  # + gip + zeros + pad
        norms = 2 * DS_NORM_BYTES[stage]
        n = partition_numel
        self.flat = n * c + (n * 4 if c != 4 else 0) + norms
        self.update = n * 4 + adamw_temporaries((n,), 4, foreach) + norms

    def phase_bytes(self, part: DsPartition) -> dict[str, int]:
        """Per phase, the bytes the direct evaluation for ``part`` keeps (its phases' ``bytes``)."""
        c = self.c
        zeros = sum(self.numels[i] for i in part.params if i in self.no_grad) * c
        f = min((self.first_bucket[p] for p in part.params if p in self.first_bucket), default=None)
        gip = part.overlapped * c if f is not None else 0
        loss = self.loss + (gip + zeros if self.later and self.stage == 2 else 0)
        out = {} if self.forward is None else {"forward": self.forward + loss}
        backward = max(self.plain, self.held.highest(f, gip), self.making.get(f, _NONE) + gip if f is not None
                       else _NONE)
        kept = gip + zeros + part.padding * c
        out["backward"] = int(max(backward + loss, self.last + loss + kept))
        copy = max(((k + 1) + x) * FP64 for k, x in enumerate(part.pieces)) if part.pieces else 0
        out["optimizer"] = max(kept + copy, kept + self.flat, self.update)
        return out


def ds_worst_rank(first: DsStage12Ranks, parts: list[DsPartition], later: DsStage12Ranks | None = None) -> int:
    """The first rank (of ``parts``, in rank order) whose largest phase is highest: each phase the higher of
    ``first``'s and ``later``'s (a later micro-batch's, under accumulation: the phases of ``first`` alone, as
    :func:`zeroexp.formulas.peak.phases.highest_phases` keeps them)."""
    def score(part: DsPartition) -> int:
        phases = first.phase_bytes(part)
        if later is not None:
            more = later.phase_bytes(part)
            phases = {ph: max(b, more[ph]) if ph in more else b for ph, b in phases.items()}
        return max(phases.values())

    return max(range(len(parts)), key=lambda r: score(parts[r]))
