"""zeroexp's own ZeRO-1 / ZeRO-2 (zeroexp/strategies/sharding.py): the parameters views of flat buckets in the
compute dtype, each bucket reduce-scattered (or all-reduced) to its shard's owner, the fp32 master and moments
sharded, the updated shards all-gathered in the next forward's pre-hooks; rows ``zero1`` and ``zero2``."""

from __future__ import annotations

from zeroexp.formulas.peak.accumulation import accumulated_phase_peaks
from zeroexp.formulas.peak.allocator import counted, counted_sum
from zeroexp.formulas.families.base import Cut, Family
from zeroexp.formulas.families.ddp import ADAMW, MIXED
from zeroexp.formulas.init import replica_init_peak_bytes
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, phase, step_bytes
from zeroexp.formulas.layout import MASTER_BYTES, MOMENT_BYTES, STEP_BYTES, StateLayout, cut_buckets, pack
from zeroexp.formulas.time.overlap import Slot, cumulative
from zeroexp.formulas.paper import Collectives, collectives_of, padded_numel
from zeroexp.formulas.peak.precision import (FP32_TERMS, PrecisionTerms, gather_input_bytes,
                                             master_upcast_bytes)
from zeroexp.formulas.shapes import Groups, Payload, PlanKnobs, Shard

__all__ = ["ZeroBuckets", "ZERO", "ROWS", "scatter_gather", "scatter_gather_each_micro_batch"]


