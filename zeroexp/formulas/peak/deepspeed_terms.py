"""DeepSpeed ZeRO's model-state peak as named terms, for a model known by its parameter count (and its largest layer),
beside DeepSpeed's own estimators.

The traced peak model (:mod:`zeroexp.formulas.peak.deepspeed`) needs the model's shapes and a batch; this one needs
the count P, the ranks N, the compute dtype's bytes c, the largest layer's parameters L (the most parameters one module
holds itself: DeepSpeed's ``largest_layer_params``) and ``reduce_bucket_size`` B. Each moment is what a rank holds then,
term by term; activations and scalars (the loss scale, the norms, fp16's overflow flags) are left out, so each moment is
a lower bound. DeepSpeed 0.19, as zeroexp configures it (zeroexp/strategies/deepspeed.py: torch's AdamW as the client
optimizer, ``contiguous_gradients`` on, ``overlap_comm`` off (on at stage 2: ``bucket`` twice), offload none), read from
its source:

- ``runtime/zero/stage_1_and_2.py``: the compute-dtype model ``bit16_groups_flat`` (``params``, c P), the fp32 master
  partition ``single_partition_of_fp32_groups`` (``master``, 4 P/N), AdamW's two moments (``moments``, 8 P/N).
  Backward: ``setup_buckets`` allocates the ipg bucket (``bucket``, c B) at the first gradient; a full bucket is
  flattened for its all_reduce (``allreduce_bucket``: ``bucket_copy``, more than c (B - L): a bucket is reduced when
  the next gradient would not fit; a model within one bucket, c P in backward's epilogue) and copied into
  ``grads_in_partition`` (``grads``, at least c P/N); stage 1 reduces in backward's epilogue
  (``reduce_gradients``), autograd's gradients kept until then beside the bucket (``full_grads``, c P: backward's
  end, the moment before the epilogue's first reduction).
  ``step``: fp16 checks overflow first (``has_overflow_partitioned_grads_serial`` -> runtime/utils.py
  ``has_inf_or_nan``: two scalar reductions per gradient, nothing proportional to it), then per group
  ``self.flatten(self.averaged_gradients[i])`` (``flat_grads``, c P/N) and ``.to(fp32)`` (``fp32_grads``, 4 P/N; in
  fp32 ``.to`` returns the flat tensor itself) before ``del flat_grad_partition``; the gradients are freed and
  ``unscale_and_clip_grads`` multiplies in place, then AdamW steps the fp32 partition (``adamw_tmp``:
  :func:`zeroexp.formulas.peak.adamw.adamw_temporaries`, single-tensor on a CPU rank, foreach on a CUDA one).
- ``runtime/zero/stage3.py``: the parameter partitions ``fp16_partitioned_groups_flat`` (``params``, c P/N), the
  gradient partitions ``grad_partitions_flat_buffer`` and the ipg bucket, both allocated once
  (``_setup_for_real_optimizer``: ``grads``, c P/N; ``bucket``, c B), master and moments as above. Backward: the
  module being differentiated is gathered (``partition_parameters.py`` ``_all_gather_coalesced``: ``layer``, c L)
  and autograd's gradients of its parameters exist before ``__add_grad_to_ipg_bucket`` copies them (``layer_grads``,
  c L). ``step``: fp16 first checks the gradient buffer for overflow (``_overflow_check_and_loss_scale_update`` ->
  ``has_overflow``: ``torch.isinf(self.grad_partitions_flat_buffer).any()``, then ``isnan``: a bool mask of the
  buffer before each ``any``, ``overflow_mask``, P/N bytes); then ``_prepare_fp32_grad_for_sub_group``:
  ``self.flatten(...).to(fp32)`` per sub-group (``flat_grads`` and ``fp32_grads`` of one sub-group, at most
  ``sub_group_size``), then AdamW on it.

DeepSpeed's estimators [DS-EST] (``estimate_zero2_model_states_mem_needs`` in stage_1_and_2.py,
``estimate_zero3_model_states_mem_needs`` in stage3.py, offload none) assume 2-byte parameters and sum their terms
whether or not they coexist: ZeRO-2 ``2 P + 18 P/N`` (its comment: 2 fp16 gradients + 4 fp32 gradients + 4 fp32
parameters + 8 optimizer states, beside the fp16 parameters), ZeRO-3 ``4 L + 18 P/N``. Read with the same terms:
ZeRO-2's are ``params``, ``grads``, ``fp32_grads``, ``master``, ``moments``; ZeRO-3's ``largest_layer_memory`` (4 L)
is ``layer`` + ``layer_grads`` and its 18 P/N is ``params`` + ``fp32_grads`` + ``master`` + ``moments`` (with
optimizer offload its GPU figure is ``4 L + 2 P/N``, the parameter partition): stage 3's persistent gradient buffer
is not among them. DeepSpeed has no stage-1 estimator; stage 1 holds stage 2's state.
"""

