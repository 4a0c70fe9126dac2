"""The peak model's precision terms: what each family (:meth:`zeroexp.formulas.families.Family.precision_terms`)
holds in which dtype in bf16 / fp16, and the bytes mixed precision adds above steady.

Sources, read alongside the adapters (zeroexp/strategies/):

- DDP, ZeroRedundancyOptimizer (``ddp``, ``zro``): Lightning's ``MixedPrecision`` plugin runs the training step under
  ``torch.autocast`` (lightning/pytorch/plugins/precision/amp.py); parameters, their ``.grad`` and AdamW stay fp32.
  Autocast's casts of the weights and its low-precision outputs are what the forward saves: the step is traced
  under autocast (:func:`trace_dtypes`). fp16's ``GradScaler`` holds two scalars; its scaled loss and found-inf
  flags are a few bytes (left out: the model stays a lower bound).
- zeroexp's ZeRO (``zero1``, ``zero2``; zeroexp/strategies/sharding.py ``ShardedAdamW.step``): the parameters are
views of
  flat buckets in the compute dtype, inputs cast by a pre-hook, so gradients and buckets are in the compute dtype;
  in the step each bucket's reduced shard is up-cast to an fp32 master gradient (``shard.float()``, a copy below
  fp32), all alive through AdamW's update; after it each fp32 master shard is cast into the all-gather's input
  (``master.to(compute dtype)``), held until the next forward waits for its bucket (in steady, freed in forward).
- FSDP1 ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` and FSDP2 ``MixedPrecisionPolicy``: units
  gathered and computed in the compute dtype; fp16 adds Lightning's autocast plugin with a ``ShardedGradScaler``
  (zeroexp/strategies/_amp.py ``with_sharded_scaler``).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroexp.formulas.peak.allocator import counted_sum

__all__ = ["PrecisionTerms", "FP32_TERMS", "master_upcast_bytes", "gather_input_bytes", "sharded_grad_upcast"]

#: Bytes per element of an fp32 master, gradient shard or Adam moment.
FP32 = 4


@dataclass(frozen=True)
class PrecisionTerms:
    """How a gradient flow computes in a precision: ``autocast`` (the dtype autocast runs the step in, or None),
    ``module_dtype`` (the dtype the module's parameters and input are cast to for the compute, or None: fp32),
    ``grad_itemsize`` (bytes per element of the gradients autograd accumulates into ``.grad`` and of the buckets),
    ``master_below_compute`` (an fp32 master exists beside compute-dtype parameters: zeroexp's ZeRO's up-casts)."""

    autocast: str | None
    module_dtype: str | None
    grad_itemsize: int
    master_below_compute: bool


#: fp32: no cast anywhere, whatever the family (:meth:`zeroexp.formulas.families.Family.precision_terms`).
FP32_TERMS = PrecisionTerms(None, None, FP32, False)


def sharded_grad_upcast(shard_numel: int, terms: PrecisionTerms) -> int:
    """FSDP1 / FSDP2 below fp32: the fp32 sharded gradient cast from the reduce-scatter's compute-dtype output
    (FSDP1 ``_cast_grad_to_param_dtype``, FSDP2 ``foreach_reduce``'s ``.to(orig_dtype)``), allocated while that
    output is alive and kept as the unit's gradient shard (fp32: the output itself is kept, 0 here)."""
    return shard_numel * FP32 if terms.grad_itemsize < FP32 else 0


def master_upcast_bytes(shard_numels: tuple[int, ...], terms: PrecisionTerms, block: int = 1) -> int:
    """zeroexp's ZeRO below fp32: the fp32 master gradients ``shard.float()`` allocates, one per bucket, all alive
    through AdamW's update (fp32: the shard itself becomes the master gradient, nothing allocated); each counted in
    ``block``-byte blocks (:func:`zeroexp.formulas.peak.allocator.counted`)."""
    return counted_sum((k * FP32 for k in shard_numels), block) if terms.master_below_compute else 0


def gather_input_bytes(shard_numels: tuple[int, ...], terms: PrecisionTerms, compute_itemsize: int,
                       block: int = 1) -> int:
    """zeroexp's ZeRO below fp32: the all-gather inputs ``master.to(compute dtype)``, one per bucket, held in steady
    and freed when the next forward waits for each bucket (before its first module computes; fp32: the master
    itself is the input, nothing allocated); each counted in ``block``-byte blocks."""
    return counted_sum((k * compute_itemsize for k in shard_numels), block) if terms.master_below_compute else 0
