"""Every closed-form expectation zeroexp checks against, with its source. The planner and the probes share it.

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
  elements), runtime/zero/config.py (defaults). The deepspeed_stage* rows of :data:`LAYOUTS` are DeepSpeed 0.19
  as zeroexp's state probe measures it (zeroexp.strategies.deepspeed, CPU, gloo), this source read alongside.

Conventions: P is the logical fp32 parameter bytes (numel x 4); factors are aggregate (sum over ranks of a
kind's bytes divided by P) unless a name says per-rank.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

__all__ = ["padded_numel", "zero_state_factors", "bus_factor", "bus_bytes", "ddp_collectives", "zero1_collectives",
           "fsdp_collectives", "fp16_inf_syncs", "fsdp2_padded_numel", "sharded_zero_state_factors", "deepspeed_state_factors", "sharded_zero_rank_bytes", "sharded_zero_collectives", "deepspeed_collectives", "deepspeed_ipg_buckets",
           "deepspeed_allreduce_chunks", "deepspeed_reduce_bucket_numel", "deepspeed_sub_groups", "deepspeed_payload_limits",
           "COMPUTE_ITEMSIZE", "STATE_KINDS", "ModelShape", "PlanKnobs", "Groups", "StateLayout", "LAYOUTS",
           "owner_numels", "rank_state_bytes", "step_collectives", "unsharded_floor_bytes", "offloaded_kinds"]


def padded_numel(numel: int, world_size: int) -> int:
    """Elements a FlatParameter of ``numel`` elements occupies across all ranks: N * ceil(numel / N) [FSDP]."""
    return world_size * math.ceil(numel / world_size)


def zero_state_factors(stage: int, world_size: int, params_resharded: bool = False) -> dict[str, float]:
    """Aggregate model-state factors of fp32 AdamW at ZeRO ``stage``, at the optimizer boundary [ZeRO 5.1].

    Per rank, fp32 Adam holds parameters P, gradients P and two moments 2P; stage 1 (P_os) shards the
    moments, stage 2 (P_os+g) also the gradients, stage 3 (P_os+g+p) also the parameters, each to 1/N per
    rank. Summed over N ranks and divided by P: stage 0 -> N/N/2N, 1 -> N/N/2, 2 -> N/1/2, 3 -> 1/1/2.
    ``params_resharded``: parameters are sharded outside computation, so at the optimizer boundary the
    parameter factor is 1 even at stage 2 (FSDP SHARD_GRAD_OP: "parameters are sharded outside
    computation", torch.distributed.fsdp.ShardingStrategy), unlike canonical ZeRO-2 which keeps N.
    Adam's per-parameter ``step`` scalars are not part of the formula (reported apart as ``optim_scalar``).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = float(world_size)
    return {
        "param": 1.0 if stage >= 3 or params_resharded else n,
        "grad": 1.0 if stage >= 2 else n,
        "optim": 2.0 if stage >= 1 else 2.0 * n,
    }


# --- collectives: payload S and bus bytes [NCCL-TESTS], per-step payload model [ZeRO 7] ------------------
# A model maps each collective op to {"count": calls per step per rank, "payload_bytes": sum of S}.
Collectives = dict[str, dict[str, int]]


def bus_factor(op: str, world_size: int) -> float | None:
    """Bus bytes / S of one collective on N ranks [NCCL-TESTS]; None for ops the convention does not cover.

    all_reduce 2(N-1)/N, all_gather and reduce_scatter (N-1)/N, broadcast and reduce 1. S (the payload) is
    the full array: for all_gather and reduce_scatter, one rank's chunk x N.
    """
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0}.get(op)


def bus_bytes(op: str, payload_bytes: int, world_size: int) -> int | None:
    """S x :func:`bus_factor`: the bytes each rank's links carry in the ring model; never the payload itself."""
    factor = bus_factor(op, world_size)
    return None if factor is None else round(payload_bytes * factor)


def _add(model: Collectives, op: str, sizes: list[int]) -> Collectives:
    """``model`` with ``len(sizes)`` more calls of ``op`` totalling ``sum(sizes)`` payload bytes (none: unchanged)."""
    if sizes:
        entry = model.setdefault(op, {"count": 0, "payload_bytes": 0})
        entry["count"] += len(sizes)
        entry["payload_bytes"] += int(sum(sizes))
    return model


def _model(**ops: list[int]) -> Collectives:
    model: Collectives = {}
    for op, sizes in ops.items():
        _add(model, op, sizes)
    return model


def ddp_collectives(bucket_bytes: list[int]) -> Collectives:
    """ZeRO-0 (plain data parallelism) [ZeRO 7.1]: one gradient all_reduce per DDP bucket; S totals P."""
    return _model(all_reduce=bucket_bytes)


def zero1_collectives(bucket_bytes: list[int], broadcast_bytes: list[int]) -> Collectives:
    """ZeRO-1 as torch's ZeroRedundancyOptimizer does it: DDP's gradient all_reduce (P) [ZeRO 7.2.1], then
    each owner broadcasts its updated parameters (ZeroRedundancyOptimizer._sync_params), one broadcast per
    parameter or per owner bucket: S totals P. Canonical ZeRO-1 all-gathers the parameters instead."""
    return _model(all_reduce=bucket_bytes, broadcast=broadcast_bytes)


