"""Every closed-form expectation zeroexp checks against, with its source. The planner and the probes share it.

Sources:
- [ZeRO] Rajbhandari, Rasley, Ruwase, He. "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC'20, arXiv:1910.02054. Section 5.1 (model-state memory per stage, K=12 for mixed-precision Adam),
  section 7 (communication volume), Figure 1.
- [NCCL-TESTS] NVIDIA nccl-tests, doc/PERFORMANCE.md: algorithm vs bus bandwidth; S is the full array, so for
  all_gather / reduce_scatter S = per-rank chunk x N; bus factor all_reduce 2(N-1)/N, all_gather and
  reduce_scatter (N-1)/N, broadcast 1.
- [FSDP] torch/distributed/fsdp/_flat_param.py: a FlatParameter is padded to a multiple of the world size
  before it is chunked into shards.

Conventions: P is the logical fp32 parameter bytes (numel x 4); factors are aggregate (sum over ranks of a
kind's bytes divided by P) unless a name says per-rank.
"""

from __future__ import annotations

import math

__all__ = ["padded_numel"]


def padded_numel(numel: int, world_size: int) -> int:
    """Elements a FlatParameter of ``numel`` elements occupies across all ranks: N * ceil(numel / N) [FSDP]."""
    return world_size * math.ceil(numel / world_size)