def _scatter_gather(reduce_each_micro_batch: bool) -> Payload:
    """ZeRO-1/2 [ZeRO 7.2.1]: per padded buffer b, one reduce_scatter S = b (``reduce="allreduce"``: an all_reduce)
    and one all_gather S = b: P + P, the bus bytes of an all_reduce; clipping or loss scaling add one fp32 scalar
    all_reduce (the squared global norm). With ``grad_accum=K`` ZeRO-1 reduces the accumulated gradient once, ZeRO-2
    (``reduce_each_micro_batch``) every micro-batch, into its gradient shard (as DeepSpeed's ZeRO-2)."""
    def payload(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
        sizes = [sh.numel * c for sh in g.shards]
        reduced = sizes * (knobs.micro_batches if reduce_each_micro_batch else 1)
        allreduce = knobs.reduce == "allreduce"
        return collectives_of(reduce_scatter=[] if allreduce else reduced, all_gather=sizes,
                              all_reduce=(reduced if allreduce else []) + ([4] if knobs.norm_allreduce else []))
    payload.__doc__ = _scatter_gather.__doc__
    return payload


scatter_gather = _scatter_gather(False)
scatter_gather_each_micro_batch = _scatter_gather(True)


class ZeroBuckets(Family):
    """zeroexp's ZeRO: flat buckets of the trainable parameters, cut at ``strategy.bucket_cap_mb``. ZeRO-1 (the
    ``in_place`` flow): the gradients stay allocated across steps as views of the buckets, autograd accumulating
    into them. ZeRO-2 (gradients sharded: the ``bucket`` flow): no gradient survives the step; a bucket's flat
    buffer is allocated when its first gradient is ready and released in the optimizer step, after its reduction
    and before the update (``ShardedAdamW.step``): in category ``comm``, the reduce-scatter's buffer from its
    birth."""

    name = "zero"
    steps_per_shard = True
    flat_buffers = True
    covered_rank = 0

    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """zeroexp.strategies._zero_checkpoint. ``full``: a save all-gathers each bucket's master and both
        moments (three fp32 tensors of its padded length, freed before the next bucket's) and rank 0 copies each
        parameter's part of them to the host, then a 4-byte step each and the module's frozen parameters and
        buffers; a load reads the file on every rank and lays each bucket out whole in three fp32 tensors (and the
        master's cast to the compute dtype below fp32, freed before the bucket's moments are copied) beside the
        moments' shards and the step it keeps of each bucket so far (a step on the device only where it is:
        checkpoint_peak.step_bytes). ``sharded`` (lower bounds: DCP's objects and its copy of each piece it writes,
        a view into a bucket's shard): a save sized as nothing; a load fills fresh moment shards and a step a
        parameter, then all-gathers each bucket's fp32 master whole (and casts it to the compute dtype) for the
        compute parameters, one bucket at a time."""
        n, b, cpu = groups.world_size, device.block, device.name == "cpu"
        step = step_bytes(device)
        cast = [counted(itemsize * sh.numel, b) if itemsize != MASTER_BYTES else 0 for sh in groups.shards]
        if kind == "sharded":  # DCP writes this rank's pieces of the shards where they lie; a load fills fresh moments
            moments = sum(2 * counted(MASTER_BYTES * sh.numel // n, b) for sh in groups.shards)
            steps = step * len(groups.numels)
            gather = max((counted(MASTER_BYTES * sh.numel, b) + c for sh, c in zip(groups.shards, cast)), default=0)
            return CheckpointPeaks(kind, phase([{"copied": 0}] * n, [False] * n, unsized=("dcp_objects", "dcp_copies")),
                                   phase([{"moments": moments, "steps": steps, "bucket_gathered": gather}] * n,
                                         [False] * n, unsized=("dcp_objects",)))
        gathered = [3 * counted(MASTER_BYTES * sh.numel, b) for sh in groups.shards]
        copies = [sum((MASTER_BYTES + MOMENT_BYTES) * (e - a) for a, e in sh.spans) for sh in groups.shards]
        steps = sum(STEP_BYTES * len(sh.spans) for sh in groups.shards)  # each parameter's, after the buckets
        kept = [2 * counted(MASTER_BYTES * sh.numel // n, b) + step for sh in groups.shards]
        # bucket k: its three fp32 tensors, the shards kept of the buckets before, then the cast (freed at once) or
        # its own shards' copies, whichever is larger
        load = max((g + sum(kept[:k]) + max(c, kept[k]) for k, (g, c) in enumerate(zip(gathered, cast))), default=0)
        gather = max(gathered, default=0)
        if cpu:
            rank0 = max([sum(copies[:k + 1]) + g for k, g in enumerate(gathered)]
                        + [sum(copies) + steps + state.frozen + state.buffers])
            save = phase([{"gathered_and_copies": rank0}] + [{"gathered": gather}] * (n - 1), [True] * n)
        else:
            save = phase([{"gathered": gather}] * n, [True] * n, [full_file] + [0] * (n - 1))
        terms = {"file": full_file if cpu else 0, "buckets_laid_out": load}
        return CheckpointPeaks(kind, save, phase([terms] * n, [True] * n, None if cpu else [full_file] * n))

    def groups_kind(self, row):
        return "buckets"

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        numels, shards = shape.numels, []
        for bucket in cut_buckets([k * itemsize for k in numels], knobs.bucket_cap_bytes):
            spans, length = pack([numels[i] for i in bucket])
            shards.append(Shard(spans, padded_numel(length, n)))
        return Cut(shards=shards)

    def collective_slots(self, row, groups, prefetch, f, b, o, knobs):
        end_b = f + b
        c, psi = cumulative([sum(e - a for a, e in sh.spans) for sh in groups.shards]), max(groups.numel, 1)
        several = len(groups.shards) > 1  # every bucket's all_gather issued async after the step
        slots = [Slot("all_gather", sh.numel, 0.0, f * c[i] / psi, burst=several) for i, sh in enumerate(groups.shards)]
        for op in ("reduce_scatter", "all_reduce"):
            slots += [Slot(op, sh.numel, f + b * (psi - c[i]) / psi, end_b) for i, sh in enumerate(groups.shards)]
        return slots, "reduce hooks overlap backward; all_gather waited in forward pre-hooks"

    def framework_terms(self, row, groups, itemsize, cost, orig_params, terms, notes):
        if not groups.shards:
            return super().framework_terms(row, groups, itemsize, cost, orig_params, terms, notes)
        b = 0.0
        if "grad" in row.sharded:  # ZeRO-2: the bucket's flat gradient is zeroed anew and accumulated into
            terms["bucket_copies"] = 2 * sum(sh.numel for sh in groups.shards) * itemsize * cost.copy_s_per_byte
            b += terms["bucket_copies"]
        notes.append("zeroexp's ZeRO-1/2 hooks per bucket: no per-call cost calibrated")
        return 0.0, b, 0.0

    # --- the peak model: the ``in_place`` and ``bucket`` flows ---------------------------------------------------
    def _opens_buckets(self, row: StateLayout) -> bool:
        return "grad" in row.sharded  # ZeRO-2

    def flow(self, row):
        return "bucket" if self._opens_buckets(row) else "in_place"

    def accumulates(self, row):
        return True

    def accumulated_grad_bytes(self, row, grad_bytes):
        return 0  # ZeRO-1 holds its buffers at K=1 too; ZeRO-2 keeps only its gradient shard (steady)

    def precision_terms(self, row, precision, param_dtype, compute_itemsize):
        """Compute-dtype buckets, fp32 master shards (``ShardedAdamW.step``: each reduced shard up-cast to an fp32
        master gradient, each master cast into the all-gather's input)."""
        return FP32_TERMS if precision == "fp32" else PrecisionTerms(None, param_dtype, compute_itemsize, True)

    def needs_in_place(self, row, micro_batches):
        return True  # the gradients live across the step

    def trace_options(self, row):
        # a bucket is born at its first gradient: segmented at every module holding parameters, a segment opens one
        return {"own_params_units": self._opens_buckets(row), "root_unit": False, "converts_module": False,
                "tensor_bytes": False}

    def shape_limits(self, row, shape):
        if self._opens_buckets(row) and shape.exact and len(shape.modules) == 1:
            return [], [], ["no peak model yet for zeroexp's ZeRO-2 on a model whose parameters are one module's: its "
                    "bucket opens and fills within the one traced backward segment; state, collectives and groups "
                    "are checked"]
        return [], [], []

    def phase_peaks(self, row, groups, shape, trace, itemsize, *, rank, prefetch, gloo, micro_batches, in_place,
                    bucket_cap_bytes, terms, reduce, root_kept, foreach, knobs, block):
        """One flat bucket per shard; backward fills the last-defined bucket first; below fp32 the up-casts and
        all-gather inputs (:mod:`zeroexp.formulas.peak.precision`); on gloo a reduce_scatter's wait hands back a
        reduced copy of the bucket (``reduce``: ``strategy.reduce``)."""
        terms = terms or FP32_TERMS
        g, n = terms.grad_itemsize, groups.world_size
        shards = tuple(s.numel // n for s in groups.shards)
        order = tuple(reversed(groups.shards))
        # where each bucket opens, in the trace's bytes (each parameter's gradient its own allocation): in blocks,
        # the gradients of the buckets before it; tensor bytes (the CPU's), the buckets before it
        grads = [counted_sum(((b - a) * g for a, b in s.spans), block) for s in order]
        edges = tuple(sum(grads[:i]) for i in range(len(order) + 1)) if block > 1 else None
        return accumulated_phase_peaks(
            trace, micro_batches, live_grads=True, open_buckets=self._opens_buckets(row), in_place=in_place,
            steady_grad_bytes=0, buckets=tuple(counted(s.numel * g, block) for s in order), bucket_edges=edges,
            optimizer_numels=shards, **{**ADAMW, "foreach": foreach, "block": block},
            master_grads=master_upcast_bytes(shards, terms, block),
            gather_inputs=gather_input_bytes(shards, terms, itemsize, block),
            reduce_copies=gloo and reduce == "reduce_scatter")

    def steady_buffers(self, row, groups, itemsize, bucket_cap_bytes, terms):
        """Below fp32 the all-gather inputs (the phases' figures are less them)."""
        if terms is None:
            return 0
        return gather_input_bytes(tuple(s.numel // groups.world_size for s in groups.shards), terms, itemsize)

    def late_free(self, row, groups, itemsize, micro_batches, bucket_cap_bytes=0):
        """Below fp32, in forward a bucket's all-gather input, which the next forward drops when it waits for the
        bucket; the optimizer step: the reduced copy of a bucket gloo's reduce_scatter hands back at its wait (the
        model counts it at the wait), held on by gloo's work; with ``micro_batches`` > 1 ZeRO-2's in backward (a
        micro-batch's reduce waited at its end: not modelled)."""
        if not groups.shards:
            return {}
        late = {"forward": [(f"bucket {k}'s all-gather input (its fp32 master shard cast to the compute dtype)",
                             s.numel // groups.world_size * itemsize) for k, s in enumerate(groups.shards)
                            if itemsize < 4]}  # fp32: the master itself, no tensor of the all-gather's own
        # the reduced copy of a bucket gloo's reduce_scatter hands back at its wait (modelled at the wait) goes with
        # gloo's work object, which gloo's worker thread may still hold through AdamW's update
        late["optimizer"] = [(f"bucket {k}'s copy gloo's reduce_scatter made of its full gradient",
                              s.numel * itemsize) for k, s in enumerate(groups.shards)]
        # each micro-batch's reduce waited at its end (accumulating()):
        if self._opens_buckets(row) and micro_batches > 1:
            late["backward"] = [(f"bucket {k}'s copy gloo's reduce_scatter hands back at a micro-batch's end",
                                 s.numel * itemsize) for k, s in enumerate(groups.shards)]  # not modelled there
        return {ph: v for ph, v in late.items() if v}

    def init_peak_bytes(self, shape, init, world_size, itemsize, use_orig_params):
        return replica_init_peak_bytes(shape, init, itemsize)


ZERO = ZeroBuckets()

ROWS = {
    "zero1": StateLayout("zeroexp ZeRO-1", 1, frozenset({"optim"}), "always", ZERO, scatter_gather, precisions=MIXED,
                         casts_buffers=True, source="zeroexp.strategies.sharding", init_modelled=True),
    "zero2": StateLayout("zeroexp ZeRO-2", 2, frozenset({"optim", "grad"}), "always", ZERO,
                         scatter_gather_each_micro_batch, precisions=MIXED, casts_buffers=True,
                         source="zeroexp.strategies.sharding", init_modelled=True),
}