def fsdp_collectives(unit_bytes: list[int], gathers_per_unit: list[int],
                     reduce_bytes: list[int] | None = None, inf_syncs: int = 0) -> Collectives:
    """FSDP [ZeRO 7.2.2]: per unit of padded flat bytes b, all_gather S = b before forward, and again before
    backward when the unit was resharded after forward (FULL_SHARD, non-root: ``gathers_per_unit`` 2), then
    one reduce_scatter S = b of its gradient. SHARD_GRAD_OP: P + P; FULL_SHARD: 2P + P (P padded) [FSDP].
    ``reduce_bytes``: the units' reduce_scatter S when the gradients are reduced in another dtype than the
    parameters are gathered in (``MixedPrecision`` / ``MixedPrecisionPolicy`` ``reduce_dtype``); default
    ``unit_bytes``. ``inf_syncs``: all_reduces of an fp16 loss scaler's found_inf flag (one fp32 element each,
    ``ShardedGradScaler.unscale_``; torch/distributed/fsdp/sharded_grad_scaler.py)."""
    gathers = [b for b, k in zip(unit_bytes, gathers_per_unit) for _ in range(k)]
    return _model(all_gather=gathers, reduce_scatter=list(unit_bytes if reduce_bytes is None else reduce_bytes),
                  all_reduce=[4] * inf_syncs)


def fsdp2_padded_numel(shape: tuple[int, ...] | list[int], world_size: int) -> int:
    """Elements an FSDP2 parameter of ``shape`` occupies across all ranks: dim 0 chunked over N, every chunk
    padded to the first's ``ceil(dim0 / N)`` rows, so N * ceil(dim0 / N) * (numel / dim0) [FSDP2]."""
    if not shape:
        return world_size  # a 0-dim parameter is viewed as one row
    rest = math.prod(shape[1:])
    return world_size * math.ceil(shape[0] / world_size) * rest


# --- zeroexp's own ZeRO-1 / ZeRO-2 (zeroexp.sharding) ----------------------------------------------------
def sharded_zero_state_factors(stage: int, world_size: int, compute_itemsize: int = 4) -> dict[str, float]:
    """Aggregate factors of zeroexp's ZeRO-1/2 at the optimizer boundary [ZeRO 5.1], in units of P = 4 Psi.

    Per rank: compute-dtype parameters c Psi and gradients c Psi (stage 1) or c Psi / N (stage 2, the shard),
    then K Psi / N with K = 12: the fp32 master (4) and Adam's two fp32 moments (8). Summed over N ranks and
    divided by P: param N c/4, grad N c/4 (stage 1) or c/4 (stage 2), optim 2, master 1. The master is kept
    apart even when c = 4 (fp32), as DeepSpeed's ZeRO-1/2 does (``single_partition_of_fp32_groups``).
    """
    if stage not in (1, 2):
        raise ValueError(f"zeroexp's sharded optimizer implements ZeRO stage 1 or 2, got {stage}")
    n, c = float(world_size), compute_itemsize / 4
    return {"param": n * c, "grad": n * c if stage == 1 else c, "optim": 2.0, "master": 1.0}


