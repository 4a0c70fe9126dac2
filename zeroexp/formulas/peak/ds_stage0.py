"""The peak model of DeepSpeed ZeRO stage 0: what a rank holds above its steady state in each phase, by category.

DeepSpeed 0.19 as zeroexp configures it (zeroexp/strategies/deepspeed.py: ``zero_optimization.stage`` 0, torch's
AdamW as the client optimizer, no gradient clipping unless ``strategy.clip_grad_norm`` is set), from its source
[DS-PEAK0]. Stage 0 has no ZeRO optimizer: nothing is partitioned, every rank holds the module's parameters and
their ``.grad``, and ``strategy.bucket_cap_mb`` (``reduce_bucket_size``) is never read.

- Backward (runtime/engine.py ``backward`` -> ``_backward_epilogue`` -> ``allreduce_gradients``): autograd makes every
  ``.grad`` with no hook of DeepSpeed's; at the gradient accumulation boundary the epilogue calls
  ``buffered_allreduce_fallback`` with ``MEMORY_OPT_ALLREDUCE_SIZE`` (5e8) elements a buffer, whatever the config's
  bucket sizes. ``_get_gradients_for_reduction`` first gives a trainable parameter without a gradient (one the step
  does not reach) ``torch.zeros`` of its size (``zeros``, held to the step's end), then ``allreduce_no_retain`` cuts
  the gradients, in parameter order, into chunks of more than 5e8 elements (:func:`zeroexp.formulas.deepspeed.
  deepspeed_buckets`, ``groups.buckets``) and ``allreduce_and_copy`` each: ``allreduce_bucket`` flattens the chunk
  into one new tensor (``self.flatten``: ``flat``, the chunk's bytes; a view where the chunk is one tensor), the
  all_reduce runs on it in the gradients' dtype (``communication_data_type``: the compute dtype), and its slices are
  copied back into the gradients (``buf.copy_``); the flat tensor is freed before the next chunk's is made.
- Step, fp32 (engine.py ``_take_model_step``): the client AdamW steps the module's parameters on their ``.grad``
  (``adamw_tmp``: :func:`zeroexp.formulas.peak.adamw.adamw_temporaries`), then ``zero_grad`` sets every ``.grad`` to
  None: the steady state holds no gradient.
- Step, bf16 / fp16 (engine.py ``_do_optimizer_sanity_check``: the model dtype equals the gradient accumulation
  dtype, no pipeline, so ``DDP_BFLOAT16`` / ``FP16`` -> ``_configure_fp16_optimizer``; torch's AdamW is not fused:
  runtime/fp16/unfused_optimizer.py ``FP16_UnfusedOptimizer``, not runtime/bf16_optimizer.py's ``BF16_Optimizer``,
  which stage 0 builds only under pipeline parallelism; ``fp32_groups``, one fp32 copy of each trainable parameter,
  is steady state). ``step``: ``CheckOverflow.check`` reduces each gradient to two scalars (runtime/utils.py
  ``has_inf_or_nan``); ``get_weight_norm`` takes each gradient's norm through an fp32 copy of it (``p.data.float()``,
  one at a time: ``norm_copy``); then every fp32 copy's ``.grad`` is the compute-dtype gradient cast to fp32
  (``fp16_param.grad.to(fp32)``: ``fp32_grads``, all of them at once); ``unscale_and_clip_grads`` multiplies them in
  place; AdamW steps the fp32 copies beside them (``adamw_tmp``); each fp32 ``.grad`` is then dropped and the fp32
  parameter copied into the compute-dtype one in place; the engine's ``zero_grad`` (``FP16_UnfusedOptimizer.
  zero_grad``, ``set_to_none``) drops the compute-dtype gradients.
- ``gradient_accumulation_steps`` K > 1 (engine.py ``allreduce_gradients``: only at the boundary;
  ``is_gradient_accumulation_boundary``): a micro-batch before the last reduces nothing and its ``step`` skips
  ``_take_model_step``; autograd adds every later micro-batch's gradients into the ``.grad`` the earlier ones left
  (``AccumulateGrad``), so a later micro-batch holds them whole from its start (the step traced with its gradients
  allocated, which counts none of them), and the last one reduces and steps as above.

Each moment is a lower bound of what the rank holds then (scalars left out: the loss divided by K, the norms, the
overflow flags), so the phase's prediction is never above the measurement.
"""

from __future__ import annotations

from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.deepspeed import _Moments
from zeroexp.formulas.peak.phases import StepTrace, highest_phases

__all__ = ["ds_stage0_flat_copies", "ds_stage0_phase_peaks", "ds_stage0_accumulated_phase_peaks"]


