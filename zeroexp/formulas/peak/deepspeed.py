"""The peak model of DeepSpeed ZeRO stages 1-3: what a rank holds above its steady state in each phase, by category.

DeepSpeed 0.19 as zeroexp configures it (zeroexp/strategies/deepspeed.py: ``overlap_comm`` off unless set, then a
second ipg buffer at stage 2; ``contiguous_gradients`` on, one parameter group, ``reduce_scatter`` and
``use_multi_rank_bucket_allreduce`` at their defaults, every stage-3 parameter partitioned; a count's closed form:
:mod:`zeroexp.formulas.peak.deepspeed_terms`), in fp32, and in bf16 / fp16 as the same path in 2-byte tensors (fp16's
loss scale and overflow checks are scalars: runtime/utils.py ``has_inf_or_nan``), from its runtime's source [DS-PEAK]:

- ``runtime/zero/stage_1_and_2.py``: ``setup_buckets`` allocates the whole ipg bucket (``reduce_bucket_size``
  elements) at the first gradient hook of a backward; ``_release_ipg_buffers`` drops it in the epilogue
  (``independent_gradient_partition_epilogue``). Stage 2 copies each gradient into the bucket in its hook
  (``reduce_independent_p_g_buckets_and_remove_grads``: autograd's tensor is freed); stage 1 keeps autograd's
  gradients until the epilogue (``reduce_gradients``, parameter order). A full bucket is reduced: ``average_tensor``
  -> ``allreduce_and_scatter`` -> ``allreduce_bucket`` flattens its slices into a new tensor for the all_reduce
  (``self.flatten``); then ``copy_grads_in_partition`` copies the gradients of the parameters the rank's partition
  overlaps into ``grads_in_partition`` (allocated once: their whole numel). ``get_flat_partition`` adds a zeros
  tensor for the partition's padding. ``step``: per gradient piece a float64 copy for the norm and its float64 norm
  (``get_grad_norm_direct``, ``get_norm_dtype``), the flat fp32 gradient partition (``self.flatten``), AdamW on the
  fp32 partition, the gradients freed before the update; through the update the combined norm
  (``scaled_global_grad_norm``) and the new ``_global_grad_norm`` beside the one the engine still holds (engine.py
  ``_take_model_step`` takes the new one after ``optimizer.step``), fp32 scalars (``DS_NORM_BYTES``).
- ``runtime/zero/stage3.py``: the ipg bucket is allocated once at init (``_setup_for_real_optimizer``: steady, as
  ``grad_partitions_flat_buffer``); each hook copies a gradient into it (``__add_grad_to_ipg_bucket``); a full
  bucket is reduce-scattered by ``runtime/comm/coalesced_collectives.py`` ``reduce_scatter_coalesced``, which
  concatenates every gradient's rank chunks padded to N into one new tensor (except one tensor already divisible by
  N). ``step``: ``_prepare_fp32_grad_for_sub_group`` flattens the gradient partitions into an fp32 copy, AdamW steps
  on the sub-group's fp32 partition, beside the float64 norms the step keeps: one per sub-group (``norm_groups``),
  their combination and the new ``_global_grad_norm`` (the engine holds the previous one until the step returns).
- ``runtime/zero/partition_parameters.py`` ``_all_gather_coalesced``: one flat buffer of every fetched parameter's
  N padded chunks; ``AllGatherCoalescedHandle.wait`` concatenates each parameter's chunks into a new tensor of its
  size (the flat buffer lives while any of its parameters is still in the coordinator's in-flight registry).
  ``partitioned_param_coordinator.py``: the root module's pre-forward prefetches every parameter within one prefetch
  bucket; beyond it the fetches and flat buffers are the coordinator's replayed
  (:mod:`zeroexp.formulas.deepspeed_fetch`), beyond the reuse distance a parameter released in forward and gathered
  again by its pre-backward hook (``__params_to_release``, ``fetch_sub_module``);
  ``parameter_offload.py``: a module's parameters are released after its backward reaches its inputs
  (``PostBackwardFunctionModule``), never in backward for a module whose inputs need no gradient (an embedding of
  token ids, the first Linear on the batch): those wait for ``step``'s ``_partition_all_parameters``.

Each moment is a lower bound of what the rank holds then (allocations between hooks that the trace cannot place,
scalars, are left out), so the phase's prediction is never above the measurement.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Callable, NamedTuple

from zeroexp.formulas.deepspeed import DS_NORM_BYTES, DS_OFFLOAD_NORM_BYTES, deepspeed_sub_groups, ds_allreduce_calls
from zeroexp.formulas.deepspeed_fetch import ModuleCall, Stage3Schedule
from zeroexp.formulas.paper import padded_numel
from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.ds_partition import (FP64, DsPartition, ds3_offload_norms, ds_offload_norms, ds_partition,
                                                ds_partitions)
from zeroexp.formulas.peak.ds_recompute import REDO, Hook as _Hook, recompute_moments, unit_calls as _unit_calls
from zeroexp.formulas.peak.phases import StepTrace

__all__ = ["DsPartition", "ds_partition", "ds_partitions", "ds_allreduce_copies", "ds_accumulation",
           "ds_stage12_phase_peaks", "ds_stage3_phase_peaks", "FP64"]



def ds_allreduce_copies(buckets: tuple[tuple[int, ...], ...], order: tuple[int, ...], numels: tuple[int, ...],
                        partition_numel: int, bucket_numel: int | None = None) -> tuple[int, ...]:
    """Stages 1-2, per bucket (reduce order; ``order``: its parameters' indices, ``numels`` in parameter order), the
    most elements one of its all_reduces copies (:func:`zeroexp.formulas.deepspeed.ds_allreduce_calls`; None
    ``bucket_numel``: each bucket one call): ``allreduce_bucket`` flattens the call's slices into one new tensor
    (``self.flatten``), unless there is only one (torch's ``flatten_dense_tensors`` returns a view of it); the calls
    of a bucket run one after the other, each copy freed before the next."""
    cap = max((sum(b) for b in buckets), default=0) if bucket_numel is None else bucket_numel
    calls = ds_allreduce_calls(buckets, order, numels, partition_numel, cap)
    return tuple(max((sum(c) for c in b if len(c) > 1), default=0) for b in calls)


class _Moments:
    """The highest moment of each phase, by category (zeros left out)."""

    def __init__(self) -> None:
        self.best: dict[str, dict] = {}

    def keep(self, phase: str, *parts: dict) -> None:
        cats: dict[str, int] = {}
        for part in parts:
            for c, b in part.items():
                cats[c] = cats.get(c, 0) + int(b)
        cats = {c: b for c, b in cats.items() if b}
        if phase not in self.best or self.best[phase]["bytes"] < sum(cats.values()):
            self.best[phase] = {"bytes": sum(cats.values()), "by_category": cats}


def _at_hook(segments: list, i: int) -> dict:
    """The bare step at a gradient hook inside backward segment ``i``, at its end at the latest: what the segment's
    end and the next mark both hold, category by category (the trace's own backward hooks keep a gradient alive at
    their mark that a run without them has freed)."""
    end = segments[i].end_by_category
    if i + 1 == len(segments):
        return dict(end)
    nxt = segments[i + 1].end_by_category
    return {c: min(b, nxt.get(c, 0)) for c, b in end.items()}


def _first_partition_bucket(buckets: tuple[tuple[int, ...], ...], order: tuple[int, ...],
                            part: DsPartition) -> int | None:
    """The first bucket (reduce order) that holds a gradient of the partition: ``grads_in_partition`` is made when it
    is reduced (None: no gradient of the partition is reduced)."""
    bucket_of, mine = [k for k, b in enumerate(buckets) for _ in b], set(part.params)
    return min((bucket_of[i] for i, p in enumerate(order) if p in mine), default=None)


def ds_accumulation(stage: int, bucket: int, partition: int, graded: int) -> dict[str, int]:
    """Stages 1-2 under ``gradient_accumulation_steps`` > 1: what a micro-batch after the first holds from its start
    above a step without accumulation, by category (``bucket``: the ipg bucket's bytes; ``partition``: the rank's
    ``grads_in_partition`` and the epilogue's zero gradients, :func:`ds_stage12_phase_peaks`; ``graded``: autograd's
    gradients of every parameter the step gives one).

    Stage 1 (stage_1_and_2.py): the engine reduces only at the boundary (engine.py ``allreduce_gradients``:
    ``reduce_gradients`` when ``is_gradient_accumulation_boundary``), yet every gradient hook calls
    ``process_gradients`` -> ``setup_buckets``, which allocates the ipg bucket at the step's first hook; only the
    boundary's epilogue releases it (``_release_ipg_buffers``): the bucket is held from the first micro-batch's
    first hook to the last one's epilogue, beside autograd's whole gradients, into which the later micro-batches add
    (the step traced with its gradients allocated, which counts none of them). Stage 2 (``partition_gradients``):
    every micro-batch reduces its buckets and runs the epilogue
    (``overlapping_partition_gradients_reduce_epilogue``); the first one's epilogue keeps the partition's gradients
    (``all_grad_tensors[i] = get_all_grad_tensors(...)``: views of that micro-batch's ``grads_in_partition`` and
    zeros for a parameter without a gradient) after ``_release_ipg_buffers`` drops the attribute, so that storage
    lives to the step; each later micro-batch makes its own ``grads_in_partition`` and zeros (``avg_new``) and adds
    them in (``accumulated_grad.add_``), freed at its epilogue's end; the boundary's ``get_flat_partition`` reads
    ``all_grad_tensors``, so the step holds what a step without accumulation holds."""
    if stage == 1:
        return {"temporaries": bucket, "gradients": graded}
    return {"temporaries": partition}


def _closed(edges: list[int], traced: int) -> int:
    """How many buckets (``edges``: their cumulative bytes in reduce order) are reduced once ``traced`` gradient bytes
    exist: bucket k is reduced when a gradient beyond it arrives."""
    return bisect_left(edges, traced, 1, len(edges) - 1) - 1  # the inner edges below traced


def _being_made(edges: list[int], big: dict[int, int], traced: int) -> int:
    """The bytes of the gradient above the bucket (``big``: by bucket) whose bucket ``traced`` gradient bytes reach
    into: bucket k's where ``edges[k] < traced <= edges[k + 1]`` (the last one made, still autograd's); else 0."""
    k = bisect_left(edges, traced) - 1
    return big.get(k, 0) if 0 <= k < len(edges) - 1 else 0


def ds_stage12_phase_peaks(trace: StepTrace, *, stage: int, buckets: tuple[tuple[int, ...], ...],
                           order: tuple[int, ...], numels: tuple[int, ...], part: DsPartition, bucket_numel: int,
                           itemsize: int, foreach: bool = False, ungraded: tuple[int, ...] = (),
                           later: bool = False, offload: bool = False, host_is_device: bool = True,
                           ipg_buffers: int = 1) -> dict[str, dict]:
    """Stages 1 and 2 (``buckets``: the ipg buckets' gradient numels in reduce order, parameter order at stage 1,
    backward order at stage 2; ``order``: the parameters' indices in that order, ``numels`` in parameter order;
    ``part``: the rank's partition; ``bucket_numel``: ``reduce_bucket_size``), per phase, the bytes above steady at
    the peak, by category. Nothing of a gradient survives ``step``: steady holds none.

    Forward: the bare forward. Backward: the bare backward (stage 2 less the traced parameter gradients, copied into
    the bucket as they arrive), plus the whole bucket once the first gradient exists, plus ``grads_in_partition``
    once a bucket holding a partition parameter was reduced; each reduction's flat copy (:func:`ds_allreduce_copies`)
    beside them, at stage 2 in the hook of the next bucket's first gradient, which is not yet in the bucket; the
    epilogue (stage 1: every bucket; stage 2: the last) from the bare step's end. Optimizer: the kept gradient partition
    beside each piece's float64 copy and norm (the norms of the pieces before it too), then beside the flat partition,
    then the flat partition beside AdamW's temporaries, the last two beside the combined norm and the new
    ``_global_grad_norm``. A parameter the step gives no gradient (``ungraded``, out of ``order`` and the buckets):
    its gradient is a zeros tensor of its size made in the epilogue (``get_all_grad_tensors``), held with the
    partition until the step; ``grads_in_partition`` is made only where a parameter with a gradient is reduced. A
    gradient above ``bucket_numel`` (a bucket alone, ``extra_large_param_to_reduce``): autograd's tensor, never copied
    into the bucket, held until its own reduction (in the next gradient's hook at stage 2, in the epilogue at stage 1)
    beside its largest all_reduce's flat copy.

    ``later``: a micro-batch after the first of a step's accumulation (``grad_accum`` > 1; :func:`ds_accumulation`
    says what it holds from its start, and at stage 1 ``trace`` is the step traced with its gradients allocated).

    ``offload``: the optimizer offloaded (``cpu_offload``, one micro-batch a step): no ``grads_in_partition``, no
    epilogue zeros or padding (``copy_grads_in_partition`` returns first; ``independent_gradient_partition_epilogue``
    builds no ``all_grad_tensors``); after each bucket's all_reduce, each partition parameter of it in turn: a float64
    copy of its piece and that copy's float64 norm, kept to the step (``set_norm_for_param_grad_in_gpu``), below fp32
    then an fp32 copy of the piece for the host's gradient partition (``async_inplace_copy_grad_to_fp32_buffer_from_
    gpu``). The step: AdamW on the host's fp32 partition (its gradient is state: no flat copy) beside the kept norms
    and two fp32 norm scalars (``complete_grad_norm_calculation_for_cpu_offload``, ``scaled_global_norm``);
    ``host_is_device`` false (an NCCL rank): AdamW's temporaries and those scalars are the host's, the device holds the
    kept norms alone. ``ipg_buffers``: the ipg bucket's buffers (:func:`zeroexp.formulas.deepspeed.ipg_buffers`)."""
    c, out = itemsize, _Moments()
    keep, loss = out.keep, {"activations": -trace.loss_bytes}
    bucket = {"gradients" if stage == 2 else "temporaries": ipg_buffers * bucket_numel * c}
    pad = part.padding * c
    no_grad = set(ungraded)
    zeros = sum(numels[i] for i in part.params if i in no_grad) * c  # the epilogue's zero gradients
    first_gip = _first_partition_bucket(buckets, order, part)
    gip = part.overlapped * c if first_gip is not None else 0  # never made where no gradient of it is reduced
    fp64_norms, copies = (ds_offload_norms(buckets, order, part, no_grad, c) if offload
                          else ([0] * (len(buckets) + 1), []))
    if offload:  # none of grads_in_partition, the zeros and the padding is made
        zeros = pad = gip = 0
        first_gip = None

    def _gip_after(k: int) -> int:  # grads_in_partition, held once the first bucket with a gradient of it was reduced
        return gip if first_gip is not None and k > first_gip else 0
    # what a later micro-batch holds from its start: stage 1 the ipg bucket, stage 2 the partition accumulated so far
    graded = sum(k for i, k in enumerate(numels) if i not in no_grad) * c  # autograd's whole gradients
    carried = ds_accumulation(stage, bucket_numel * c, gip + zeros, graded) if later else {}
    loss = {**loss, **carried}  # beside every forward and backward moment (no category in common)
    sizes = [k * c for k in ds_allreduce_copies(buckets, order, numels, part.numel, bucket_numel)]
    # A gradient above the bucket (a bucket alone): never copied into the bucket, autograd's tensor is reduced in place
    # and kept from its hook until it is reduced (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads:
    # extra_large_param_to_reduce; reduce_ipg_grads), then copied into grads_in_partition or cleared.
    big = {k: b[0] * c for k, b in enumerate(buckets) if len(b) == 1 and b[0] > bucket_numel}
    edges = list(accumulate((sum(b) * c for b in buckets), initial=0))  # bucket k: edges[k] to edges[k + 1] bytes

    for s in (s for s in trace.segments if s.phase == "forward"):
        keep("forward", s.peak_by_category, loss)
    before, backward = 0, [s for s in trace.segments if s.phase == "backward"]
    for i, s in enumerate(backward):
        grads = s.peak_by_category.get("gradients", 0)
        held = bucket if before and not (later and stage == 1) else {}  # a later stage-1 micro-batch: carried
        if stage == 2:  # each gradient moved into the bucket in its hook; buckets reduced in backward order
            done = _closed(edges, before)
            kept = {"temporaries": _gip_after(done) + fp64_norms[done]}
            # a gradient above the bucket, the last one made, is still autograd's
            whole = _being_made(edges, big, grads)
            keep("backward", s.peak_by_category, loss, {"gradients": whole - grads}, held, kept)
            after = s.end_by_category.get("gradients", 0)
            for k in range(done, _closed(edges, after)):  # bucket k reduced in this stretch, at its end at the latest
                # by the hook of bucket k+1's first gradient, before that gradient is copied into the bucket
                base = (_at_hook(backward, i), loss, {"gradients": buckets[k + 1][0] * c + big.get(k, 0) - after},
                        bucket)
                made = {"temporaries": _gip_after(k) + fp64_norms[k]}
                keep("backward", *base, made, {"temporaries": sizes[k]})
                if k == first_gip:  # grads_in_partition made right after this bucket's all_reduce
                    keep("backward", *base, {"temporaries": gip})
                if offload:  # its partition parameters' float64 copies and norms, one after the other
                    keep("backward", *base, {"temporaries": fp64_norms[k] + copies[k]})
        else:
            keep("backward", s.peak_by_category, loss, held)
        before = s.end_by_category.get("gradients", 0)
    end = trace.segments[-1].end_by_category
    end_grads = end.get("gradients", 0) + carried.get("gradients", 0)  # a later stage-1 micro-batch's: carried
    # The epilogue, from the bare step's end: stage 1 reduces every bucket (autograd's gradients of the buckets not
    # yet copied still held), stage 2 the last one.
    first = 0 if stage == 1 else len(buckets) - 1
    bucket = {} if later and stage == 1 else bucket  # carried from the first micro-batch already
    for k in range(first, len(buckets)):
        pending = (edges[-1] - edges[k + 1] if stage == 1 else 0) + big.get(k, 0)
        made = {"temporaries": _gip_after(k) + fp64_norms[k]}
        keep("backward", end, loss, {"gradients": pending - end_grads}, bucket, made, {"temporaries": sizes[k]})
        if k == first_gip:  # grads_in_partition made right after this bucket's all_reduce
            keep("backward", end, loss, {"gradients": pending - end_grads}, bucket, {"temporaries": gip})
        if offload:
            keep("backward", end, loss, {"gradients": pending - end_grads}, bucket,
                 {"temporaries": fp64_norms[k] + copies[k]})
    keep("backward", end, loss, {"gradients": -end_grads}, bucket, {"temporaries": gip + zeros + pad + fp64_norms[-1]})

    if offload:  # the kept norms; AdamW on the host's fp32 partition beside the group's and the combined norm
        update = adamw_temporaries((part.numel,), 4, foreach) + 2 * DS_OFFLOAD_NORM_BYTES if host_is_device else 0
        keep("optimizer", {"temporaries": fp64_norms[-1]}, {"optimizer_state": update})
        return out.best
    loss = {"activations": -trace.loss_bytes}  # the step holds nothing carried: the partition is the one kept
    held, norms = {"temporaries": gip + zeros + pad}, 2 * DS_NORM_BYTES[stage]  # the combined and new global norm
    # get_grad_norm_direct: each piece in turn copied to float64 and its norm taken, beside the pieces' norms before it
    copy = max(((k + 1) + x) * FP64 for k, x in enumerate(part.pieces)) if part.pieces else 0
    keep("optimizer", held, {"optimizer_state": copy})
    # the flat gradient partition, and in bf16 / fp16 its fp32 copy (``.to``) before the flat one is deleted
    keep("optimizer", held, {"optimizer_state": part.numel * c + (part.numel * 4 if c != 4 else 0) + norms})
    keep("optimizer", {"optimizer_state": part.numel * 4 + adamw_temporaries((part.numel,), 4, foreach) + norms})
    return out.best


# [Note: DeepSpeed stage 3's phase peaks]
# Forward: the root's prefetch gathers every parameter of a module forward calls (the trace's units; none of a module it
# never calls) into one flat buffer (each padded to N), and the first module's fetch concatenates each into its own
# tensor; the flat buffer lives until the last module whose parameters came in it is fetched; nothing is released before
# backward but the parameters no module that backward reaches uses (a frozen module fed by nothing that trains): the
# coordinator's trace holds no later use of them (``__params_to_release``), so they go after their last module's
# forward. Backward: the bare backward less the traced parameter gradients (copied into the steady bucket), beside the
# parameters not yet released (a module's after its backward, unless an earlier one in forward order uses them too, or
# autograd never reaches its inputs: those until ``step``); a reduce-scatter's concatenation and its padding chunks when
# a bucket is reduced (the last one in the epilogue, after autograd), on gloo with ``_reduce_scatter_base``'s copy of
# its input. Optimizer: the flat fp32 gradient copy beside AdamW's temporaries over the fp32 partition and the step's
# float64 norms (one per sub-group, their combination, the new ``_global_grad_norm``).
def ds_stage3_phase_peaks(trace: StepTrace, *, numels: tuple[int, ...], world_size: int,
                          buckets: tuple[tuple[int, ...], ...], itemsize: int, gloo: bool,
                          partitions: tuple[int, ...] | None = None, foreach: bool = False,
                          schedule: Stage3Schedule | None = None, calls: tuple[ModuleCall, ...] = (),
                          bucket_numel: int | None = None, offload: bool = False, host_is_device: bool = True,
                          rank: int = 0, order: tuple[int, ...] = ()) -> dict[str, dict]:
    """Stage 3 (``numels``: every parameter, frozen ones too, in parameter order, the indices ``trace.units`` use;
    ``partitions``: the trainable parameters' partitions, None: every parameter's ceil(numel / N); ``buckets``: the
    reduce-scatters' gradient numels in backward order), per phase, the bytes above steady at the peak, by category.
    Frozen parameters are gathered and released with their modules as the others; only the trainable ones have an fp32
    partition. Steady holds the ipg bucket, the partitions and ``grad_partitions_flat_buffer``; the trace must carry its
    units (``own_params_units``). ([Note: DeepSpeed stage 3's phase peaks] above.) ``schedule``: the coordinator's
    over the step's module ``calls`` (:func:`zeroexp.formulas.deepspeed_fetch.ds_stage3_schedule`): forward then holds,
    at each hook, the parameters made and the flat buffers still held as it says, and backward releases what its
    post-backward hooks release (none of a persistent parameter); a parameter it released before backward (beyond
    ``stage3_max_reuse_distance``: ``__params_to_release``) a pre-backward hook gathers again (``fetch_sub_module``),
    backward then holding at each hook what the schedule says; a checkpointed unit's recompute (the schedule's
    ``recompute`` hooks, [DS-RECOMPUTE]) at each of its traced hooks (``trace.recomputes``), the rest of its backward
    segment after them. ``bucket_numel``
    (``reduce_bucket_size``; None: no gradient above it): a gradient above it is a bucket alone, never copied into the
    ipg bucket (stage3.py ``__add_grad_to_ipg_bucket``: ``bucket.elements + param.grad.numel() <=
    self.reduce_bucket_size``), autograd's tensor held from its hook until its reduce-scatter (the next gradient's
    hook, or the epilogue), then partitioned and freed (``partition_grads``).

    Under ``gradient_accumulation_steps`` > 1 every micro-batch is such a step: a gradient's partition accumulates in
    the steady ``grad_partitions_flat_buffer`` (``partition_grads``: ``copy_`` at ``micro_step_id`` 0, ``add_`` in
    place after), the epilogue's ``averaged_gradients`` are views of it (its ``torch.zeros_like`` is for a parameter
    without ``requires_grad`` of the optimizer's groups, which hold the trained ones alone here), and each backward's
    epilogue releases what its post-backward hooks did not (``backward_epilogue``: ``release_backward_leftovers``);
    measured on the Linear stack, a 2-layer Llama and a LoRA GPT (frozen parameters), fp32 and bf16, N=2 and 3.

    ``offload`` (accumulating: the boundary's micro-batch): after each bucket's reduce-scatter, beside its concatenation
    (its outputs), ``rank``'s partitions copied to float64 for their norms, kept to the step (``ds3_offload_norms``);
    the step: AdamW on the host's fp32 partition (its gradient steady) beside the norms and an fp32 scalar per
    sub-group and two more; ``host_is_device`` false (an NCCL rank): the device holds the kept norms alone."""
    c, n, out = itemsize, world_size, _Moments()
    keep, loss = out.keep, {"activations": -trace.loss_bytes}
    if not trace.units:
        raise ValueError("stage 3 needs a trace with its units (trace_step(..., own_params_units=True))")
    uses = _stage3_uses(trace, numels, c)
    gathered = sum(numels[p] for p in uses.first_use) * c  # every fetched parameter's unsharded tensor: a module's
    # parameters are fetched in its pre-forward hook, never those of a module forward does not call
    held = released = hooks = None
    offloaded = ds3_offload_norms(buckets, n, rank, order) if offload else None
    if schedule is None:
        _stage3_forward(keep, loss, trace, uses, numels=numels, world_size=n, itemsize=c, gathered=gathered)
    else:
        held, released, hooks = _stage3_forward_scheduled(keep, loss, trace, schedule, calls, numels=numels,
                                                          world_size=n, itemsize=c)
    _stage3_backward(keep, loss, trace, uses, numels=numels, world_size=n, itemsize=c, gathered=gathered, hooks=hooks,
                     buckets=buckets, gloo=gloo, held=held, released=released, bucket_numel=bucket_numel,
                     offloaded=offloaded)
    parts = list(partitions) if partitions is not None else [-(-x // n) for x in numels]  # the fp32 partition
    part, scalars = sum(parts), deepspeed_sub_groups(parts) + 2
    if offloaded is not None:  # the host's fp32 gradient is state: no flat copy
        update = adamw_temporaries((part,), 4, foreach) + scalars * DS_OFFLOAD_NORM_BYTES if host_is_device else 0
        keep("optimizer", {"temporaries": offloaded[0][-1]}, {"optimizer_state": update})
        return out.best
    keep("optimizer", {"optimizer_state": part * 4 + adamw_temporaries((part,), 4, foreach)
                       + scalars * DS_NORM_BYTES[3]})
    return out.best


class _Stage3Uses(NamedTuple):
    """Which units use each parameter (indices of ``ds_stage3_phase_peaks``' ``numels``): ``first_use``, the first
    unit (forward order) that uses it; ``unreached``, those whose every user backward never reaches; ``dropped``, per
    unit, the bytes released after its forward (the unreached parameters it uses last)."""

    first_use: dict[int, int]
    unreached: set[int]
    dropped: dict[int, int]


def _stage3_uses(trace: StepTrace, numels: tuple[int, ...], c: int) -> _Stage3Uses:
    """The parameters' uses by ``trace``'s units (``c``: bytes per element)."""
    users: dict[int, list[int]] = {}  # parameter -> the units (forward order) that use it
    for k, u in enumerate(trace.units):
        for p in u.params:
            users.setdefault(p, []).append(k)
    first_use = {p: ks[0] for p, ks in users.items()}
    unreached = {p for p, ks in users.items() if not any(trace.units[k].reached for k in ks)}
    dropped: dict[int, int] = {}  # unit -> the bytes released after its forward (parameters backward never uses)
    for p in unreached:
        dropped[users[p][-1]] = dropped.get(users[p][-1], 0) + numels[p] * c
    return _Stage3Uses(first_use, unreached, dropped)


def _stage3_forward(keep: Callable[..., None], loss: dict, trace: StepTrace, uses: _Stage3Uses, *,
                    numels: tuple[int, ...], world_size: int, itemsize: int, gathered: int) -> None:
    """:func:`ds_stage3_phase_peaks`' forward moments, each to ``keep``: each segment's peak beside the parameters
    gathered and the flat buffer while alive, and each fetch (every parameter gathered, the buffer still held)."""
    c, n = itemsize, world_size
    first_use, dropped = uses.first_use, uses.dropped
    flat = sum(padded_numel(numels[p], n) for p in first_use) * c  # the all_gather's flat buffer
    last_fetch = max(first_use.values())
    k_of = {u.name: k for k, u in enumerate(trace.units)}

    gone = 0  # released in forward so far
    for s in (s for s in trace.segments if s.phase == "forward"):
        k = k_of.get(s.unit, len(trace.units))  # the loss: after every unit
        alive = flat if (k <= last_fetch if s.at == "start" else k < last_fetch) else 0
        unsharded = gathered - gone if k > 0 or s.at == "end" else 0
        keep("forward", s.peak_by_category, loss, {"parameters": unsharded, "temporaries": alive})
        if s.at == "start" and k <= last_fetch:  # unit k fetched: every parameter gathered, the buffer still held
            keep("forward", s.end_by_category, loss, {"parameters": gathered - gone, "temporaries": flat})
        if s.at == "end":
            gone += dropped.get(k, 0)


def _stage3_backward(keep: Callable[..., None], loss: dict, trace: StepTrace, uses: _Stage3Uses, *,
                     numels: tuple[int, ...], world_size: int, itemsize: int, gathered: int,
                     buckets: tuple[tuple[int, ...], ...], gloo: bool, held: int | None = None,
                     released: dict[str, int] | None = None, bucket_numel: int | None = None,
                     hooks: list[_Hook] | None = None, offloaded: tuple[list[int], list[int]] | None = None) -> None:
    """:func:`ds_stage3_phase_peaks`' backward moments, each to ``keep``: each segment's peak less its parameter
    gradients beside the parameters not yet released, and each bucket's reduce-scatter (the last in the epilogue).
    ``held``, ``released``: the bytes held at forward's end and released after each unit's backward, as a schedule
    says (None: from the units' uses); ``hooks``: a schedule's backward hooks where it gathers again or holds a flat
    buffer past forward (None: neither), each segment then beside what the last hook before it holds, each fetch at
    its highest; ``offloaded``: :func:`~zeroexp.formulas.peak.ds_partition.ds3_offload_norms`' (None: not)."""
    c, n = itemsize, world_size
    first_use, unreached, dropped = uses
    # Backward: a parameter is released after the backward of its first user in forward order, if autograd reaches
    # that unit's input; the rest stay until step.
    released_by: dict[str, int] = {}
    for p, k in first_use.items():
        u = trace.units[k]
        if u.grad_input and p not in unreached:
            released_by[u.name] = released_by.get(u.name, 0) + numels[p] * c
    released_by = released_by if released is None else released
    # A bucket's reduce-scatter: the concatenation (none for one tensor divisible by N), the padding chunks it was
    # made of, on gloo a copy of the input.
    sizes, cats = [], [sum(padded_numel(x, n) for x in b) * c if len(b) > 1 or b[0] % n else 0 for b in buckets]
    for b, cat in zip(buckets, cats):
        sizes.append(cat + (cat - sum(b) * c if cat else 0) + (sum(padded_numel(x, n) for x in b) * c if gloo else 0))
    norms, copies = offloaded or ([0] * (len(buckets) + 1), [0] * len(buckets))
    edges = list(accumulate((sum(b) * c for b in buckets), initial=0))
    big = {k: b[0] * c for k, b in enumerate(buckets)
           if bucket_numel is not None and len(b) == 1 and b[0] > bucket_numel}
    held = gathered - sum(dropped.values()) if held is None else held
    before, backward, at = 0, [s for s in trace.segments if s.phase == "backward"], 1
    flat = hooks[0].after["temporaries"] if hooks else 0  # forward's flat buffers still held
    redo = recompute_moments(trace, hooks)  # a checkpointed unit's recompute: each of its hooks, then the rest
    for i, s in enumerate(backward):
        pairs, tail = redo.get(i, ((), s))
        for r, hook in (*pairs, (tail, None)):
            grads = r.peak_by_category.get("gradients", 0)
            keep("backward", r.peak_by_category, loss, {"gradients": _being_made(edges, big, grads) - grads,
                                                        "parameters": held,
                                                        "temporaries": flat + norms[_closed(edges, before)]})
            if hook is not None and r.at == "start":  # a recompute's fetch at its highest
                keep("backward", r.end_by_category, loss, {"gradients": -r.end_by_category.get("gradients", 0),
                                                           **hook.peak})
            held, flat = (hook.after["parameters"], hook.after["temporaries"]) if hook is not None else (held, flat)
        match = next((j for j in range(at, len(hooks)) if hooks[j][:2] == (s.unit, s.at)), None) if hooks else None
        if match is not None:  # this hook (the ones between, of modules without parameters, prefetch at most)
            hook = hooks[match]
            if s.at == "start":
                keep("backward", s.end_by_category, loss, {"gradients": -s.end_by_category.get("gradients", 0),
                                                           **hook.peak})
            held, flat, at = hook.after["parameters"], hook.after["temporaries"], match + 1
        after = s.end_by_category.get("gradients", 0)
        for k in range(_closed(edges, before), _closed(edges, after)):  # in the hook of bucket k+1's first gradient
            pending = {"gradients": buckets[k + 1][0] * c + big.get(k, 0) - after, "parameters": held}
            keep("backward", _at_hook(backward, i), loss, pending, {"temporaries": sizes[k] + flat + norms[k]})
            if offloaded:  # then its partitions copied to float64 one by one, beside the concatenation
                keep("backward", _at_hook(backward, i), loss, pending,
                     {"temporaries": cats[k] + flat + norms[k] + copies[k]})
        if s.at == "end" and hooks is None:
            held -= released_by.get(s.unit, 0)
        before = after
    end = trace.segments[-1].end_by_category
    last = big.get(len(buckets) - 1, 0)  # a gradient above the bucket reduced in the epilogue: held until then
    pending, kept = {"gradients": last - end.get("gradients", 0), "parameters": held}, norms[max(len(buckets) - 1, 0)]
    keep("backward", end, loss, pending, {"temporaries": (sizes[-1] if sizes else 0) + flat + kept})  # the epilogue's
    if offloaded and buckets:
        keep("backward", end, loss, pending, {"temporaries": cats[-1] + flat + kept + copies[-1]})


def _stage3_forward_scheduled(keep: Callable[..., None], loss: dict, trace: StepTrace, schedule: Stage3Schedule,
                              calls: tuple[ModuleCall, ...], *, numels: tuple[int, ...], world_size: int,
                              itemsize: int) -> tuple[int, dict[str, int], list[_Hook] | None]:
    """:func:`ds_stage3_phase_peaks`' forward moments under ``schedule``, each to ``keep``: each segment's peak beside
    the parameters made before its hook (none is made or released between two hooks of modules holding parameters)
    and the flat buffers held throughout it (a module without parameters may prefetch inside it: the fewest), and each
    unit's fetch at its highest. Returns the parameter bytes held at forward's end, per unit those its
    post-backward hook releases, and where backward gathers again its hooks (:class:`_Hook`; else None)."""
    c, n, gathers = itemsize, world_size, schedule.gathers

    def bytes_of(whole: frozenset[int], flats: tuple[int, ...]) -> dict[str, int]:
        return {"parameters": sum(numels[p] for p in whole) * c,
                "temporaries": sum(padded_numel(numels[p], n) for g in flats for p in gathers[g]) * c}

    forward = [e for e in schedule.events if e.phase == "forward"]
    name_of, hooks = _unit_calls(trace, calls), {}
    for i, e in enumerate(forward):
        if calls[e.call].module in name_of:
            hooks.setdefault((name_of[calls[e.call].module], "start" if e.fetch else "end"), i)
    after = [bytes_of(e.whole, e.flats) for e in forward]
    previous = -1
    for s in (s for s in trace.segments if s.phase == "forward"):
        hook = len(forward) if s.unit == "loss" else hooks[(s.unit, s.at)]
        stretch = [after[i] for i in range(max(previous, 0), hook)] if previous >= 0 else [{}]
        made = after[hook - 1]["parameters"] if hook > 0 else 0
        keep("forward", s.peak_by_category, loss, {"parameters": made,
                                                   "temporaries": min(a.get("temporaries", 0) for a in stretch)})
        if s.unit != "loss" and s.at == "start":
            keep("forward", s.end_by_category, loss, bytes_of(*forward[hook].peak))
        previous = hook
    released: dict[str, int] = {}
    for e in (e for e in schedule.events if e.phase == "backward" and not e.fetch and e.released):
        name = name_of.get(calls[e.call].module)
        released[name] = released.get(name, 0) + sum(numels[p] for p in e.released) * c
    hooks = None  # forward's end first (no unit's), then each unit's backward hook
    if any(e.gathered for e in schedule.events if e.phase != "forward") or forward and forward[-1].flats:
        hooks = [_Hook("", "", after[-1], {})] + [
            _Hook(name_of[calls[e.call].module], (REDO if e.phase == "recompute" else "") + ("start" if e.fetch else
                  "end"), bytes_of(e.whole, e.flats), bytes_of(*e.peak)) for e in schedule.events
            if e.phase != "forward" and calls[e.call].module in name_of]
    return after[-1]["parameters"] if after else 0, released, hooks