from __future__ import annotations

from typing import NamedTuple

from zeroexp.formulas.deepspeed import DS_SUB_GROUP_SIZE
from zeroexp.formulas.peak.adamw import adamw_temporaries

__all__ = ["TERMS", "ESTIMATOR_TERMS", "PHASE_OF", "DsTermPeak", "ds_term_peak", "ds_estimator_bytes",
           "ds_estimator_name", "largest_layer_numel"]

#: Every term's name and what it is, in the order the tables show them.
TERMS: dict[str, str] = {
    "params": "the compute-dtype parameters (stages 1-2: every one, bit16_groups_flat; 3: the partition)",
    "grads": "the compute-dtype gradient partition (grads_in_partition; stage 3: grad_partitions_flat_buffer)",
    "master": "the fp32 master partition",
    "moments": "AdamW's exp_avg and exp_avg_sq of the partition (fp32)",
    "fp32_grads": "the step's fp32 gradient partition (flatten(...).to(fp32))",
    "flat_grads": "the flattened compute-dtype gradient partition before .to(fp32) (below fp32)",
    "adamw_tmp": "torch AdamW's temporaries over the fp32 partition",
    "bucket": "the ipg reduce bucket (reduce_bucket_size elements; stage 2 with overlap_comm: two of them)",
    "bucket_copy": "a bucket's flattened all_reduce copy (stages 1-2: at least B - L elements, or P within one bucket)",
    "full_grads": "stage 1: autograd's gradient of every parameter, kept until backward's epilogue reduces it",
    "overflow_mask": "fp16, stage 3: isinf / isnan of the gradient buffer, a bool a gradient element (has_overflow)",
    "layer": "stage 3: the largest layer gathered",
    "layer_grads": "stage 3: autograd's gradients of the largest layer before they enter the bucket",
}

#: The terms DeepSpeed's estimator counts, by stage (offload none), read as :data:`TERMS` names.
ESTIMATOR_TERMS: dict[int, tuple[str, ...]] = {
    1: ("params", "grads", "fp32_grads", "master", "moments"),
    2: ("params", "grads", "fp32_grads", "master", "moments"),
    3: ("params", "fp32_grads", "master", "moments", "layer", "layer_grads"),
}


#: The moments of a step the term model holds, and the phase of each: backward's highest (stages 1-2: a bucket
#: reduced; stage 1: backward's end; stage 3: the largest layer's backward), stage 3's fp16 overflow check, the step's
#: fp32 gradient copy beside the flat compute-dtype partition it is cast from, and AdamW's update beside the fp32
#: gradient.
PHASE_OF = {"backward": "backward", "overflow_check": "optimizer", "fp32_copy": "optimizer", "update": "optimizer"}


class DsTermPeak(NamedTuple):
    """The moments of one rank's step (``moments``: :data:`PHASE_OF`'s names -> the terms held, bytes each), the
    highest (``moment``, its ``phase``, ``bytes``, ``terms``), and which terms DeepSpeed's estimator counts that this
    moment holds (``shared``) or does not (``elsewhere``: held at another moment, or not at all), and those it leaves
    out (``extra``); ``counted_bytes``: the estimator's terms, each at the moment that holds most of it (what the
    estimator sums)."""

    moments: dict[str, dict[str, int]]
    moment: str
    phase: str
    bytes: int
    terms: dict[str, int]
    shared: tuple[str, ...]
    elsewhere: tuple[str, ...]
    extra: tuple[str, ...]
    counted_bytes: int


def largest_layer_numel(numels: tuple[int, ...], modules: tuple[tuple[int, ...], ...]) -> int:
    """The most parameters one module holds itself (``modules``: each module's own parameters' indices; DeepSpeed's
    ``estimate_zero3_model_states_mem_needs_all_live``: ``max(sum(p.numel() for p in m.parameters(recurse=False))``);
    a model with no module table: its largest parameter."""
    return max((sum(numels[i] for i in m) for m in modules), default=max(numels, default=0))