def ds_stage0_flat_copies(buckets: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Per chunk of ``buffered_allreduce_fallback`` (``buckets``: each its gradients' numels, parameter order), the
    elements ``allreduce_bucket`` copies into its flat tensor (engine.py ``allreduce_and_copy``: ``self.flatten``);
    0 for a chunk of one tensor, which torch's ``flatten_dense_tensors`` returns as a view."""
    return tuple(sum(b) if len(b) > 1 else 0 for b in buckets)


def ds_stage0_phase_peaks(trace: StepTrace, *, numels: tuple[int, ...], buckets: tuple[tuple[int, ...], ...],
                          itemsize: int, foreach: bool = False, ungraded: tuple[int, ...] = (),
                          later: bool = False, boundary: bool = True) -> dict[str, dict]:
    """Stage 0 (``numels``: the trainable parameters', parameter order; ``buckets``: the all_reduce chunks,
    ``groups.buckets``; ``itemsize``: the compute dtype's; ``ungraded``: the trainable parameters the step gives no
    gradient, indices into ``numels``), per phase, the bytes above steady at the peak, by category (module docstring).

    Forward: the bare forward. Backward: the bare backward (autograd's gradients as it makes them); at its end the
    epilogue's zero gradients and, one chunk at a time, the chunk's flat all_reduce copy beside every gradient.
    Optimizer: every gradient (the compute dtype's) beside AdamW's temporaries over the stepped tensors (fp32: the
    module's parameters; below fp32: the fp32 copies, beside their fp32 gradients, every one at once); below fp32 also
    the norm's moment, each gradient's fp32 copy in turn (never above the update's: a lower bound beside it).

    ``later``: a micro-batch after the first of a step's accumulation, ``trace`` the step traced with its gradients
    allocated (every gradient held from its start); ``boundary``: the micro-batch reduces and steps (the last one)."""
    c, out = itemsize, _Moments()
    keep = out.keep
    idle = set(ungraded)
    graded = sum(k for i, k in enumerate(numels) if i not in idle) * c  # autograd's gradients
    zeros = sum(numels[i] for i in idle) * c  # _get_gradients_for_reduction: torch.zeros for a None .grad
    loss = {"activations": -trace.loss_bytes, **({"gradients": graded} if later else {})}
    for s in (s for s in trace.segments if s.phase == "forward"):
        keep("forward", s.peak_by_category, loss)
    for s in (s for s in trace.segments if s.phase == "backward"):
        keep("backward", s.peak_by_category, loss)
    if not boundary:
        return out.best
    end = trace.segments[-1].end_by_category
    # the epilogue (allreduce_gradients at the boundary): the zero gradients, then each chunk's flat copy in turn
    keep("backward", end, loss, {"gradients": zeros})
    for flat in ds_stage0_flat_copies(buckets):
        keep("backward", end, loss, {"gradients": zeros}, {"temporaries": flat * c})
    held = {"gradients": graded + zeros}  # every gradient, to zero_grad after the step
    stepped = tuple(numels)
    if c == 4:  # _take_model_step: the client AdamW on the module's parameters
        keep("optimizer", held, {"optimizer_state": adamw_temporaries(stepped, 4, foreach)})
        return out.best
    # FP16_UnfusedOptimizer.step: get_weight_norm's fp32 copy of each gradient in turn, then every fp32 .grad beside
    # AdamW's temporaries over the fp32 copies
    keep("optimizer", held, {"optimizer_state": max(stepped, default=0) * 4})
    keep("optimizer", held, {"optimizer_state": sum(stepped) * 4 + adamw_temporaries(stepped, 4, foreach)})
    return out.best


def ds_stage0_accumulated_phase_peaks(trace: StepTrace, in_place: StepTrace | None, micro_batches: int,
                                      **terms) -> dict[str, dict]:
    """:func:`ds_stage0_phase_peaks` over the ``micro_batches`` micro-batches of one optimizer step (``terms``: its
    keywords): the first as a step that reduces nothing (K > 1), every later one holding the gradients the earlier
    ones left (``in_place``: the step traced with its gradients allocated), the last one reducing and stepping; per
    phase the highest (the memory probe keeps each phase's peak over the micro-batches)."""
    if micro_batches < 2:
        return ds_stage0_phase_peaks(trace, **terms)
    if in_place is None:
        raise ValueError("stage 0 under accumulation needs the step traced with its gradients allocated (in_place)")
    first = ds_stage0_phase_peaks(trace, boundary=False, **terms)
    last = ds_stage0_phase_peaks(in_place, later=True, **terms)
    return highest_phases(last, first)
