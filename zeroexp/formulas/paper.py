"""The closed forms: the ZeRO paper's state factors, the nccl-tests bus factors, padding rules, collective models.

[ZeRO] section 5.1 (model-state memory per stage, K = 12 for mixed-precision Adam), section 7 (communication
volume); [NCCL-TESTS] doc/PERFORMANCE.md (S is the full array; bus factors); [FSDP] / [FSDP2] padding. The sources
are listed in :mod:`zeroexp.formulas`.
"""

from __future__ import annotations

import math

__all__ = ["Collectives", "padded_numel", "fsdp2_padded_numel", "zero_state_factors", "sharded_zero_rank_bytes",
           "bus_factor", "bus_bytes", "op_bus_bytes", "collectives_of", "add_collectives", "fp16_inf_syncs", "ITEMSIZE",
           "COMPUTE_ITEMSIZE", "clip_norm_all_reduces"]

#: Bytes per element of each dtype zeroexp names (``precision.param_dtype``, ``model.dtype``); the one dtype map:
#: the torch dtype of a name is ``getattr(torch, name)``.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "long": 8}
#: The compute dtypes a precision may name (parameters and gradients); masters and moments are fp32.
COMPUTE_ITEMSIZE = {k: ITEMSIZE[k] for k in ("float32", "bfloat16", "float16")}

#: A collectives model: each op -> {"count": calls per step per rank, "payload_bytes": sum of S}.
Collectives = dict[str, dict[str, int]]


def padded_numel(numel: int, world_size: int) -> int:
    """Elements a FlatParameter of ``numel`` elements occupies across all ranks: N * ceil(numel / N) [FSDP]."""
    return world_size * math.ceil(numel / world_size)


def fsdp2_padded_numel(shape: tuple[int, ...] | list[int], world_size: int) -> int:
    """Elements an FSDP2 parameter of ``shape`` occupies across all ranks: dim 0 chunked over N, every chunk
    padded to the first's ``ceil(dim0 / N)`` rows, so N * ceil(dim0 / N) * (numel / dim0) [FSDP2]."""
    if not shape:
        return world_size  # a 0-dim parameter is viewed as one row
    return world_size * math.ceil(shape[0] / world_size) * math.prod(shape[1:])


def zero_state_factors(stage: int, world_size: int, params_resharded: bool = False) -> dict[str, float]:
    """Aggregate model-state factors (sum over ranks / P) of fp32 AdamW at ZeRO ``stage`` [ZeRO 5.1].

    Per rank fp32 Adam holds parameters P, gradients P and two moments 2P; stage 1 shards the moments, 2 also the
    gradients, 3 also the parameters: 0 -> N/N/2N, 1 -> N/N/2, 2 -> N/1/2, 3 -> 1/1/2. ``params_resharded``: the
    parameters are sharded outside computation (FSDP SHARD_GRAD_OP), so their factor is 1 at stage 2 too.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    n = float(world_size)
    return {"param": 1.0 if stage >= 3 or params_resharded else n, "grad": 1.0 if stage >= 2 else n,
            "optim": 2.0 if stage >= 1 else 2.0 * n}


def sharded_zero_rank_bytes(stage: int, numel: int, world_size: int, compute_itemsize: int = 2) -> float:
    """Model-state bytes per rank [ZeRO 5.1, Figure 1]: 2Psi + 2Psi + 12Psi/N (stage 1) and 2Psi + 14Psi/N
    (stage 2) with fp16/bf16 compute (``compute_itemsize`` 2); Psi = ``numel``, padding excluded."""
    c, n = compute_itemsize, world_size
    return c * numel + (c * numel if stage == 1 else c * numel / n) + 12 * numel / n


def bus_factor(op: str, world_size: int) -> float | None:
    """Bus bytes / S of one collective on N ranks [NCCL-TESTS]: all_reduce 2(N-1)/N, all_gather and
    reduce_scatter (N-1)/N, broadcast and reduce 1; None for ops the convention does not cover."""
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "reduce": 1.0}.get(op)


def bus_bytes(op: str, payload_bytes: int, world_size: int) -> int | None:
    """S x :func:`bus_factor`: the bytes each rank's links carry in the ring model; never the payload itself."""
    factor = bus_factor(op, world_size)
    return None if factor is None else round(payload_bytes * factor)


def add_collectives(model: Collectives, op: str, sizes: list[int], group: tuple[str, int] | None = None) -> Collectives:
    """``model`` with ``len(sizes)`` more calls of ``op`` totalling ``sum(sizes)`` payload bytes (none: unchanged).
    ``group``: the (mesh dimension, size) of the process group the calls run over, recorded under the op's ``groups``
    (a model that names one group names every call's: ``world`` for the default group)."""
    if sizes:
        entry = model.setdefault(op, {"count": 0, "payload_bytes": 0})
        entry["count"] += len(sizes)
        entry["payload_bytes"] += int(sum(sizes))
        if group is not None:
            g = entry.setdefault("groups", {}).setdefault(group[0], {"size": group[1], "count": 0, "payload_bytes": 0})
            g["count"] += len(sizes)
            g["payload_bytes"] += int(sum(sizes))
    return model


def op_bus_bytes(op: str, entry: dict, world_size: int) -> int | None:
    """Bus bytes of one op's entry of a collectives model: each group's payload x :func:`bus_factor` at that group's
    size where the entry names groups (``groups``), else its payload at ``world_size``."""
    if not entry.get("groups"):
        return bus_bytes(op, entry["payload_bytes"], world_size)
    parts = [bus_bytes(op, g["payload_bytes"], g["size"]) for g in entry["groups"].values()]
    return None if None in parts else sum(parts)


def collectives_of(**ops: list[int]) -> Collectives:
    """A collectives model from each op's list of payload sizes S (one entry per call)."""
    model: Collectives = {}
    for op, sizes in ops.items():
        add_collectives(model, op, sizes)
    return model


def fp16_inf_syncs(dtensor_grads: bool) -> int:
    """All_reduces per step of an fp16 loss scaler's found_inf flag (one fp32 element each) when every rank holds
    only gradient shards: ``ShardedGradScaler.unscale_`` all-reduces it once; with DTensor gradient shards (FSDP2)
    DTensor's dispatch of the inf check reduces its found_inf output once more (both seen with the torch profiler,
    torch 2.13, gloo)."""
    return 2 if dtensor_grads else 1


def clip_norm_all_reduces(gradients: int, dtensor_grads: bool) -> list[int]:
    """Payload bytes of the all_reduces per step of global-norm clipping over gradient shards, one call: FSDP1's
    ``clip_grad_norm_`` sums the squared norm of the rank's shards (one fp32 element, 4 bytes); FSDP2's
    ``get_total_norm`` stacks one partial norm per gradient DTensor, made whole by ``full_tensor()`` (4 bytes each;
    both seen with the torch profiler, torch 2.13, gloo)."""
    return [4 * gradients] if dtensor_grads else [4]