def ds_term_peak(stage: int, numel: int, world_size: int, itemsize: int, bucket_numel: int,
                 largest_layer: int | None, foreach: bool, sub_group_size: int = DS_SUB_GROUP_SIZE,
                 frozen: int = 0, fp16: bool = False, ipg_buffers: int = 1) -> DsTermPeak:
    """DeepSpeed ZeRO ``stage`` (1-3, offload none) holding ``numel`` trainable parameters (and ``frozen`` ones, in
    ``params`` alone: no gradient, no optimizer state) on ``world_size`` ranks in a compute dtype of ``itemsize``
    bytes, ``reduce_bucket_size`` = ``bucket_numel``, the largest layer's
    ``largest_layer`` parameters (None: unknown, its terms left out; stages 1-2 then take the bucket copy as the full
    bucket), AdamW ``foreach`` or single-tensor, ``fp16`` (its overflow check), ``ipg_buffers`` (stages 1-2: 2 under
    ``overlap_comm``, :func:`zeroexp.formulas.deepspeed.ipg_buffers`): the backward and step moments, term by term
    (module docstring)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"no term model for DeepSpeed stage {stage} (covered: 1, 2, 3)")
    c, n = itemsize, world_size
    part = -(-numel // n)  # the fp32 partition (stages 1-2 pad the flat group to 2N; a count is taken whole)
    sub = min(part, sub_group_size)  # stage 3 steps one sub-group at a time
    big = 0 if largest_layer is None else int(largest_layer)
    every = numel + frozen
    steady = {"params": (every if stage < 3 else -(-every // n)) * c, "master": part * 4, "moments": part * 8}
    if stage == 3:  # the gradient buffer and the bucket are allocated once
        steady.update(grads=part * c, bucket=bucket_numel * c)
        backward = {**steady, "layer": big * c, "layer_grads": big * c}
        step_part = sub
    else:
        filled = numel if numel <= bucket_numel else max(bucket_numel - big, 0)  # a reduced bucket's gradients
        backward = {**steady, "grads": part * c, "bucket": ipg_buffers * bucket_numel * c,
                    "bucket_copy": filled * c if n > 1 else 0}  # one owner: flatten returns a view, no copy
        if stage == 1:  # backward's end: every gradient beside the bucket, before the epilogue reduces the first
            backward = {**steady, "bucket": ipg_buffers * bucket_numel * c, "full_grads": numel * c}
        step_part = part
    flat = {**steady, "flat_grads": step_part * c if c != 4 else 0, "fp32_grads": step_part * 4}
    if stage < 3:  # the gradient partition is freed after the fp32 copy is made
        flat["grads"] = part * c
    update = {**steady, "fp32_grads": step_part * 4, "adamw_tmp": adamw_temporaries((step_part,), 4, foreach)}
    check = {**steady, "overflow_mask": part if fp16 and stage == 3 else 0}  # torch.bool: one byte an element
    moments = {"backward": backward, "overflow_check": check if check["overflow_mask"] else {}, "fp32_copy": flat,
               "update": update}
    moments = {k: {t: b for t, b in m.items() if b} for k, m in moments.items() if m}
    moment = max(moments, key=lambda k: sum(moments[k].values()))
    terms = moments[moment]
    counted = ESTIMATOR_TERMS[stage] if largest_layer is not None else \
        tuple(t for t in ESTIMATOR_TERMS[stage] if not t.startswith("layer"))
    return DsTermPeak(moments, moment, PHASE_OF[moment], sum(terms.values()), terms,
                      tuple(t for t in counted if t in terms),
                      tuple(t for t in counted if t not in terms), tuple(t for t in terms if t not in counted),
                      sum(max(m.get(t, 0) for m in moments.values()) for t in counted))


def ds_estimator_name(stage: int) -> str:
    """DeepSpeed's estimator for ``stage`` (stage 1 holds stage 2's state; DeepSpeed has no stage-1 estimator)."""
    return ("runtime/zero/stage3.py estimate_zero3_model_states_mem_needs" if stage == 3 else
            "runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs")


def ds_estimator_bytes(stage: int, numel: int, world_size: int, largest_layer: int, offload: str = "none") -> int:
    """DeepSpeed's own per-GPU estimate (:func:`ds_estimator_name`, ``num_nodes`` 1, ``zero_init`` on): ZeRO-2 (and
    1) ``2 P + int(18 P / N)``, offload ``2 P``; ZeRO-3 ``4 L + int(18 P / N)``, optimizer offload ``4 L + int(2 P /
    N)``, full offload ``4 L``. The formula as DeepSpeed 0.19.8 writes it, for when deepspeed does not import."""
    p, n, layer = numel, world_size, 4 * largest_layer
    if stage in (1, 2):
        return int(2 * p) if offload != "none" else int(2 * p + int(18 * p / n))
    if stage == 3:
        return {"none": layer + int(18 * p / n), "optimizer": layer + int(2 * p / n), "full": layer}[offload]
    raise ValueError(f"no DeepSpeed estimator for stage {stage} (covered: 1, 2, 3)")
