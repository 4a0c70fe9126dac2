"""The planner's indexed paths equal the scans they replace, on random inputs (a deep model at 512 ranks asks each of
them thousands of times): the buckets opened below a gradient figure, a rank's elements of each shard, the owners
of ZeroRedundancyOptimizer's parameters, each unit's backward end. (The allocator's best fit: tests/test_plan_cuda.)"""

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
