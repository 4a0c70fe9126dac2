"""The planner's indexed paths equal the scans they replace, on random inputs (a deep model at 512 ranks asks each of
them thousands of times): the buckets opened below a gradient figure, a rank's elements of each shard, the owners
of ZeroRedundancyOptimizer's parameters and its worst rank, each unit's backward end. (The allocator's best fit:
tests/test_plan_cuda.)"""

from __future__ import annotations

import heapq
import random

from zeroexp.formulas.layout import _spread, local_numels, owner_assignment, owner_tuples
from zeroexp.formulas.peak.phases import Segment, _backward_ends, _opened_by
from zeroexp.formulas.shapes import Shard


def test_the_opened_buckets_are_the_sum_over_every_bucket():
    rnd = random.Random(3)
    for _ in range(3000):
        buckets = tuple(rnd.randint(0, 50) for _ in range(rnd.randint(0, 8)))
        kind = rnd.random()
        if kind < 0.4:  # the running sums (no bucket_edges)
            edges = [sum(buckets[:i]) for i in range(len(buckets) + 1)]
        elif kind < 0.8:  # traced edges, rising
            edges = sorted(rnd.randint(0, 200) for _ in range(len(buckets) + rnd.randint(0, 1)))
        else:  # any order: the scan itself
            edges = [rnd.randint(0, 200) for _ in range(len(buckets) + 1)]
        opened = _opened_by(buckets, edges)
        for at in (rnd.randint(-5, 250) for _ in range(6)):
            assert opened(at) == sum(b for b, lo in zip(buckets, edges) if lo < at)


def test_a_ranks_elements_are_its_chunks_overlap_with_every_span():
    rnd = random.Random(1)
    for _ in range(2000):
        n, shards = rnd.randint(1, 40), []
        for _ in range(rnd.randint(1, 4)):
            spans, end = [], 0
            for _ in range(rnd.randint(0, 6)):
                a = end + rnd.randint(0, 5)
                end = a + rnd.randint(0, 40)
                spans.append((a, end))
            shards.append(Shard(tuple(spans), -(-max(end, 1) // n) * n))
        shards = tuple(shards)
        logical, _ = _spread(shards, n)
        for r in range(n):
            chunks = [sum(max(0, min(b, (r + 1) * (p // n)) - max(a, r * (p // n))) for a, b in spans)
                      for spans, p in shards]
            assert local_numels(shards, n, r) == tuple(chunks)
            assert logical[r] == sum(chunks)


def test_the_owners_are_torchs_greedy_assignment():
    """Largest first (stable), each to the rank owning fewest elements, the lowest rank on ties."""
    rnd = random.Random(2)
    for _ in range(300):
        numels, n = tuple(rnd.randint(1, 30) for _ in range(rnd.randint(0, 40))), rnd.randint(1, 9)
        heap, owned = [(0, r) for r in range(n)], [[] for _ in range(n)]
        for i in sorted(range(len(numels)), key=lambda i: numels[i], reverse=True):
            size, rank = heapq.heappop(heap)
            owned[rank].append(i)
            heapq.heappush(heap, (size + numels[i], rank))
        assert owner_assignment(list(numels), n) == owned
        assert owner_tuples(numels, n) == tuple(tuple(o) for o in owned)


def test_each_units_backward_end_is_the_first_segment_ending_it():
    rnd = random.Random(4)
    for _ in range(200):
        units = [f"u{k}" for k in range(rnd.randint(1, 6))]
        segs = [Segment(rnd.choice(("forward", "backward")), rnd.choice(units), rnd.choice(("start", "end")), 0, {}, 0,
                        {}) for _ in range(rnd.randint(1, 30))]
        ends = _backward_ends(segs)
        for u in units:
            first = next((j for j, s in enumerate(segs) if (s.phase, s.unit, s.at) == ("backward", u, "end")), None)
            assert ends.get(u) == first


def test_zros_worst_rank_from_its_distinct_owned_sizes_is_the_highest_of_every_rank():
    """ZeroRedundancyOptimizer's ranks differ only by the sizes of what each steps: the planner's worst rank, found
    from one rank of each distinct list of them, has the phases of the first highest of every rank's (uneven sizes,
    a parameter without a gradient, repeated layers, N from 2 to 9, foreach and single-tensor AdamW)."""
    from zeroexp.formulas import LAYOUTS, ModelShape
    from zeroexp.formulas.device import CPU, cuda
    from zeroexp.formulas.layout import derive_groups
    from zeroexp.formulas.peak.phases import StepTrace
    from zeroexp.plan.check.memory import predict_phases, worst_rank_phases

    def seg(phase, unit, at, peak, end=None):
        end = peak if end is None else end
        return Segment(phase, unit, at, sum(peak.values()), peak, sum(end.values()), end)
    trace = StepTrace(1, (seg("forward", "root", "end", {"activations": 1000}),
                          seg("backward", "root", "end", {"activations": 300, "gradients": 400},
                              {"activations": 8, "gradients": 400})), loss_bytes=8, seed_bytes=4)
    rnd = random.Random(5)
    for _ in range(40):
        layer = [rnd.choice((16, 64, 96)) for _ in range(rnd.randint(1, 3))]
        numels = [rnd.randint(1, 200), *(layer * rnd.randint(1, 6)), rnd.randint(1, 50)]
        shape = ModelShape(tuple((k,) for k in numels), (tuple(range(len(numels))),), (True,),
                           unused=(0,) if rnd.random() < 0.5 else ())
        n = rnd.randint(2, 9)
        groups = derive_groups("zro", LAYOUTS["zro"], shape, n, 4)
        for device in (CPU, cuda(9.0)):
            every = max((predict_phases("zro", groups, shape, trace, 4, r, foreach=device.foreach, block=device.block)
                         for r in range(n)), key=lambda ph: max(v["bytes"] for v in ph.values()))
            assert worst_rank_phases("zro", groups, shape, trace, 4, "none", device=device) == every
