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

__all__ = ["padded_numel", "zero_state_factors", "bus_factor", "bus_bytes", "ddp_collectives", "zero1_collectives",
           "fsdp_collectives", "sharded_zero_state_factors", "sharded_zero_rank_bytes", "sharded_zero_collectives"]


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

    all_reduce 2(N-1)/N, all_gather and reduce_scatter (N-1)/N, broadcast 1. S (the payload) is the full
    array: for all_gather and reduce_scatter, one rank's chunk x N.
    """
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0}.get(op)


def bus_bytes(op: str, payload_bytes: int, world_size: int) -> int | None:
    """S x :func:`bus_factor`: the bytes each rank's links carry in the ring model; never the payload itself."""
    factor = bus_factor(op, world_size)
    return None if factor is None else round(payload_bytes * factor)


def _model(**ops: list[int]) -> Collectives:
    return {op: {"count": len(sizes), "payload_bytes": int(sum(sizes))} for op, sizes in ops.items() if sizes}


def ddp_collectives(bucket_bytes: list[int]) -> Collectives:
    """ZeRO-0 (plain data parallelism) [ZeRO 7.1]: one gradient all_reduce per DDP bucket; S totals P."""
    return _model(all_reduce=bucket_bytes)


def zero1_collectives(bucket_bytes: list[int], broadcast_bytes: list[int]) -> Collectives:
    """ZeRO-1 as torch's ZeroRedundancyOptimizer does it: DDP's gradient all_reduce (P) [ZeRO 7.2.1], then
    each owner broadcasts its updated parameters (ZeroRedundancyOptimizer._sync_params), one broadcast per
    parameter or per owner bucket: S totals P. Canonical ZeRO-1 all-gathers the parameters instead."""
    return _model(all_reduce=bucket_bytes, broadcast=broadcast_bytes)


def fsdp_collectives(unit_bytes: list[int], gathers_per_unit: list[int]) -> Collectives:
    """FSDP [ZeRO 7.2.2]: per unit of padded flat bytes b, all_gather S = b before forward, and again before
    backward when the unit was resharded after forward (FULL_SHARD, non-root: ``gathers_per_unit`` 2), then
    one reduce_scatter S = b of its gradient. SHARD_GRAD_OP: P + P; FULL_SHARD: 2P + P (P padded) [FSDP]."""
    gathers = [b for b, k in zip(unit_bytes, gathers_per_unit) for _ in range(k)]
    return _model(all_gather=gathers, reduce_scatter=list(unit_bytes))


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