def deepspeed_state_factors(stage: int, world_size: int, compute_itemsize: int = 4,
                            offload: str = "none") -> dict[str, float]:
    """Aggregate factors of DeepSpeed ZeRO at the optimizer boundary (before ``engine.step`` frees the gradients)
    [DS], in units of P = 4 Psi, compute dtype c bytes.

    Parameters: N c/4 replicated (stages 0-2, stage 1/2 as ``bit16_groups_flat``), c/4 partitioned (stage 3).
    Gradients: N c/4 at stage 0; from stage 1 on, the rank's reduced partition, c/4 (stage 1 too frees the full
    gradients once reduced: ``averaged_gradients`` is the partition); with optimizer offload the fp32
    partition on the host (1) at stages 1-2, both the compute-dtype partition and the fp32 one at stage 3. Moments 2 (2N at stage 0). ``master`` (fp32): 1 at stages 1-3 (``single_partition_of_fp32_groups``,
    ``fp32_partitioned_groups_flat``, kept in fp32 training too), N at stage 0 with mixed precision (the FP16
    optimizer's full copy), absent at stage 0 in fp32.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n, c = float(world_size), compute_itemsize / 4
    out = {"param": c if stage == 3 else n * c, "grad": n * c if stage == 0 else c,
           "optim": 2.0 * n if stage == 0 else 2.0}
    if offload != "none" and stage in (1, 2):
        out["grad"] = 1.0  # the fp32 gradient partition on the host replaces the compute-dtype one
    elif offload != "none" and stage == 3:
        out["grad"] = c + 1.0  # grad_partitions_flat_buffer (compute dtype) and its fp32 copy on the host
    if stage > 0:
        out["master"] = 1.0
    elif compute_itemsize != 4:
        out["master"] = n
    return out


def sharded_zero_rank_bytes(stage: int, numel: int, world_size: int, compute_itemsize: int = 2) -> float:
    """Model-state bytes per rank [ZeRO 5.1, Figure 1]: 2Psi + 2Psi + 12Psi/N (stage 1) and 2Psi + 14Psi/N
    (stage 2) with fp16/bf16 compute (``compute_itemsize`` 2); Psi = ``numel``, padding excluded."""
    c, n = compute_itemsize, world_size
    return c * numel + (c * numel if stage == 1 else c * numel / n) + 12 * numel / n


def sharded_zero_collectives(bucket_bytes: list[int], reduce: str = "reduce_scatter",
                             norm_allreduce: bool = False) -> Collectives:
    """zeroexp's ZeRO-1/2 [ZeRO 7.2.1]: per bucket of padded compute-dtype bytes b, one reduce_scatter S = b of
    the gradients and one all_gather S = b of the updated parameters: P + P per step, the bus bytes of DDP's
    all_reduce (2 (N-1)/N P) [NCCL-TESTS]. ``reduce="allreduce"`` (the naive ZeRO): one all_reduce S = b per
    bucket instead of the reduce_scatter, 1.5x the bus bytes. ``norm_allreduce`` (gradient clipping or fp16
    loss scaling): one more all_reduce of one fp32 scalar, the squared global gradient norm."""
    reduces = list(bucket_bytes) if reduce == "allreduce" else []
    return _model(reduce_scatter=[] if reduce == "allreduce" else list(bucket_bytes), all_gather=list(bucket_bytes),
                  all_reduce=reduces + ([4] if norm_allreduce else []))


# --- DeepSpeed's runtime collectives [DS-COMM] ----------------------------------------------------------
# [DS-COMM] DeepSpeed 0.19.8: runtime/engine.py (allreduce_gradients -> buffered_allreduce_fallback ->
# allreduce_no_retain, MEMORY_OPT_ALLREDUCE_SIZE); runtime/zero/stage_1_and_2.py (reduce_gradients,
# reduce_independent_p_g_buckets_and_remove_grads, average_tensor -> allreduce_and_scatter, get_grad_norm_direct,
# has_overflow, step -> runtime/utils.py all_gather_dp_groups -> all_gather_into_tensor_dp_groups);
# runtime/zero/stage3.py (reduce_independent_p_g_buckets_and_remove_grads, __avg_scatter_grads ->
# runtime/comm/coalesced_collectives.py reduce_scatter_coalesced, _get_norm_groups, has_overflow);
# runtime/zero/partitioned_param_coordinator.py (fetch_sub_module: the current module's parameters, then a
# prefetch of the traced parameters up to prefetch_bucket_size, each one all_gather_coalesced call).
#: engine.py MEMORY_OPT_ALLREDUCE_SIZE: the elements per all_reduce of ZeRO-0's buffered_allreduce_fallback.
DS_MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000


def deepspeed_allreduce_chunks(numels: list[int], numel_per_bucket: int) -> list[int]:
    """engine.allreduce_no_retain / stage_1_and_2.allreduce_and_scatter [DS-COMM]: tensors are appended in
    order and the chunk is all-reduced as soon as it holds *more* than ``numel_per_bucket`` elements, then the
    rest: the element counts of the all_reduce calls."""
    chunks, numel = [], 0
    for n in numels:
        numel += n
        if numel > numel_per_bucket:
            chunks.append(numel)
            numel = 0
    return chunks + ([numel] if numel else [])


def deepspeed_ipg_buckets(numels: list[int], reduce_bucket_size: int) -> list[list[int]]:
    """The gradient buckets (``ipg_buckets``) of ZeRO-1/2/3 [DS-COMM]: gradients enter in arrival order; before
    one is added, a bucket that would exceed ``reduce_bucket_size`` elements is reduced; the last bucket is
    reduced at the end of backward (``independent_gradient_partition_epilogue`` / stage 3's epilogue).
    The gradients' element counts, per bucket. A parameter larger than the bucket is reduced on its own in DeepSpeed by a
    different path (``extra_large_param_to_reduce``): the caller must not pass one."""
    buckets: list[list[int]] = [[]]
    for n in numels:
        if n > reduce_bucket_size:
            raise ValueError(f"a parameter of {n} elements exceeds reduce_bucket_size={reduce_bucket_size}")
        if buckets[-1] and sum(buckets[-1]) + n > reduce_bucket_size:
            buckets.append([])
        buckets[-1].append(n)
    return [b for b in buckets if b]


def deepspeed_collectives(stage: int, world_size: int, grad_numels: list[int], grad_itemsize: int,
                          reduce_bucket_size: int, *, flat_group_bytes: list[int] = (),
                          gather_numels: list[list[int]] = (), param_itemsize: int = 4, norm_groups: int = 0,
                          norm_itemsize: int = 4, overflow_check: bool = False) -> Collectives:
    """Per-step collectives of one rank of DeepSpeed ZeRO ``stage`` (no offload) [DS-COMM], S per [NCCL-TESTS].

    ``grad_numels``: the gradients in the order DeepSpeed reduces them (stage 0 and 1: parameter order, at the
    step; 2 and 3: backward hook order), of ``grad_itemsize`` bytes (the communication dtype).
    - stage 0: all_reduce of the gradients in chunks of more than ``DS_MEMORY_OPT_ALLREDUCE_SIZE`` elements (P).
    - stage 1/2: one all_reduce per gradient bucket (``average_tensor`` with ``use_multi_rank_bucket_allreduce``:
      every rank's slice of the bucket in one all_reduce; P in total), one fp32 all_reduce of the squared
      gradient norm per parameter group (``norm_groups``), fp16 one uint8 overflow all_reduce, and after the
      optimizer step one all_gather of each padded bit16 flat group (``flat_group_bytes``; P).
    - stage 3: one reduce_scatter per gradient bucket (``reduce_scatter_coalesced``: each gradient padded to a
      multiple of N; P), one all_reduce of the squared norm per sub-group in the norm dtype (fp64 where the
      accelerator has it), fp16 one uint8 overflow all_reduce, and one all_gather per parameter fetch
      (``gather_numels``: the full, N-padded numels of the parameters of each ``all_gather_coalesced``; P).
    """
    n = world_size
    if stage == 0:
        return _model(all_reduce=[c * grad_itemsize
                                  for c in deepspeed_allreduce_chunks(grad_numels, DS_MEMORY_OPT_ALLREDUCE_SIZE)])
    scalars = [norm_itemsize] * norm_groups + ([1] if overflow_check else [])
    if stage in (1, 2):
        buckets = deepspeed_ipg_buckets(grad_numels, reduce_bucket_size)
        return _model(all_reduce=[sum(b) * grad_itemsize for b in buckets] + scalars, all_gather=list(flat_group_bytes))
    if stage == 3:
        buckets = deepspeed_ipg_buckets(grad_numels, reduce_bucket_size)
        return _model(reduce_scatter=[sum(padded_numel(g, n) for g in bk) * grad_itemsize for bk in buckets],
                      all_reduce=scalars,
                      all_gather=[sum(padded_numel(g, n) for g in gather) * param_itemsize for gather in gather_numels])
    raise ValueError(f"DeepSpeed ZeRO stage {stage}: 0, 1, 2 or 3")


# --- the planner's strategy table: where each strategy keeps its state and what it sends per step ---------
#: Bytes per element of a precision's compute dtype (parameters, gradients); masters and moments are fp32.
COMPUTE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The model-state kinds the planner predicts, named as the state probe names them.
STATE_KINDS = ("param", "grad", "optim", "master")
_MOMENTS, _MASTER, _STEP = 8, 4, 4  # bytes per element: Adam's fp32 exp_avg + exp_avg_sq; fp32 master; ``step``


@dataclass(frozen=True)
class ModelShape:
    """What the planner knows of a model.

    ``params``: each parameter's shape in definition order (a shared one once); ``units``: the FSDP units, each
    the indices of its parameters in FlatParameter order, ``root`` marking the root unit. Known only by its
    count (:meth:`from_count`), a model is one flat parameter whose units are unknown (``exact`` False).
    """

    params: tuple[tuple[int, ...], ...]
    units: tuple[tuple[int, ...], ...]
    root: tuple[bool, ...]
    exact: bool = True

    @classmethod
    def from_count(cls, numel: int) -> ModelShape:
        """A model known only by its number of parameters."""
        return cls(((int(numel),),), ((0,),), (False,), exact=False)

    @property
    def numels(self) -> tuple[int, ...]:
        """Each parameter's number of elements."""
        return tuple(math.prod(s) for s in self.params)

    @property
    def numel(self) -> int:
        """Psi: the number of parameters."""
        return sum(self.numels)


@dataclass(frozen=True)
class PlanKnobs:
    """Strategy settings that change bytes: zeroexp's ZeRO buckets (``strategy.bucket_cap_mb``, ``reduce``, the
    norm all_reduce of clipping or loss scaling), FSDP ``use_orig_params`` (16-byte aligned parameters in the
    FlatParameter, Adam moments per unpadded view) [FSDP]; DeepSpeed's reduce bucket is ``bucket_cap_bytes`` / 4
    elements (:func:`deepspeed_reduce_bucket_numel`) and ``loss_scaling`` (fp16) adds its overflow all_reduce."""

    bucket_cap_bytes: int = 25 * 2**20
    reduce: str = "reduce_scatter"
    norm_allreduce: bool = False
    use_orig_params: bool = False
    loss_scaling: bool = False  # fp16 dynamic loss scaling: DeepSpeed ZeRO-3 all-reduces an overflow flag


class Groups(NamedTuple):
    """What a payload model sees: the padded compute-dtype bytes of each group the strategy sends (FSDP units,
    buckets, flat buffers; the unpadded parameters for replicated strategies), which is FSDP's root unit; and the
    model's parameters (their numels, in definition order), N and the compute dtype's itemsize, for a payload model
    that needs them (DeepSpeed's, which cuts its own buckets)."""

    nbytes: list[int]
    root: list[bool]
    knobs: PlanKnobs
    numels: tuple[int, ...] = ()
    world_size: int = 1
    itemsize: int = 4


@dataclass(frozen=True)
class StateLayout:
    """Where one strategy keeps each kind of model state at the optimizer boundary, and what it sends per step.

    ``sharded``: the kinds each rank holds 1/N of (``param``, ``grad``, ``optim``; a master follows ``optim``).
    ``master``: a separate fp32 copy of the parameters ``always`` (even in fp32 training), only when the compute
    dtype is not fp32 (``mixed``: the paper's K = 12 = 4 + 8 [ZeRO 5.1]) or ``never``. ``groups``: how sharded
    kinds are cut: ``flat`` (one buffer padded to ``pad`` x N), ``params`` (each parameter padded to N),
    ``units`` (FSDP FlatParameters padded to N), ``rows`` (each parameter's dim 0 chunked, chunks padded [FSDP2]),
    ``buckets`` (zeroexp.sharding's, padded to N), ``owners`` (whole parameters, as ZeroRedundancyOptimizer
    assigns them) or ``none``; the replicated kinds of ``flat`` and ``buckets`` are the padded buffers.
    ``payload``: the per-step collectives [ZeRO 7], over the FSDP units for ``units`` and ``rows``. ``gather``:
    unsharded parameters held on top of the state while computing: the ``largest`` unit, ``all``, ``none``.
    ``fp32_at_rest``: parameters and gradients stay fp32 between steps, the compute dtype is only what is
    gathered and reduced (FSDP ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``). ``fp32_on_the_wire``: the
    collectives move fp32 whatever the precision (autocast: DDP all-reduces the fp32 gradients). ``padded_moments``: Adam's moments are as long as the
    padded shard. ``precisions`` and ``offloads``: the settings this byte model covers.

    DeepSpeed's rows [DS]: ``partition_logical``: a sharded kind's logical bytes are its partition's length, padding
    included (DeepSpeed's partitions are what zeroexp's adapter reports). ``grad_held``: ``shard`` (the gradient
    shard only) or ``params`` (ZeRO-1/2: the full gradient of every parameter the rank's partition overlaps, and the
    partition's padding as zeros; a model known by its count has no boundaries: the shard). ``offload_grad``: with
    an offloaded optimizer the fp32 gradient partition on the host ``replace``s the compute-dtype gradient
    (ZeRO-1/2) or is ``add``ed to it (ZeRO-3), ``none``: no change. ``flat_optimizer``: the torch optimizer steps one
    flat fp32 partition per group (ZeRO-3: per sub-group of ``DS_SUB_GROUP_SIZE`` elements), one ``step`` scalar
    each. ``payload_limits``: ``(shape, knobs, precision, offload) -> reasons`` the payload model is not exact for
    a cell (empty: exact); None: the payload model claims every cell it covers.
    """

    label: str
    stage: int
    sharded: frozenset[str]
    master: str
    groups: str
    payload: Callable[[Groups], Collectives]
    gather: str = "none"
    pad: int = 1
    fp32_at_rest: bool = False
    fp32_on_the_wire: bool = False
    padded_moments: bool = True
    precisions: frozenset[str] = frozenset({"fp32"})
    offloads: frozenset[str] = frozenset({"none"})
    source: str = ""
    partition_logical: bool = False
    grad_held: str = "shard"
    offload_grad: str = "none"
    flat_optimizer: bool = False
    payload_limits: Callable[..., list[str]] | None = None


def _all_reduce(g: Groups) -> Collectives:
    return ddp_collectives([sum(g.nbytes)])


def _all_reduce_broadcast(g: Groups) -> Collectives:
    return zero1_collectives([sum(g.nbytes)], [sum(g.nbytes)])


def _scatter_gather(g: Groups) -> Collectives:
    return sharded_zero_collectives(g.nbytes, g.knobs.reduce, g.knobs.norm_allreduce)


def fp16_inf_syncs(dtensor_grads: bool) -> int:
    """All_reduces per step of an fp16 loss scaler's found_inf flag (one fp32 element each) when every rank holds
    only gradient shards: ``ShardedGradScaler.unscale_`` all-reduces it once; with DTensor gradient shards (FSDP2)
    DTensor's dispatch of the inf check (``_amp_foreach_non_finite_check_and_unscale_``) reduces its found_inf
    output once more, a functional all_reduce (both seen with the torch profiler, torch 2.13, gloo)."""
    return 2 if dtensor_grads else 1


def _syncs(g: Groups, groups: str) -> int:
    return fp16_inf_syncs(dtensor_grads=groups == "rows") if g.knobs.loss_scaling else 0


def _gather_once(g: Groups, groups: str = "units") -> Collectives:
    return fsdp_collectives(g.nbytes, [1] * len(g.nbytes), inf_syncs=_syncs(g, groups))


def _gather_twice(g: Groups) -> Collectives:
    return fsdp_collectives(g.nbytes, [1 if root else 2 for root in g.root], inf_syncs=_syncs(g, "units"))


def _gather_twice_root_too(g: Groups) -> Collectives:
    return fsdp_collectives(g.nbytes, [2] * len(g.nbytes), inf_syncs=_syncs(g, "rows"))


# --- DeepSpeed's rows [DS], [DS-COMM] ----------------------------------------------------------------------
#: runtime/zero/config.py defaults zeroexp's ds_config leaves alone: stage 3's optimizer sub-group
#: (``sub_group_size``), prefetch bucket, live parameters and reuse distance, in elements.
DS_SUB_GROUP_SIZE = 1_000_000_000
DS_PREFETCH_BUCKET_SIZE = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
DS_MAX_REUSE_DISTANCE = 1_000_000_000
#: Parameter elements stage 3 fetches once per step and keeps for backward: within one prefetch bucket, and
#: below the live-parameter and reuse-distance limits, nothing is released before backward.
_DS_FETCH_LIMIT = min(DS_PREFETCH_BUCKET_SIZE, DS_MAX_LIVE_PARAMETERS, DS_MAX_REUSE_DISTANCE)


def deepspeed_reduce_bucket_numel(knobs: PlanKnobs) -> int:
    """DeepSpeed's ``reduce_bucket_size`` as zeroexp.strategies.deepspeed.ds_config sets it: ``bucket_cap_mb`` MiB
    of 4-byte elements, rounded down to even (DeepSpeed asserts a multiple of its NCCL start alignment, 2)."""
    return knobs.bucket_cap_bytes // 4 // 2 * 2


def deepspeed_sub_groups(partition_numels: list[int] | tuple[int, ...],
                         sub_group_size: int = DS_SUB_GROUP_SIZE) -> int:
    """How many optimizer sub-groups ZeRO-3 cuts one parameter group into (stage3.py ``_create_fp16_sub_groups``):
    one when the partitions total at most ``sub_group_size`` elements, else a new one each time a running total
    of the parameters' partitions reaches it."""
    if sum(partition_numels) <= sub_group_size:
        return 1
    groups, size = 0, 0
    for i, k in enumerate(partition_numels):
        size += k
        if size >= sub_group_size or i == len(partition_numels) - 1:
            groups, size = groups + 1, 0
    return groups


def _deepspeed_payload(stage: int, g: Groups) -> Collectives:
    """DeepSpeed's per-step collectives (:func:`deepspeed_collectives`, no offload) from the model's parameters,
    in DeepSpeed's default settings as zeroexp configures them: reduce bucket from ``bucket_cap_mb``; stages 1-2
    one parameter group (one fp32 norm all_reduce; bf16 and fp16 one uint8 overflow all_reduce,
    ``check_grad_overflow``), gradients reduced in parameter order (1) or backward order, taken as the reverse (2);
    stage 3 one fp64 norm all_reduce per sub-group, fp16 an overflow flag, one all_gather of every parameter when
    the model fits one prefetch bucket (gathered parameters are reused by backward), else twice (forward and
    backward, as the paper: DeepSpeed's fetch schedule beyond one bucket is not modelled). A parameter larger than
    the reduce bucket is reduced on its own (``extra_large_param_to_reduce``, read, not measured)."""
    n, c, numels = g.world_size, g.itemsize, [k for k in g.numels if k]
    bucket = deepspeed_reduce_bucket_numel(g.knobs)
    if stage == 0:
        return deepspeed_collectives(0, n, numels, c, 0)
    fit, big = [k for k in numels if k <= bucket], [k for k in numels if k > bucket]
    if stage in (1, 2):
        model = deepspeed_collectives(stage, n, fit if stage == 1 else fit[::-1], c, bucket,
                                      flat_group_bytes=list(g.nbytes), norm_groups=1, overflow_check=c != 4)
        return _add(model, "all_reduce", [k * c for k in big])
    gathers = 1 if sum(numels) <= _DS_FETCH_LIMIT else 2
    model = deepspeed_collectives(3, n, fit[::-1], c, bucket, gather_numels=[numels] * gathers, param_itemsize=c,
                                  norm_groups=deepspeed_sub_groups([padded_numel(k, n) // n for k in numels]), norm_itemsize=8,
                                  overflow_check=g.knobs.loss_scaling)
    return _add(model, "reduce_scatter", [padded_numel(k, n) * c for k in big])


def deepspeed_payload_limits(stage: int, shape: ModelShape, knobs: PlanKnobs, precision: str,
                             offload: str) -> list[str]:
    """Why :func:`_deepspeed_payload` is not DeepSpeed's real per-step payload for a cell (empty: it is, as the
    collectives probe measures it on CPU / gloo): the cases zeroexp.strategies.deepspeed's own collectives model
    refuses too, and what was never run."""
    reasons = []
    if offload != "none":
        reasons.append(f"offload={offload}: DeepSpeed's offloaded gradient and norm collectives are not modelled")
    if precision == "fp16":
        reasons.append("fp16: DeepSpeed's overflow and loss-scale collectives are read, not measured (fp16 needs a GPU)")
    if not shape.exact:
        reasons.append("a parameter count: DeepSpeed's buckets need the parameters' shapes")
        return reasons
    bucket = deepspeed_reduce_bucket_numel(knobs)
    if stage > 0 and max(shape.numels) > bucket:
        reasons.append(f"a parameter of {max(shape.numels)} elements exceeds reduce_bucket_size={bucket}: reduced on its "
                       "own (extra_large_param_to_reduce), not measured")
    limit = _DS_FETCH_LIMIT
    if stage == 3 and shape.numel > limit:
        reasons.append(f"stage 3: {shape.numel} parameter elements exceed one prefetch bucket ({limit}): DeepSpeed's "
                       "fetch and release schedule is not modelled")
    return reasons


_MIXED = frozenset({"fp32", "bf16", "fp16"})
_OS, _OS_G, _OS_G_P = frozenset({"optim"}), frozenset({"optim", "grad"}), frozenset({"optim", "grad", "param"})
_OFF = [frozenset({"none"}), frozenset({"none", "optimizer"}), frozenset({"none", "optimizer", "full"})]
_DS_SOURCE = ("DeepSpeed 0.19, measured by zeroexp's state probe (CPU, gloo; fp32 and bf16, offload none and "
              "optimizer, stage 3 full; fp16 read, not run: it needs a GPU); [DS] source")

#: Every strategy the planner knows. A registered strategy (zeroexp.strategies) is planned with its row here;
#: one without falls back to its ``zero_stage``'s paper row. A new strategy is one more row.
LAYOUTS: dict[str, StateLayout] = {
    "zero_stage0": StateLayout("baseline (paper)", 0, frozenset(), "mixed", "none", _all_reduce, precisions=_MIXED,
                               source="[ZeRO] 5.1, 7.1, Figure 1"),
    "zero_stage1": StateLayout("P_os (paper)", 1, _OS, "mixed", "flat", _scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]"),
    "zero_stage2": StateLayout("P_os+g (paper)", 2, _OS_G, "mixed", "flat", _scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]"),
    "zero_stage3": StateLayout("P_os+g+p (paper)", 3, _OS_G_P, "mixed", "flat", _gather_twice, "largest",
                               precisions=_MIXED, offloads=_OFF[2], source="[ZeRO] 5.1, 7.2.2, Figure 1; [OFFLOAD]"),
    # DeepSpeed 0.19 as measured; stage 1 holds the same state as stage 2 (its gradients are partitioned too)
    "deepspeed_stage0": StateLayout("DeepSpeed 0.19 stage 0", 0, frozenset(), "mixed", "none",
                                    partial(_deepspeed_payload, 0), precisions=_MIXED,
                                    payload_limits=partial(deepspeed_payload_limits, 0), source=_DS_SOURCE + (
                                        "; engine.py FP16_UnfusedOptimizer: an fp32 copy per parameter (mixed)")),
    "deepspeed_stage1": StateLayout("DeepSpeed 0.19 stage 1", 1, _OS_G, "always", "flat",
                                    partial(_deepspeed_payload, 1), pad=2, precisions=_MIXED, offloads=_OFF[1],
                                    partition_logical=True, grad_held="params", offload_grad="replace",
                                    flat_optimizer=True, payload_limits=partial(deepspeed_payload_limits, 1),
                                    source=_DS_SOURCE + "; stage_1_and_2.py"),
    "deepspeed_stage2": StateLayout("DeepSpeed 0.19 stage 2", 2, _OS_G, "always", "flat",
                                    partial(_deepspeed_payload, 2), pad=2, precisions=_MIXED, offloads=_OFF[1],
                                    partition_logical=True, grad_held="params", offload_grad="replace",
                                    flat_optimizer=True, payload_limits=partial(deepspeed_payload_limits, 2),
                                    source=_DS_SOURCE + "; stage_1_and_2.py"),
    "deepspeed_stage3": StateLayout("DeepSpeed 0.19 stage 3", 3, _OS_G_P, "always", "params",
                                    partial(_deepspeed_payload, 3), "largest", precisions=_MIXED, offloads=_OFF[2],
                                    partition_logical=True, offload_grad="add", flat_optimizer=True,
                                    payload_limits=partial(deepspeed_payload_limits, 3),
                                    source=_DS_SOURCE + "; stage3.py, partition_parameters.py"),
    # ddp / zro under bf16 / fp16: autocast, so parameters, gradients and what is all-reduced stay fp32
    "ddp": StateLayout("DDP", 0, frozenset(), "never", "none", _all_reduce, fp32_at_rest=True, fp32_on_the_wire=True,
                       precisions=_MIXED, source="zeroexp.strategies.ddp"),
    "zro": StateLayout("DDP + ZeroRedundancyOptimizer", 1, _OS, "never", "owners", _all_reduce_broadcast,
                       fp32_at_rest=True, fp32_on_the_wire=True, precisions=_MIXED, source="zeroexp.strategies.zro"),
    "zero1": StateLayout("zeroexp ZeRO-1", 1, _OS, "always", "buckets", _scatter_gather, precisions=_MIXED,
                         source="zeroexp.sharding"),
    "zero2": StateLayout("zeroexp ZeRO-2", 2, _OS_G, "always", "buckets", _scatter_gather, precisions=_MIXED,
                         source="zeroexp.sharding"),
    "fsdp_grad_op": StateLayout("FSDP SHARD_GRAD_OP", 2, _OS_G_P, "never", "units", _gather_once, "all",
                                fp32_at_rest=True, precisions=_MIXED, source="zeroexp.strategies.fsdp; [FSDP]"),
    "fsdp_full": StateLayout("FSDP FULL_SHARD", 3, _OS_G_P, "never", "units", _gather_twice, "largest",
                             fp32_at_rest=True, precisions=_MIXED, source="zeroexp.strategies.fsdp; [FSDP]"),
    "fsdp2_grad_op": StateLayout("FSDP2 reshard_after_forward=False", 2, _OS_G_P, "never", "rows",
                                 partial(_gather_once, groups="rows"),
                                 "all", fp32_at_rest=True, padded_moments=False, precisions=_MIXED,
                                 source="zeroexp.strategies.fsdp2; [FSDP2]"),
    "fsdp2_full": StateLayout("FSDP2 reshard_after_forward=True", 3, _OS_G_P, "never", "rows", _gather_twice_root_too,
                              "largest", fp32_at_rest=True, padded_moments=False, precisions=_MIXED,
                              source="zeroexp.strategies.fsdp2; [FSDP2]"),
}


def owner_numels(numels: tuple[int, ...] | list[int], world_size: int) -> list[list[int]]:
    """The parameters (numels) each rank owns under ZeroRedundancyOptimizer: largest first, each to the rank
    owning the fewest elements so far, the lowest rank on ties (``_partition_parameters``, torch/distributed/optim/
    zero_redundancy_optimizer.py)."""
    heap, owned = [(0, r) for r in range(world_size)], [[] for _ in range(world_size)]
    for n in sorted(numels, reverse=True):
        size, rank = heapq.heappop(heap)
        owned[rank].append(n)
        heapq.heappush(heap, (size + n, rank))
    return owned


def _flat(numels: tuple[int, ...] | list[int], align: int) -> tuple[list[tuple[int, int]], int]:
    """Element ranges of ``numels`` laid out in one buffer, each starting at a multiple of ``align`` (0: packed),
    and the buffer's length before world-size padding [FSDP]."""
    spans, end = [], 0
    for n in numels:
        end += (align - end % align) % align if align else 0
        spans.append((end, end + n))
        end += n
    return spans, end


def _buckets(numels: tuple[int, ...], itemsize: int, cap_bytes: int) -> list[tuple[int, ...]]:
    """zeroexp.sharding.flatten_into_buckets' cut: in order, a new bucket when the next parameter would pass the
    cap; a parameter is never split."""
    groups: list[list[int]] = [[]]
    for n in numels:
        if groups[-1] and (sum(groups[-1]) + n) * itemsize > cap_bytes:
            groups.append([])
        groups[-1].append(n)
    return [tuple(g) for g in groups if g]


def _groups(layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
            knobs: PlanKnobs) -> list[tuple[list[tuple[int, int]], int]]:
    """Each group the layout shards: its parameters' element ranges and its length padded as the layout pads."""
    kind, numels, align = layout.groups, shape.numels, 0
    if kind == "rows":
        return [([(0, n)], fsdp2_padded_numel(s, world_size)) for s, n in zip(shape.params, numels) if n]
    if kind == "units":
        parts, align = [[numels[i] for i in u] for u in shape.units], (16 // itemsize if knobs.use_orig_params else 0)
    elif kind == "buckets":
        parts = _buckets(numels, itemsize, knobs.bucket_cap_bytes)
    elif kind == "params":
        parts = [(n,) for n in numels]
    else:
        parts = [numels]
    groups = [_flat(part, align) for part in parts]
    return [(spans, padded_numel(length, layout.pad * world_size)) for spans, length in groups if length]


def _unit_numels(layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
                 knobs: PlanKnobs) -> list[int]:
    """Each FSDP unit's unsharded length as it is gathered: per parameter padded on dim 0 (``rows``, [FSDP2]),
    else one FlatParameter padded to N [FSDP]."""
    if layout.groups == "rows":
        return [sum(fsdp2_padded_numel(shape.params[i], world_size) for i in u) for u in shape.units]
    if layout.groups == "params":  # each parameter padded to N on its own [DS]
        return [sum(padded_numel(shape.numels[i], world_size) for i in u) for u in shape.units]
    align = 16 // itemsize if knobs.use_orig_params and layout.groups == "units" else 0
    return [padded_numel(_flat([shape.numels[i] for i in u], align)[1], world_size) for u in shape.units]


def _shards(groups: list[tuple[list[tuple[int, int]], int]], world_size: int) -> tuple[list[int], list[int]]:
    """Per rank: elements of real parameters in its shards (logical) and the shards' length (physical)."""
    logical, step = [0] * (world_size + 1), [0] * (world_size + 1)  # step: a difference array of whole shards
    physical = 0
    for spans, padded in groups:
        shard = padded // world_size
        physical += shard
        for a, b in spans:
            first, last = a // shard, (b - 1) // shard
            if first == last:
                logical[first] += b - a
                continue
            logical[first] += (first + 1) * shard - a
            logical[last] += b - last * shard
            step[first + 1] += shard
            step[last] -= shard
    run = 0
    for r in range(world_size):
        run += step[r]
        logical[r] += run
    return logical[:world_size], [physical] * world_size


def _held_grads(groups: list[tuple[list[tuple[int, int]], int]], world_size: int) -> list[int]:
    """Per rank, the elements of DeepSpeed ZeRO-1/2's gradient partition as stored [DS]: the full gradient of every
    parameter the rank's partition overlaps (``params_in_partition``, views of ``grad_accum`` or of
    ``grads_in_partition``), plus the partition's padding, a zeros tensor of its own (``get_flat_partition``)."""
    held = [0] * (world_size + 1)  # a difference array over ranks
    pads = [0] * world_size
    for spans, padded in groups:
        shard = padded // world_size
        end = max((b for _, b in spans), default=0)
        for a, b in spans:
            if b > a:
                held[a // shard] += b - a
                held[(b - 1) // shard + 1] -= b - a
        for r in range(end // shard, world_size):
            pads[r] += min((r + 1) * shard, padded) - max(r * shard, end)
    out, run = [], 0
    for r in range(world_size):
        run += held[r]
        out.append(run + pads[r])
    return out


def rank_state_bytes(layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
                     knobs: PlanKnobs = PlanKnobs(), offload: str = "none") -> dict[str, list[tuple[int, int]]]:
    """Per kind, per rank: (logical, physical) bytes of model state at the optimizer boundary [ZeRO 5.1].

    ``param`` and ``grad`` in the compute dtype (``itemsize`` bytes; fp32 for ``fp32_at_rest``), ``optim`` Adam's
    two fp32 moments, ``master`` the fp32 copy when the layout keeps one; each replicated or sharded as the
    layout says, physical bytes with the layout's padding. ``optim_scalar``: Adam's 4-byte ``step`` per
    optimizer tensor, when the model's shapes fix their number (a residual beside the model state). ``offload``
    changes the bytes only of a layout with ``offload_grad`` (DeepSpeed's fp32 gradient partition on the host).
    """
    n, psi, s = world_size, shape.numel, layout.sharded
    if layout.groups in ("none", "owners") and shape.exact:
        owned = owner_numels(shape.numels, n) if layout.groups == "owners" else [list(shape.numels)] * n
        logical = physical = [sum(o) for o in owned]
        full, tensors = psi, [len(o) for o in owned]
    else:
        groups = _groups(layout, shape, n, itemsize, knobs)
        logical, physical = _shards(groups, n)
        full = psi if layout.groups in ("none", "owners") else sum(padded for _, padded in groups)
        tensors = [len(groups)] * n if shape.exact and layout.groups in ("units", "buckets", "rows") else None

    def kind(sharded: bool, nbytes: int) -> list[tuple[int, int]]:
        if sharded:
            return [((ph if layout.partition_logical else lo) * nbytes, ph * nbytes)
                    for lo, ph in zip(logical, physical)]
        return [(psi * nbytes, full * nbytes)] * n

    rest = 4 if layout.fp32_at_rest else itemsize
    out = {"param": kind("param" in s, rest), "grad": kind("grad" in s, rest), "optim": kind("optim" in s, _MOMENTS)}
    offloaded = offload != "none" and layout.offload_grad != "none"
    if layout.grad_held == "params" and "grad" in s and shape.exact and layout.groups == "flat" and not offloaded:
        out["grad"] = [(lo, g * rest) for (lo, _), g in zip(out["grad"], _held_grads(groups, n))]
    if offloaded:  # the fp32 gradient partition on the host [DS]
        fp32 = kind("grad" in s, _MASTER)
        out["grad"] = fp32 if layout.offload_grad == "replace" else \
            [(a + c, b + d) for (a, b), (c, d) in zip(out["grad"], fp32)]
    if layout.master == "always" or (layout.master == "mixed" and itemsize != 4):
        out["master"] = kind("optim" in s, _MASTER)
    if knobs.use_orig_params and layout.groups == "units":  # moments and steps per unpadded view [FSDP]
        out["optim"], tensors = [(lo, lo) for lo, _ in out["optim"]], None
    if not layout.padded_moments:
        out["optim"] = [(lo, lo) for lo, _ in out["optim"]]
    if layout.flat_optimizer and shape.exact:  # one flat fp32 partition (per sub-group) per rank [DS]
        parts = [padded // n for _, padded in groups]
        tensors = [deepspeed_sub_groups(parts) if layout.groups == "params" else len(parts)] * n
    if tensors is not None:
        out["optim_scalar"] = [(_STEP * t, _STEP * t) for t in tensors]
    return out


def step_collectives(layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
                     knobs: PlanKnobs = PlanKnobs()) -> Collectives:
    """One rank's per-step collectives under ``layout``: its payload model over the padded groups, in the
    compute dtype [ZeRO 7] (fp32 for a layout ``fp32_on_the_wire``)."""
    itemsize = 4 if layout.fp32_on_the_wire else itemsize
    more = (shape.numels, world_size, itemsize)
    if layout.groups in ("none", "owners"):
        return layout.payload(Groups([shape.numel * itemsize], [False], knobs, *more))
    if layout.groups in ("units", "rows"):
        units = _unit_numels(layout, shape, world_size, itemsize, knobs)
        return layout.payload(Groups([u * itemsize for u in units], list(shape.root), knobs, *more))
    groups = _groups(layout, shape, world_size, itemsize, knobs)
    return layout.payload(Groups([padded * itemsize for _, padded in groups], [False] * len(groups), knobs, *more))


def unsharded_floor_bytes(layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
                          knobs: PlanKnobs = PlanKnobs()) -> int | None:
    """Unsharded parameter bytes a rank holds on top of its state while computing, a floor under the peak: the
    largest FSDP unit (FULL_SHARD gathers one at a time), every unit (SHARD_GRAD_OP keeps them from forward to the
    end of backward), 0 for replicated parameters; None when the units are unknown (a count, no model)."""
    if layout.gather == "none":
        return 0
    units = [u * itemsize for u in _unit_numels(layout, shape, world_size, itemsize, knobs)]
    if layout.gather == "all":
        return sum(units)
    return max(units) if shape.exact else None


def offloaded_kinds(layout: StateLayout, offload: str) -> frozenset[str]:
    """The kinds kept in host memory [OFFLOAD]: ``optimizer``: master and moments, and the gradient partition
    when gradients are sharded (ZeRO-Offload); ``full``: every kind (ZeRO-Infinity); ``none``: none."""
    kinds = {"none": frozenset(), "optimizer": frozenset({"optim", "master"}) | (layout.sharded & {"grad"}),
             "full": frozenset(STATE_KINDS)}
    if offload not in kinds:
        raise ValueError(f"offload must be none, optimizer or full, got {offload!r}")
    return kinds[offload]
