"""The one expectation model: every closed form zeroexp checks against, with its source. Planner, probes and dry
run share it; it imports nothing else of zeroexp.

- :mod:`~zeroexp.formulas.paper`: the paper's closed forms, bus factors, padding rules, the dtype sizes;
- :mod:`~zeroexp.formulas.shapes`: the plain data: a model's shape, the byte-relevant knobs, a strategy's groups;
- :mod:`~zeroexp.formulas.layout`: groups -> per-rank bytes and per-step collectives (the layout arithmetic);
- :mod:`~zeroexp.formulas.deepspeed`: DeepSpeed's runtime model;
- :mod:`~zeroexp.formulas.hybrid`: hybrid sharding (HSDP): the shard and replicate groups of a 2-D mesh;
- :mod:`~zeroexp.formulas.families`: one module per strategy family, each owning what its strategies do and its
  rows; :mod:`~zeroexp.formulas.rows`: every row (``LAYOUTS``), named by ``strategy.layout``;
- :mod:`~zeroexp.formulas.time.rates`: a collective's time (latency + bus bytes / bus bandwidth, two-level ring),
compute
  rates, the device's overlap rule; :mod:`~zeroexp.formulas.time.overlap`: a step's time from its groups;
  :mod:`~zeroexp.formulas.time.framework`: the framework's own per-step work from calibrated primitives;
- :mod:`~zeroexp.formulas.peak.phases`: the peak model, each phase's bytes above steady; DeepSpeed's in
  :mod:`~zeroexp.formulas.peak.deepspeed`; :mod:`~zeroexp.formulas.peak.accumulation`: over the micro-batches of
  ``grad_accum``; :mod:`~zeroexp.formulas.peak.checkpointing`: what a checkpointed forward keeps and a unit's recompute
  adds.

Sources:
- [ZeRO] Rajbhandari, Rasley, Ruwase, He. "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC'20, arXiv:1910.02054. Section 5.1 (model-state memory per stage, K=12 for mixed-precision Adam),
  section 7 (communication volume), Figure 1.
- [NCCL-TESTS] NVIDIA nccl-tests, doc/PERFORMANCE.md: algorithm vs bus bandwidth; S is the full array, so for
  all_gather / reduce_scatter S = per-rank chunk x N; bus factor all_reduce 2(N-1)/N, all_gather and
  reduce_scatter (N-1)/N, broadcast 1, reduce 1.
- [FSDP] torch/distributed/fsdp/_flat_param.py: a FlatParameter is padded to a multiple of the world size
  before it is chunked into shards; with ``use_orig_params`` each parameter starts 16-byte aligned.
- [FSDP2] torch/distributed/fsdp/_fully_shard/_fsdp_param.py: each parameter is chunked on dim 0 and every
  chunk padded to the first's size; _fsdp_collectives.py: one all_gather and one reduce_scatter per unit.
- [OFFLOAD] Ren et al. "ZeRO-Offload", arXiv:2101.06840, section 4 (optimizer state and gradient partitions on
  the host); Rajbhandari et al. "ZeRO-Infinity", arXiv:2104.07857 (parameters too, with stage 3).
- [DS] DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py (``bit16_groups_flat`` padded to a multiple of 2N
  elements, ``nccl_start_alignment_factor``; the fp32 partition ``single_partition_of_fp32_groups`` at any
  precision; ``get_flat_partition``: the gradient partition as views of the full gradients of the parameters it
  overlaps, ``grads_in_partition`` with contiguous gradients, plus a zeros tensor for the partition's padding),
  stage3.py (every parameter partitioned on its own, padded to N: ``_padding_size``; the fp32 partition
  ``fp32_partitioned_groups_flat`` and ``grad_partitions_flat_buffer`` per sub-group of ``sub_group_size``
  elements), runtime/zero/config.py (defaults). The deepspeed_stage* rows of ``LAYOUTS`` are DeepSpeed 0.19
  as zeroexp's state probe measures it (zeroexp.strategies.deepspeed, CPU, gloo), this source read alongside.

Conventions: P is the logical fp32 parameter bytes (numel x 4); factors are aggregate (sum over ranks of a
kind's bytes divided by P) unless a name says per-rank.
"""

from zeroexp.formulas.deepspeed import *  # noqa: F401,F403
from zeroexp.formulas.time.framework import *  # noqa: F401,F403
from zeroexp.formulas.time.framework import __all__ as _framework
from zeroexp.formulas.deepspeed import __all__ as _deepspeed
from zeroexp.formulas.layout import *  # noqa: F401,F403
from zeroexp.formulas.layout import __all__ as _layout
from zeroexp.formulas.paper import *  # noqa: F401,F403
from zeroexp.formulas.paper import __all__ as _paper
from zeroexp.formulas.hybrid import MESH_DIMS
from zeroexp.formulas.shapes import POST_FORWARD, WORLD
from zeroexp.formulas.time.overlap import *  # noqa: F401,F403
from zeroexp.formulas.time.overlap import __all__ as _overlap
from zeroexp.formulas.rows import LAYOUTS
from zeroexp.formulas.families.ddp import buffer_broadcasts, ddp_buckets
from zeroexp.formulas.time.rates import *  # noqa: F401,F403
from zeroexp.formulas.time.rates import __all__ as _time

__all__ = [*_paper, *_layout, *_deepspeed, *_time, *_overlap, *_framework, "LAYOUTS", "ddp_buckets",
           "buffer_broadcasts", "MESH_DIMS",
           "WORLD", "POST_FORWARD"]
