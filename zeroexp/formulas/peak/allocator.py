"""torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), for reserved memory beside allocated.

What ``torch.cuda.max_memory_reserved`` counts is the segments the allocator took from the driver (``cudaMalloc``),
which it keeps cached: a training step's reserved peak is the segments its live tensors needed, phase after phase,
never fewer than its allocated peak. The rules, as the allocator's source states them (default settings: no
``expandable_segments``, no ``max_split_size_mb``, one stream):

- ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512 B;
- a request of up to ``kSmallSize`` = 1 MiB comes from the small pool, whose segments are ``kSmallBuffer`` = 2 MiB;
  a larger one from the large pool, whose new segment (``get_allocation_size``) is ``kLargeBuffer`` = 20 MiB for a
  request under ``kMinLargeAlloc`` = 10 MiB, else the request rounded up to ``kRoundLarge`` = 2 MiB;
- ``get_free_block`` takes the pool's smallest cached free block that fits (ties: the lowest address);
  ``should_split`` cuts the rest off as a free block of its own when it is at least 512 B (small pool) or more than
  1 MiB (large pool), else the request keeps the whole block;
- a freed block merges with its free neighbours in its segment (``free_block``); segments are never returned
  (``empty_cache`` and the garbage collector's release under memory pressure are not modelled).

:class:`CachingAllocator` follows these rules over a sequence of requests and frees; :func:`reserved_peak` runs it
over the live blocks of the phases of a step, each phase's blocks freed before the next one's are taken.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (:class:`ExpandableAllocator`, the mode most LLM trainers
set: torchtitan's launch script, Megatron-LM's docs) each pool of a stream is one ``ExpandableSegment``: a virtual range
(larger than the device) mapped page by page with ``cuMemMap``, a page of ``kSmallBuffer`` = 2 MiB in the small pool
and ``kLargeBuffer`` = 20 MiB in the large one (``find_expandable_block``: ``segment_size = pool->is_small ?
kSmallBuffer : kLargeBuffer``; ``ExpandableSegment::map`` rounds a range out to whole pages). The rules, as its source
states them:

- ``get_free_block`` takes the smallest cached free block that fits, but a free block at the mapped end of the segment
  counts as the size it can grow to (``expandable_size``), so any other free block that fits is taken before it;
- ``should_split`` cuts off any rest of at least 512 B, in either pool;
- where no free block fits (``try_allocate_expandable_block``), the pages the request needs beyond the free block at
  the mapped end (if there is one) are mapped and merged with it; reserved bytes are the mapped pages, which stay
  mapped (``empty_cache`` unmaps them; not modelled).

Not modelled: what a request's order inside a phase does (a phase's blocks are taken at once, largest first), the
fragmentation that follows from it, a tensor freed on a side stream reused only after its event (FSDP1's
``limit_all_gathers``, FSDP2's all-gather and reduce-scatter streams: one stream here: with expandable segments each
stream maps a segment of its own), NCCL's own buffers and the CUDA context (outside the allocator:
:mod:`zeroexp.formulas.device_memory`).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterable, Mapping, Sequence

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE", "round_size",
           "counted", "counted_sum", "allocations", "segment_size", "CachingAllocator", "ExpandableAllocator",
           "reserved_peak"]

MIN_BLOCK = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 << 20  # kSmallSize: largest "small" allocation is 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
LARGE_BUFFER = 20 << 20  # kLargeBuffer: "large" allocations may be packed in 20 MiB blocks
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: allocations between 1 and 10 MiB may use kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: round up large allocations to 2 MiB


def round_size(nbytes: int) -> int:
    """A request's block size: at least 512 B, a multiple of 512 B (``round_size``)."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def counted(nbytes: int, block: int = 1) -> int:
    """What one allocation of ``nbytes`` adds to allocated bytes where each is counted in ``block``-byte blocks:
    ``block`` = :data:`MIN_BLOCK` on CUDA (``torch.cuda.memory_allocated`` counts the rounded block, as
    torch's MemTracker does for CUDA storages), 1 on the CPU. An empty tensor allocates nothing."""
    return -(-int(nbytes) // block) * block if nbytes > 0 else 0


def counted_sum(sizes: Iterable[int], block: int = 1) -> int:
    """:func:`counted` over allocations of ``sizes`` bytes each."""
    return sum(counted(b, block) for b in sizes)


def segment_size(nbytes: int) -> int:
    """The segment a request of ``nbytes`` takes from the driver when no cached block fits (``get_allocation_size``
    of its rounded size)."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class CachingAllocator:
    """The caching allocator's blocks on one stream: ``malloc`` returns a block id, ``free`` takes it back;
    ``allocated`` and ``reserved`` now, ``peak_allocated`` and ``peak_reserved`` since the start."""

    def __init__(self) -> None:
        # a block: [segment, offset, size, free]; a segment: whether it is the small pool's
        self._blocks: dict[int, list] = {}
        # (segment, offset) -> the block starting there, and the block ending there: a block's neighbours found at
        # once, not by a scan of every block (a segment's blocks tile it, so each lookup finds at most one)
        self._starts: dict[tuple[int, int], int] = {}
        self._ends: dict[tuple[int, int], int] = {}
        self._small: list[bool] = []
        # each pool's free blocks as sorted (size, segment, offset, id): the best fit is the first of at least the
        # request's size, found by bisection, not by a scan of every block
        self._free: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}
        self._next = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        at = bisect_left(pool, (size,))  # the smallest free block that fits, the lowest segment and offset on ties
        if at < len(pool):
            i = pool.pop(at)[3]
        else:  # a new segment
            self._small.append(small)
            self.reserved += segment_size(size)
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            i = self._new(len(self._small) - 1, 0, segment_size(size), free=False)
        rest = self._blocks[i][2] - size
        return self._take(i, size, rest >= MIN_BLOCK if small else rest > SMALL_SIZE)

    def _take(self, i: int, size: int, split: bool) -> int:
        """Block ``i`` allocated for a request of ``size`` (rounded) bytes, the rest of it cut off as a free block of
        its own where ``split`` (``should_split``)."""
        block = self._blocks[i]
        seg, off = block[0], block[1]
        if split:
            rest = block[2] - size
            del self._ends[(seg, off + block[2])]
            block[2] = size
            self._ends[(seg, off + size)] = i
            self._new(seg, off + size, rest)
        block[3] = False
        self.allocated += block[2]
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return i

    def free(self, i: int) -> None:
        block = self._blocks[i]
        block[3] = True
        self.allocated -= block[2]
        seg = block[0]
        j = self._ends.get((seg, block[1]))  # merge with the free neighbours in its segment: the one before
        if j is not None and j != i and self._blocks[j][3]:
            self._unlist(j)
            other = self._blocks.pop(j)
            del self._ends[(seg, block[1])], self._starts[(seg, block[1])]
            block[1], block[2] = other[1], block[2] + other[2]
            self._starts[(seg, block[1])] = i
        j = self._starts.get((seg, block[1] + block[2]))  # and the one after
        if j is not None and j != i and self._blocks[j][3]:
            self._unlist(j)
            other = self._blocks.pop(j)
            del self._starts[(seg, other[1])]
            block[2] += other[2]
            self._ends[(seg, block[1] + block[2])] = i
        insort(self._free[self._small[seg]], (block[2], seg, block[1], i))

    def _new(self, seg: int, off: int, size: int, free: bool = True) -> int:
        self._blocks[self._next] = [seg, off, size, True]
        self._starts[(seg, off)] = self._ends[(seg, off + size)] = self._next
        if free:
            insort(self._free[self._small[seg]], (size, seg, off, self._next))
        self._next += 1
        return self._next - 1

    def _unlist(self, i: int) -> None:
        """Take free block ``i`` off its pool's sorted list (before its size or offset changes)."""
        seg, off, size, _ = self._blocks[i]
        pool = self._free[self._small[seg]]
        del pool[bisect_left(pool, (size, seg, off, i))]


class ExpandableAllocator(CachingAllocator):
    """The caching allocator with ``expandable_segments:True`` on one stream: one segment a pool, mapped in pages
    (2 MiB small, 20 MiB large) as the requests need them; ``reserved`` is the mapped pages."""

    def __init__(self) -> None:
        super().__init__()
        self._small = [True, False]  # segment 0: the small pool's, 1: the large pool's
        self._mapped = [0, 0]

    @property
    def mapped(self) -> tuple[int, int]:
        """The bytes mapped in the small pool's segment and in the large pool's."""
        return self._mapped[0], self._mapped[1]

    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes)
        seg = 0 if size <= SMALL_SIZE else 1
        pool = self._free[seg == 0]
        tail = self._ends.get((seg, self._mapped[seg]))
        tail = tail if tail is not None and self._blocks[tail][3] else None
        at = bisect_left(pool, (size,))
        if at < len(pool) and pool[at][3] == tail:  # the free block at the mapped end: last (expandable_size)
            at += 1
        if at < len(pool):
            i = pool.pop(at)[3]
        elif tail is not None and self._blocks[tail][2] >= size:
            self._unlist(tail)
            i = tail
        else:  # map the pages the request needs beyond the free block at the end, merged with it
            page = SMALL_BUFFER if seg == 0 else LARGE_BUFFER
            have = self._blocks[tail][2] if tail is not None else 0
            grow = -(-(size - have) // page) * page
            end = self._mapped[seg]
            self._mapped[seg] += grow
            self.reserved += grow
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            if tail is None:
                i = self._new(seg, end, grow, free=False)
            else:
                self._unlist(tail)
                i = tail
                del self._ends[(seg, end)]
                self._blocks[i][2] += grow
                self._ends[(seg, end + grow)] = i
        # should_split: any rest of 512 B or more, in either pool
        return self._take(i, size, self._blocks[i][2] - size >= MIN_BLOCK)


def allocations(phase: dict) -> dict[str, int | tuple[int, ...]]:
    """A predicted phase's bytes above steady by category (``by_category``), where the model knows a category's
    tensors one by one (``blocks``: AdamW's foreach list) those sizes instead: what
    :func:`reserved_peak` places."""
    return {**phase["by_category"], **phase.get("blocks", {})}


def reserved_peak(steady: Mapping[str, int], phases: Iterable[Mapping[str, int | Sequence[int]]],
                  steps: int = 2, expandable: bool = False) -> tuple[int, int]:
    """The caching allocator's peak (reserved, allocated) bytes over ``steps`` steps. ``steady``: the blocks a rank
    holds between steps (bytes by name, one block each), taken first. ``phases``: each phase's bytes above steady by
    category, in phase order (:func:`allocations`); a positive one is one block, a sequence that many
    blocks (tensors the model knows one by one), taken with the phase's others at once, largest first; a
    negative one is a steady block of that name shrunk within the phase (``zero_grad`` freed the steady gradients:
    the block freed, what is left of it taken again with the phase's). At a phase's end its blocks are freed and the
    steady blocks it shrank taken back. A second step reuses the segments the first left cached. ``expandable``:
    ``expandable_segments:True`` (:class:`ExpandableAllocator`)."""
    alloc = ExpandableAllocator() if expandable else CachingAllocator()
    phases = list(phases)
    held = {name: alloc.malloc(int(b)) for name, b in steady.items() if b > 0}
    for _ in range(steps):
        for phase in phases:
            shrunk = [c for c, b in phase.items() if isinstance(b, int) and b < 0 and c in held]
            for c in shrunk:
                alloc.free(held.pop(c))
            sizes = [x for b in phase.values() for x in ((b,) if isinstance(b, int) else b) if x > 0]
            sizes += [steady[c] + phase[c] for c in shrunk]
            blocks = [alloc.malloc(int(b)) for b in sorted(sizes, reverse=True) if b > 0]
            for i in blocks:
                alloc.free(i)
            held.update({c: alloc.malloc(int(steady[c])) for c in shrunk})
    return alloc.peak_reserved, alloc.peak_allocated
