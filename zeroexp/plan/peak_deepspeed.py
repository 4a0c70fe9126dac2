"""DeepSpeed's rows in the peak model: the groups' terms for :mod:`zeroexp.formulas.peak_deepspeed`, the tensors gloo
may free late, the buffers a rank keeps beside its state. :mod:`zeroexp.plan.memory` dispatches here."""

from __future__ import annotations

from zeroexp.formulas import DS_FETCH_LIMIT, DS_NORM_BYTES, LAYOUTS, Groups, deepspeed_reduce_bucket_numel, padded_numel
from zeroexp.formulas.peak import StepTrace
from zeroexp.formulas.peak_deepspeed_terms import (TERMS, ds_estimator_bytes, ds_estimator_name, ds_term_peak,
                                                   largest_layer_numel)
from zeroexp.formulas import ModelShape
from zeroexp.formulas.peak_deepspeed import (ds_allreduce_copies, ds_partition, ds_stage3_phase_peaks,
                                             ds_stage12_phase_peaks)

__all__ = ["ds_stage", "ds_phases", "ds_peak_limits", "ds_late_free", "ds_steady_buffers_bytes", "ds_term_record",
           "ds_term_legend", "ds_step_frees_grads"]


def ds_stage(name: str) -> int | None:
    """The ZeRO stage of row ``name`` where the peak model covers it as DeepSpeed's (the row's ``peak_flow`` and
    ``deepspeed_stage``); None otherwise."""
    row = LAYOUTS.get(name)
    return row.deepspeed_stage if row is not None and row.peak_flow is not None else None


def ds_peak_limits(name: str, groups: Groups, bucket_cap_bytes: int) -> list[str]:
    """Why the peak model does not cover a DeepSpeed cell of these groups (empty: it does): DeepSpeed's paths it has
    not read into the model."""
    reasons, bucket = [], deepspeed_reduce_bucket_numel(bucket_cap_bytes)
    stage = ds_stage(name)
    if stage is not None and max(groups.numels, default=0) > bucket:
        reasons.append(f"no peak model yet for a parameter of {max(groups.numels)} elements above reduce_bucket_size="
                       f"{bucket} (reduced on its own, extra_large_param_to_reduce)")
    fetched = groups.numel + sum(groups.frozen)
    if stage == 3 and fetched > DS_FETCH_LIMIT:
        reasons.append(f"no peak model yet for stage 3 beyond one prefetch bucket ({fetched} parameter elements > "
                       f"{DS_FETCH_LIMIT}: DeepSpeed fetches and releases in several buckets)")
    return reasons


