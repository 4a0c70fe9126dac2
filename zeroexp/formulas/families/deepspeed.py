"""DeepSpeed's family [DS]: ZeRO stage 0 (DDP-like all_reduce chunks), stages 1-2 (one flat group per parameter
group, partitioned; its runtime model :mod:`zeroexp.formulas.deepspeed`), stage 3 (every parameter partitioned on its
own, fetched module by module); the peak model of stages 1-3 (:mod:`zeroexp.formulas.peak.deepspeed`) and of stage
0 (:mod:`zeroexp.formulas.peak.ds_stage0`); rows
``deepspeed_stage0`` .. ``deepspeed_stage3``, DeepSpeed 0.19 as zeroexp's state probe measures it."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from zeroexp.formulas.deepspeed import (DS_NORM_BYTES, REPLAYED_RECOMPUTE, stage3_calls, stage3_schedule,
                                        deepspeed_comm, deepspeed_payload, deepspeed_payload_limits,
                                        deepspeed_reduce_bucket_numel, deepspeed_sub_groups, ds_reduce_order,
                                        ipg_buffers)
from zeroexp.formulas.families.base import Cut, Family
from zeroexp.formulas.families.ddp import MIXED
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, phase
from zeroexp.formulas.layout import MASTER_BYTES, PlanKnobs, StateLayout, pack
from zeroexp.formulas.paper import padded_numel
from zeroexp.formulas.peak.deepspeed import (ds_allreduce_copies, ds_partition, ds_stage3_phase_peaks,
                                             ds_stage12_phase_peaks)
from zeroexp.formulas.peak.ds_partition import graded_pieces
from zeroexp.formulas.peak.ds_ranks import DsStage12Ranks, ds_partitions, ds_worst_rank
from zeroexp.formulas.peak.ds_stage0 import ds_stage0_accumulated_phase_peaks
from zeroexp.formulas.peak.phases import highest_phases
from zeroexp.formulas.shapes import Groups, Shard, Unit
from zeroexp.formulas.time.overlap import Slot, cumulative

__all__ = ["DeepSpeedPartitions", "DEEPSPEED", "ROWS", "DEEPSPEED_ROWS"]

#: Stage 3's reductions in flight on the side stream at most under ``overlap_comm`` (stage3.py
#: ``max_param_reduce_events``): before another is issued, the oldest beyond them is synchronized.
DS3_REDUCE_EVENTS = 2
#: How each stage's groups are cut: stage 0 replicated, stages 1-2 one flat group, stage 3 each parameter.
_KIND = {0: "none", 1: "flat", 2: "flat", 3: "params"}


class DeepSpeedPartitions(Family):
    """DeepSpeed's ZeRO stages, each row's ``deepspeed_stage``."""

    name = "deepspeed"
    clones_world = True  # its data-parallel group without an mpu: groups._clone_world_group()
    covered_rank = 3

    def groups_kind(self, row):
        return _KIND[row.deepspeed_stage]

    def sharded_written(self, row, groups, itemsize, knobs, state, again):
        """DeepSpeed's ``save_checkpoint`` (engine.py ``_save_checkpoint``, ``_save_zero_checkpoint``): each rank's
        ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` the optimizer state it holds (its fp32 partition, both moments
        and the step: the state model's ``master``, ``optim``, ``optim_scalar`` at rank r, padding included) at stages
        1-3; the module's state dict in ``mp_rank_00_model_states.pt`` on rank 0 at stages 0-2 (the parameters as held,
        whole: ``param`` at rank 0; at stage 0 the torch optimizer's state too) and in each rank's
        ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` at stage 3 (its buffers and its partitions of the frozen
        parameters, ``frozen_param_fragments``: the rank's ``param`` less its trainable partition, held in the compute
        dtype; at stages 1-2 the frozen parameters' fragments are the module's own tensors, stored once)."""
        from zeroexp.formulas.layout import MASTER_BYTES, rank_state_bytes

        stage, n = row.deepspeed_stage, groups.world_size
        held = rank_state_bytes(row, groups, itemsize, knobs)

        def at(kind: str, r: int) -> int:
            return int(held[kind][r][1]) if kind in held else 0

        optim = [at("master", r) + at("optim", r) + at("optim_scalar", r) if stage > 0 or r == 0 else 0
                 for r in range(n)]
        frozen = [at("param", r) - at("master", r) // MASTER_BYTES * itemsize if sum(groups.frozen) else 0
                  for r in range(n)]
        module = [at("param", 0) if stage < 3 else frozen[0]] + [frozen[r] if stage == 3 else 0 for r in range(1, n)]
        buffers = [state.buffers if stage == 3 or r == 0 else 0 for r in range(n)]
        ranks = [m + o + b for m, o, b in zip(module, optim, buffers)]
        return {"layout": "deepspeed", "total": sum(ranks), "ranks": ranks, "state": state.record(), "aliases": 0,
                "optimizer_ranks": optim}

    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """Lower bounds (zeroexp.strategies.deepspeed): a full save makes each parameter's fp32 master and moments
        whole on every rank, one parameter at a time (``safe_get_full_*``: a zeros tensor of its size all-reduced at
        stages 1-2, all-gathered at 3; stage 0 reads its replica), rank 0 keeping them all (to the host on an
        accelerator); a full load reads the file on every rank; a sharded save writes DeepSpeed's own partitions;
        a sharded load reads the rank's optimizer file (its fp32 partition, both moments, the step; stage 0: the
        one file, the whole state). What DeepSpeed allocates beside them is not sized."""
        n, cpu, stage = groups.world_size, device.name == "cpu", row.deepspeed_stage
        if kind == "full":
            trained = [k for i, k in enumerate(shape.numels) if shape.train(i)]
            one = 0 if stage == 0 else MASTER_BYTES * max(trained, default=0)
            keep = [{"kept": full_file if cpu else one}] + [{"one_parameter": one}] * (n - 1)
            save = phase(keep, [cpu and stage == 0] * n, None if cpu else [full_file] + [0] * (n - 1),
                         unsized=() if stage == 0 else ("engine_state",))
            load = phase([{"file": full_file if cpu else 0}] * n, [False] * n, None if cpu else [full_file] * n,
                         unsized=("engine_state",))
            return CheckpointPeaks(kind, save, load)
        read = ([full_file] * n if stage == 0 else
                self.sharded_written(row, groups, itemsize, knobs, state, 0)["optimizer_ranks"])
        save = phase([{"copied": 0}] * n, [False] * n, unsized=("engine_state",))
        load = phase([{"optimizer_file": b if cpu else 0} for b in read], [False] * n, None if cpu else list(read),
                     unsized=("engine_state",))  # read to the host, then copied into the partitions
        return CheckpointPeaks(kind, save, load)

    def cuts_frozen(self, row):
        return row.deepspeed_stage == 3  # stage 3 partitions every module parameter, frozen ones too

    def pads_count(self, row):
        return row.deepspeed_stage > 0

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        numels, stage = shape.numels, row.deepspeed_stage
        if stage == 3:  # each module's own parameters, each padded to N, fetched as one [DS]
            shards = [Shard(((0, k),), padded_numel(k, n)) for k in numels]
            return Cut(shards=shards, grad_shards=[sh for i, sh in enumerate(shards) if shape.train(i)],
                       units=[Unit(sum(padded_numel(numels[i], n) for i in m), 1) for m in shape.modules if m])
        if stage:
            spans, length = pack(list(numels))
            return Cut(shards=[Shard(spans, padded_numel(length, row.pad * n))])
        return Cut()

    def collective_slots(self, row, groups, prefetch, f, b, o, knobs):
        """Stage 0: every chunk's all_reduce after backward, nothing overlapped (engine.py ``backward`` ->
        ``allreduce_gradients`` -> ``buffered_allreduce_fallback``: no gradient hook reduces). Stages 1-3 without
        ``overlap_comm`` (zeroexp's default): no rule, every collective exposed (the hooks reduce on the compute
        stream). With it (stages 2-3), each bucket's reduction is issued on the side stream when the bucket is full,
        as backward fills it (the hook of the next gradient that does not fit; the last in the epilogue): stage 2's
        all_reduce is waited for when the next bucket is reduced (stage_1_and_2.py ``average_tensor``: the compute
        stream waits on the reduction stream before the next reduction is issued; two buffers, one being filled),
        stage 3's reduce_scatter when the third bucket after it is reduced (stage3.py ``__reduce_and_partition_ipg_
        grads``: an event per reduction, ``max_param_reduce_events`` pending at most, the oldest synchronized before a
        third is issued), the last ones at backward's end (the stream synchronized in the epilogue); the step's norm
        all_reduce and the parameters' all_gathers as before, exposed."""
        stage, end_b = row.deepspeed_stage, f + b
        if stage == 0:
            return ([Slot("all_reduce", sum(k), end_b, end_b, order=i) for i, k in enumerate(groups.buckets)],
                    "stage 0 all-reduces after backward (buffered_allreduce_fallback): nothing overlapped")
        if not knobs.overlap_comm or not self.reads_overlap_comm(row) or not groups.buckets:
            return super().collective_slots(row, groups, prefetch, f, b, o, knobs)
        c = cumulative([sum(k) for k in groups.buckets])
        full = [f + b * c[i + 1] / c[-1] for i in range(len(groups.buckets))]  # each bucket full, in reduce order
        if stage == 3:
            needed = full[DS3_REDUCE_EVENTS + 1:] + [end_b] * (DS3_REDUCE_EVENTS + 1)
            return ([Slot("reduce_scatter", sum(k), full[i], needed[i]) for i, k in enumerate(groups.buckets)],
                    "overlap_comm: each bucket's reduce_scatter on the side stream as backward fills it, waited for "
                    f"when the {DS3_REDUCE_EVENTS + 1}rd bucket after it is reduced")
        needed = full[1:] + [end_b]
        slots = [Slot("all_reduce", sum(k), full[i], needed[i]) for i, k in enumerate(groups.buckets)]
        slots.append(Slot("all_reduce", 1, end_b, end_b, order=len(slots)))  # the step's norm: a scalar
        return slots, ("overlap_comm: each bucket's all_reduce on the side stream as backward fills it, waited for "
                       "when the next bucket is reduced")

    def time_knobs(self, row, knobs, device):
        """``overlap_comm`` moves nothing off a GPU: DeepSpeed's CPU accelerator has no streams
        (accelerator/cpu_accelerator.py: ``is_synchronized_device``, ``Stream()`` None, ``stream()`` a no-op), so its
        reductions run where they are issued, as without it (its second ipg buffer is still allocated)."""
        return knobs if device == "cuda" or not knobs.overlap_comm else replace(knobs, overlap_comm=False)

    def below_min_world(self, row):
        return ("at one rank DeepSpeed's stage 3 gathers nothing (its parameters are whole there; measured: no "
                "all_gather, the forward 4.2 MB under the stage-3 plan on the mlp), which its model does not follow")

    def reads_overlap_comm(self, row):
        """Stages 2-3 (stage 0 has no ZeRO optimizer; stage 1's hooks would take stage 2's path: refused there,
        ``zeroexp.cell.strategy.check_ds_overlap_comm``)."""
        return row.deepspeed_stage >= 2

    def framework_terms(self, row, groups, itemsize, cost, orig_params, terms, notes):
        """Stage 0: the fallback's passes over the gradients (engine.py ``allreduce_bucket``: ``flatten`` into one
        tensor, ``mul_`` by 1/N after the all_reduce, each gradient copied back: three copies' worth,
        ``copy_s_per_byte``); its engine's own step not calibrated: said. Stages 1 and 2 (DeepSpeed's
        ``DeepSpeedZeroOptimizer``): the engine's own step, ``deepspeed_step_s`` + the model's fp32 parameter bytes x
        ``deepspeed_step_s_per_byte`` (calibrated on stage 2 as zeroexp configures it:
        :mod:`zeroexp.calibrate.deepspeed_engine`), after backward. Stage 3's engine (parameter hooks per module) is
        not calibrated: said."""
        stage = row.deepspeed_stage
        if stage == 0:
            terms["deepspeed_fallback_copies"] = 3 * sum(map(sum, groups.buckets)) * itemsize * cost.copy_s_per_byte
            notes.append("DeepSpeed's stage-0 engine: its gradients' copies costed, its own step not calibrated "
                         "(stages 1 and 2's is)")
            return 0.0, terms["deepspeed_fallback_copies"], 0.0
        engine = cost.deepspeed_step_s
        if stage in (1, 2) and engine is not None:
            terms["deepspeed_engine"] = engine + 4 * groups.numel * (cost.deepspeed_step_s_per_byte or 0.0)
            return 0.0, 0.0, terms["deepspeed_engine"]
        notes.append(f"DeepSpeed's stage-{stage} engine: its own cost not calibrated "
                     + ("(a calibration before schema 10, or without DeepSpeed installed)" if stage in (1, 2) else
                        "(stages 1 and 2's engine is; stage 3's parameter hooks are not)"))
        return 0.0, 0.0, 0.0

    # --- the peak model: stages 0-3 ------------------------------------------------------------------------------
    #: Where the peak model of the family is written.
    peak_source = "zeroexp.formulas.peak.deepspeed; stage 0: zeroexp.formulas.peak.ds_stage0"

    def flow(self, row):
        if row.deepspeed_stage == 0:  # the module's own gradients, all-reduced at the boundary (peak/ds_stage0.py)
            return "allreduce_fallback"
        return "deepspeed" if row.deepspeed_stage else None

    def offload_limit(self, row, offload, micro_batches=1):
        """The optimizer offloaded: modelled at stages 1-3 (:func:`zeroexp.formulas.peak.deepspeed.
        ds_stage12_phase_peaks`, :func:`~zeroexp.formulas.peak.deepspeed.ds_stage3_phase_peaks`, ``offload``), with
        accumulation at stages 2-3 (each micro-batch as without offload, the boundary's as offloaded: measured exact,
        their host buffers made once and kept). Not yet: stage 1's accumulation offloaded (measured above the model
        by up to a bucket's gradients on one rank), and stage 3's parameters offloaded (``offload=full``)."""
        stage = row.deepspeed_stage
        if offload == "optimizer" and (micro_batches == 1 or stage in (2, 3)):
            return None
        what = "with grad_accum > 1 at stage 1" if offload == "optimizer" else f"at stage {stage}"
        return (f"no peak model yet for offload={offload} {what}: DeepSpeed's offloaded backward and step are not "
                "modelled there (it runs on CPU: state, groups and collectives are checked; covered: offload none, "
                "and offload=optimizer at stages 1-3, with grad_accum at stages 2-3)")

    def checkpointing_limit(self, row, frozen=False):
        # measured: a LoRA GPT (n_layer=2, N=2 and 3, bf16) under stage 3 with checkpointing re-fetches its frozen
        # modules' parameters in the recompute (the coordinator released them after forward: backward never reaches
        # them; the recompute gathers them again and hands them to the module being differentiated,
        # update_recompute_parameters): 9 all_gathers a step where one is planned (plan.collectives FAILs as well).
        # Every parameter trained: the recompute finds them all still gathered (measured on the GPT and a Llama).
        return ("no peak model yet for DeepSpeed stage 3 with activation checkpointing and frozen parameters: the "
                "recompute re-fetches the frozen modules' parameters (measured 9 all_gathers a step on a LoRA GPT "
                "where 1 is planned)" if row.deepspeed_stage == 3 and frozen else None)

    def trace_options(self, row):
        """Segmented at every module holding parameters (stage 3 gathers and releases module by module); bf16 runs
        the module converted (``converts_module``); traced in tensor bytes, as the closed-form terms count them."""
        return {"own_params_units": True, "root_unit": False, "converts_module": True, "tensor_bytes": True}

    def peak_limits(self, row, groups, bucket_cap_bytes, recompute=False):
        """DeepSpeed's paths the peak model has not read: a parameter gathered twice (released in forward beyond the
        reuse distance, gathered again by its pre-backward hook or by the recompute of a checkpointed unit) is
        replayed under every ``activation_checkpointing`` mode (``recompute``: the mode; True where unknown: its
        recompute not replayed)."""
        reasons, stage = [], row.deepspeed_stage
        if self.flow(row) is None:
            return reasons
        fetched, gathered = groups.numel + sum(groups.frozen), sum(sum(g) for g in groups.gathers)
        if stage == 3 and gathered > fetched and recompute and recompute not in REPLAYED_RECOMPUTE:
            how = f"activation_checkpointing={recompute}" if isinstance(recompute, str) else "activation checkpointing"
            reasons.append(f"no peak model yet for stage 3 with {how} gathering a parameter twice in a step "
                           f"({gathered} parameter elements gathered of {fetched}: released in forward beyond the "
                           "reuse distance or live-parameter limit, the recompute's own fetches replayed only where "
                           "the mode is known)")
        return reasons

    def accumulates(self, row):
        """Stages 0-3 under ``gradient_accumulation_steps`` > 1, the engine's own accumulation (zeroexp's adapter hands
        DeepSpeed ``grad_accum`` and steps the engine after every micro-batch: strategies/deepspeed.py)."""
        return self.flow(row) is not None

    def needs_in_place(self, row, micro_batches):
        """Stage 0 adds every later micro-batch's gradients into the module's ``.grad`` (autograd's
        ``AccumulateGrad``: :func:`zeroexp.formulas.peak.ds_stage0.ds_stage0_accumulated_phase_peaks`). Stage 1 adds
        every later micro-batch's gradients into autograd's whole ones (nothing reduced before the boundary:
        :func:`zeroexp.formulas.peak.deepspeed.ds_accumulation`)."""
        if row.deepspeed_stage == 0:
            return micro_batches > 1
        return self.flow(row) is not None and row.deepspeed_stage == 1 and micro_batches > 1

    def _covered(self, row) -> int:
        if self.flow(row) is None:
            raise KeyError(row.label)
        return row.deepspeed_stage

    def phase_peaks(self, row, groups, shape, trace, itemsize, *, rank, prefetch, gloo, micro_batches, in_place,
                    bucket_cap_bytes, terms, reduce, root_kept, foreach, knobs, block):
        """For rank ``rank`` (``bucket_cap_bytes``: ``strategy.bucket_cap_mb`` in bytes, whence
        ``reduce_bucket_size``; ``gloo``: the CPU backend's copies; ``foreach``: the client AdamW's update, foreach on
        a CUDA rank); stage 3 needs a trace with its units (``own_params_units``)."""
        stage, n = self._covered(row), groups.world_size
        if stage == 0:  # every gradient whole on every rank; trainable parameters the step leaves ungraded
            idle = shape.trainable().unused if shape.exact else ()
            return ds_stage0_accumulated_phase_peaks(trace, in_place, micro_batches, numels=groups.numels,
                                                     buckets=groups.buckets, itemsize=itemsize, foreach=foreach,
                                                     ungraded=tuple(idle))
        if stage == 3:  # the shards: every parameter, frozen ones too, in parameter order
            every = tuple(sh.spans[0][1] for sh in groups.shards)
            traced = shape.module_calls and len(shape.numels) == len(every)
            return ds_stage3_phase_peaks(trace, numels=every, world_size=n, buckets=groups.buckets, itemsize=itemsize,
                                         gloo=gloo, partitions=tuple(sh.numel // n for sh in groups.trained_shards),
                                         foreach=foreach, schedule=stage3_schedule(shape, knobs) if traced else None,
                                         calls=stage3_calls(shape, knobs) if traced else (),
                                         bucket_numel=deepspeed_reduce_bucket_numel(bucket_cap_bytes),
                                         offload=knobs.offload != "none", host_is_device=gloo, rank=rank,
                                         order=groups.reduce_order)
        part = ds_partition(groups.numels, groups.shards[0].numel, n, rank)
        # offloaded: the host's memory is the device's on a gloo (CPU) rank, another one on an NCCL rank
        peaks = partial(ds_stage12_phase_peaks, stage=stage, buckets=groups.buckets,
                        order=_reduce_order(groups, stage), numels=groups.numels, part=part,
                        bucket_numel=deepspeed_reduce_bucket_numel(bucket_cap_bytes), itemsize=itemsize,
                        foreach=foreach, ungraded=groups.ungraded, offload=knobs.offload != "none",
                        host_is_device=gloo, ipg_buffers=ipg_buffers(stage, knobs))
        if micro_batches < 2:
            return peaks(trace)
        # the first micro-batch as a step without accumulation (stage 1 reduces nothing in it: a lower bound), every
        # later one holding what the earlier ones left (stage 1: traced with its gradients allocated)
        return highest_phases(peaks(trace), peaks(in_place if stage == 1 else trace, later=True))

    def worst_rank(self, row, groups, trace, itemsize, *, micro_batches, in_place, bucket_cap_bytes, foreach,
                   knobs=PlanKnobs()):
        """Stages 1-2: each rank's phases' bytes from the moments' rank-independent terms summed once
        (:class:`zeroexp.formulas.peak.ds_ranks.DsStage12Ranks`), the first highest rank of them. Offloaded, the ranks
        differ only by their pieces' float64 copies and kept norms: the ranks of the largest piece and of the most
        pieces, to be evaluated (a rank whose smaller piece lands on a higher moment is not sought)."""
        stage, n = self._covered(row), groups.world_size
        if stage not in (1, 2):  # stage 0 replicates everything (every rank alike); stage 3: each rank evaluated
            return None
        if knobs.offload != "none":
            idle, parts = frozenset(groups.ungraded), ds_partitions(groups.numels, groups.shards[0].numel, n)
            graded = [list(graded_pieces(p, idle).values()) for p in parts]
            largest = max(range(n), key=lambda r: max(graded[r], default=0))
            return tuple(dict.fromkeys((largest, max(range(n), key=lambda r: len(graded[r])))))
        ranks = partial(DsStage12Ranks, stage=stage, buckets=groups.buckets, order=_reduce_order(groups, stage),
                        numels=groups.numels, partition_numel=groups.shards[0].numel // n,
                        bucket_numel=deepspeed_reduce_bucket_numel(bucket_cap_bytes), itemsize=itemsize,
                        foreach=foreach, ungraded=groups.ungraded, ipg_buffers=ipg_buffers(stage, knobs))
        later = ranks(in_place if stage == 1 else trace, later=True) if micro_batches > 1 else None
        return ds_worst_rank(ranks(trace), ds_partitions(groups.numels, groups.shards[0].numel, n), later)

    def step_frees_grads(self, row):
        """Stage 0 (engine.py ``_take_model_step``: ``zero_grad``, every ``.grad`` set to None); stages 1-2
        (stage_1_and_2.py ``step``: ``free_grad_in_param_list``, ``averaged_gradients[i] = None``);
        stage 3 keeps its gradient buffer (stage3.py ``grad_partitions_flat_buffer``, allocated once)."""
        return self.flow(row) is not None and row.deepspeed_stage < 3

    def steady_buffers(self, row, groups, itemsize, bucket_cap_bytes, terms):
        """Stage 3's ipg bucket (allocated once, ``reduce_bucket_size`` elements of the gradient dtype); stages 1-2
        free theirs in every backward's epilogue."""
        return deepspeed_reduce_bucket_numel(bucket_cap_bytes) * itemsize if row.deepspeed_stage == 3 else 0

    def late_free(self, row, groups, itemsize, micro_batches, bucket_cap_bytes=0):
        """Stages 0-2 a bucket's (stage 0: a chunk's) flattened all_reduce tensor (in backward, or into the step);
        stage 3 the parameters' all_gather buffer (forward), a bucket's reduce-scatter concatenation (backward) and
        gloo's copy of it (backward, or into the step: the work object gloo's worker thread still holds); in the step
        (stages 1-3), the squared gradient norm's all_reduce tensor."""
        stage = row.deepspeed_stage
        if self.flow(row) is None:
            return {}
        if stage == 0:  # the same allreduce_bucket over stage 0's chunks: its flattened tensor (torch.cat) freed late
            # by gloo's worker, held into the step (seen: the GPT at N=2 with clipping, 474,112 B, the chunk's bytes)
            flat = [(f"chunk {k}'s flattened all_reduce tensor (allreduce_bucket)", sum(b) * itemsize)
                    for k, b in enumerate(groups.buckets) if sum(b)]
            return {"backward": flat, "optimizer": flat}
        norm = {"optimizer": [("the squared gradient norm's all_reduce tensor (get_grad_norm_direct)",
                               DS_NORM_BYTES[stage])]}
        if stage < 3:
            copies = ds_allreduce_copies(groups.buckets, _reduce_order(groups, stage), groups.numels,
                                         groups.shards[0].numel // groups.world_size,
                                         deepspeed_reduce_bucket_numel(bucket_cap_bytes) if bucket_cap_bytes else None)
            flat = [(f"bucket {k}'s flattened all_reduce tensor (allreduce_bucket)", e * itemsize)
                    for k, e in enumerate(copies) if e]
            # the last bucket's, reduced at backward's end, may outlive it into the step (seen on rank 1 of 3)
            return {"backward": flat, "optimizer": norm["optimizer"] + flat}
        n = groups.world_size
        flat = sum(padded_numel(k, n) for g in groups.gathers for k in g) * itemsize  # every fetched parameter
        scattered = [sum(padded_numel(x, n) for x in b) * itemsize for b in groups.buckets]
        concat = [(f"bucket {k}'s reduce-scatter concatenation (reduce_scatter_coalesced)", b)
                  for k, b in enumerate(scattered)]
        # gloo's _reduce_scatter_base clones its input; the work object holding the clone may outlive the wait on
        # gloo's worker thread, into the step (seen: the biased 10-7-3 stack at N=3, 420 B labelled activations)
        copy = [(f"bucket {k}'s reduce-scatter input as gloo copied it (_reduce_scatter_base), held by gloo's work",
                 b) for k, b in enumerate(scattered)]
        return {"forward": [("the parameters' all_gather flat buffer (_all_gather_coalesced)", flat)],
                "backward": concat + copy, "optimizer": norm["optimizer"] + copy}


def _reduce_order(groups: Groups, stage: int) -> tuple[int, ...]:
    """:func:`ds_reduce_order` of ``groups``."""
    return ds_reduce_order(groups.numels, groups.ungraded, stage, groups.reduce_order)


DEEPSPEED = DeepSpeedPartitions()

_OS_G, _OS_G_P = frozenset({"optim", "grad"}), frozenset({"optim", "grad", "param"})
_SOURCE = ("DeepSpeed 0.19, measured by zeroexp's state probe (CPU, gloo; fp32 and bf16, offload none and optimizer, "
           "stage 3 full; fp16 read, not run: it needs a GPU); [DS] source")


def _row(stage: int, **kw) -> StateLayout:
    # Buffers keep their dtype under bf16 / fp16: DeepSpeed >= 0.19.2 casts parameters alone unless
    # data_types.buffer_dtype is set (runtime/engine.py _cast_module_mixed_precision; DeepSpeed PR #8066, "preserve
    # fp32 buffers", first in v0.19.2), so a rotary inv_freq stays fp32; before it, module.bfloat16() cast them too.
    return StateLayout(f"DeepSpeed 0.19 stage {stage}", stage, family=DEEPSPEED,
                       payload=partial(deepspeed_payload, stage), casts_buffers=False,
                       comm=partial(deepspeed_comm, stage),
                       payload_limits=partial(deepspeed_payload_limits, stage), precisions=MIXED,
                       deepspeed_stage=stage, ranks_differ=stage in (1, 2), **kw)


#: DeepSpeed 0.19 as measured; stage 1 holds the same state as stage 2 (its gradients are partitioned too). Padding
#: (stage_1_and_2.py, partition_parameters.py): stages 1-2 one flat group per parameter group, its end aligned to
#: ``nccl_start_alignment_factor`` (2) x N, no padding between parameters (``parameter_alignment``, off by default);
#: stage 3 each parameter padded to N on its own (``_padding_size``). By stage.
DEEPSPEED_ROWS: tuple[StateLayout, ...] = (
    _row(0, sharded=frozenset(), master="mixed",
         source=_SOURCE + "; engine.py FP16_UnfusedOptimizer: an fp32 copy per parameter (mixed)"),
    *(_row(k, sharded=_OS_G, master="always", pad=2, offloads=frozenset({"none", "optimizer"}), whole_grads=True,
           offload_grad="replace", flat_optimizer=True, source=_SOURCE + "; stage_1_and_2.py")
      for k in (1, 2)),
    # stage 3 at one rank fetches nothing (its parameters whole there; measured: no all_gather, forward 4.2 MB under
    # its plan on the mlp): not modelled, so its row starts at two ranks (the adapter refuses fewer)
    _row(3, sharded=_OS_G_P, master="always", gather="largest", offloads=frozenset({"none", "optimizer", "full"}),
         offload_grad="add", flat_optimizer=True, sub_groups=deepspeed_sub_groups, min_world_size=2,
         source=_SOURCE + "; stage3.py, partition_parameters.py"),
)
ROWS = {f"deepspeed_stage{row.deepspeed_stage}": row for row in DEEPSPEED_ROWS}