def ds_phases(name: str, groups: Groups, trace: StepTrace, itemsize: int, rank: int,
              bucket_cap_bytes: int, gloo: bool, foreach: bool = False) -> dict[str, dict]:
    """The peak model of a DeepSpeed row for rank ``rank`` (``bucket_cap_bytes``: ``strategy.bucket_cap_mb`` in
    bytes, whence ``reduce_bucket_size``; ``gloo``: the CPU backend's copies; ``foreach``: the client AdamW's update,
    foreach on a CUDA rank); stage 3 needs a trace with its units (``own_params_units``)."""
    stage, n = _covered(name), groups.world_size
    if stage == 3:  # the shards: every parameter, frozen ones too, in parameter order
        every = tuple(sh.spans[0][1] for sh in groups.shards)
        return ds_stage3_phase_peaks(trace, numels=every, world_size=n, buckets=groups.buckets, itemsize=itemsize,
                                     gloo=gloo, partitions=tuple(sh.numel // n for sh in groups.trained_shards),
                                     foreach=foreach)
    part = ds_partition(groups.numels, groups.shards[0].numel, n, rank)
    return ds_stage12_phase_peaks(trace, stage=stage, buckets=groups.buckets, order=_reduce_order(groups, stage),
                                  numels=groups.numels, part=part,
                                  bucket_numel=deepspeed_reduce_bucket_numel(bucket_cap_bytes), itemsize=itemsize,
                                  foreach=foreach, ungraded=groups.ungraded)


def _covered(name: str) -> int:
    """:func:`ds_stage` of a row the peak model covers as DeepSpeed's (KeyError otherwise)."""
    stage = ds_stage(name)
    if stage is None:
        raise KeyError(name)
    return stage


def _reduce_order(groups: Groups, stage: int) -> tuple[int, ...]:
    """The parameters' indices in the order the buckets hold them: parameter order at stage 1, backward order (a
    stack's reverse, as ``deepspeed_buckets`` is given it) at stage 2; none a step gives no gradient."""
    nonzero = [i for i, k in enumerate(groups.numels) if k and i not in set(groups.ungraded)]
    return tuple(nonzero if stage == 1 else nonzero[::-1])


def ds_late_free(name: str, groups: Groups, itemsize: int) -> dict[str, list[tuple[str, int]]]:
    """Per phase, the collective tensors of which gloo may free one late (after a later moment of the phase): stages
    1-2 a bucket's flattened all_reduce tensor (in backward, or into the step); stage 3 the parameters' all_gather
    buffer (forward), a bucket's reduce-scatter concatenation (backward) and gloo's copy of it (backward, or into the
    step: the work object gloo's worker thread still holds); in the step, the squared gradient norm's all_reduce
    tensor."""
    stage = _covered(name)
    norm = {"optimizer": [("the squared gradient norm's all_reduce tensor (get_grad_norm_direct)",
                           DS_NORM_BYTES[stage])]}
    if stage < 3:
        copies = ds_allreduce_copies(groups.buckets, _reduce_order(groups, stage), groups.numels,
                                     groups.shards[0].numel // groups.world_size)
        flat = [(f"bucket {k}'s flattened all_reduce tensor (allreduce_bucket)", e * itemsize)
                for k, e in enumerate(copies) if e]
        # the last bucket's, reduced at backward's end, may outlive it into the step (seen on rank 1 of 3)
        return {"backward": flat, "optimizer": norm["optimizer"] + flat}
    n = groups.world_size
    flat = sum(padded_numel(k, n) for g in groups.gathers for k in g) * itemsize  # every fetched parameter, padded
    scattered = [sum(padded_numel(x, n) for x in b) * itemsize for b in groups.buckets]
    concat = [(f"bucket {k}'s reduce-scatter concatenation (reduce_scatter_coalesced)", b)
              for k, b in enumerate(scattered)]
    # gloo's _reduce_scatter_base clones its input; the work object holding the clone may outlive the wait on gloo's
    # worker thread, into the step (seen: the biased 10-7-3 stack at N=3, 420 B labelled activations)
    copy = [(f"bucket {k}'s reduce-scatter input as gloo copied it (_reduce_scatter_base), held by gloo's work", b)
            for k, b in enumerate(scattered)]
    return {"forward": [("the parameters' all_gather flat buffer (_all_gather_coalesced)", flat)],
            "backward": concat + copy, "optimizer": norm["optimizer"] + copy}


def ds_step_frees_grads(name: str) -> bool:
    """Whether the row's step frees the gradients its state at the optimizer boundary holds (the planner's
    ``grad_bytes``), so that its steady state between steps, the peak model's base, holds none: stages 1-2
    (stage_1_and_2.py ``step``: ``free_grad_in_param_list``, ``averaged_gradients[i] = None``); stage 3 keeps its
    gradient buffer (stage3.py ``grad_partitions_flat_buffer``, allocated once)."""
    return _covered(name) < 3


def ds_steady_buffers_bytes(name: str, itemsize: int, bucket_cap_bytes: int) -> int:
    """What a rank keeps beside its model state at the optimizer boundary: stage 3's ipg bucket (allocated once,
    ``reduce_bucket_size`` elements of the gradient dtype); stages 1-2 free theirs in every backward's epilogue."""
    return deepspeed_reduce_bucket_numel(bucket_cap_bytes) * itemsize if _covered(name) == 3 else 0


def ds_term_record(name: str, shape: ModelShape, world_size: int, itemsize: int, offload: str, bucket_cap_bytes: int,
                   largest_layer: int | None, foreach: bool, fp16: bool = False) -> dict | None:
    """The planner's ``ds_peak`` of a DeepSpeed row (None for any other row): the model-state peak term by term
    (:func:`zeroexp.formulas.peak_deepspeed_terms.ds_term_peak`, computed, a lower bound: activations and scalars left
    out) beside DeepSpeed's own estimator, which terms both count and which differ. ``largest_layer``: the largest
    module's own parameters (None: from the shape's modules where it has them, else unknown); ``fp16``: the precision
    is fp16 (its overflow check)."""
    stage = ds_stage(name)
    if stage is None:
        return None
    if offload != "none":
        return {"note": f"no term model yet for offload={offload} (covered: offload none)"}
    if largest_layer is None and shape.exact:
        largest_layer = largest_layer_numel(shape.numels, shape.modules)
    trained = shape.trainable().numel
    peak = ds_term_peak(stage, trained, world_size, itemsize, deepspeed_reduce_bucket_numel(bucket_cap_bytes),
                        largest_layer, foreach, frozen=shape.numel - trained, fp16=fp16)
    unknown = stage == 3 and largest_layer is None
    # the estimator assumes 2-byte parameters and gradients: compared in bf16 / fp16, with the largest layer at stage 3
    estimate = None if itemsize != 2 or unknown else ds_estimator_bytes(stage, shape.numel, world_size,
                                                                        largest_layer or 0)
    return {"moment": peak.moment, "phase": peak.phase, "bytes": peak.bytes, "terms": peak.terms,
            "moments": peak.moments,
            "largest_layer": largest_layer, "basis": "computed (zeroexp.formulas.peak_deepspeed_terms): a lower bound, "
            "activations and scalars left out" + ("; the largest layer unknown (largest_layer=): its terms left out"
                                                  if unknown else ""),
            "estimator": {"source": ds_estimator_name(stage), "bytes": estimate, "counted_bytes": peak.counted_bytes,
                          "shared": list(peak.shared), "elsewhere": list(peak.elsewhere), "extra": list(peak.extra),
                          "note": None if estimate is not None else "DeepSpeed's estimator assumes 2-byte parameters "
                          "(bf16 / fp16)" + (" and needs the largest layer" if unknown else "")}}


def ds_term_legend() -> list[str]:
    """What each term of ``ds_peak`` is (:data:`TERMS`), one line each."""
    return [f"{t}: {what}" for t, what in TERMS.items()]
