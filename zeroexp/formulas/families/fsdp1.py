"""FSDP1's family: each wrap unit's parameters one FlatParameter, padded to N and sharded
(torch/distributed/fsdp/_flat_param.py); gathered before forward and backward, reduce-scattered after backward;
rows ``fsdp_grad_op`` (SHARD_GRAD_OP), ``fsdp_full`` (FULL_SHARD) and hybrid sharding's (``fsdp_HYBRID_SHARD``,
``fsdp__HYBRID_SHARD_ZERO2``: the same within a shard group, :mod:`zeroexp.formulas.hybrid`; the replicas'
all_reduce of each reduced gradient shard runs in place, ``_runtime_utils.py _reduce_grad``, so it adds no tensor)."""

from __future__ import annotations

from zeroexp.formulas.peak.accumulation import fsdp1_no_sync_phase_peaks
from zeroexp.formulas.peak.allocator import counted, counted_sum
from zeroexp.formulas.families._fsdp import FsdpFamily, gather_units, hybrid_units
from zeroexp.formulas.families.base import Cut
from zeroexp.formulas.families.ddp import MIXED
from zeroexp.formulas.init import fsdp1_init_peak_bytes
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, phase
from zeroexp.formulas.layout import MASTER_BYTES, StateLayout, local_numels_by_rank, pack
from zeroexp.formulas.orig_params import orig_param_views
from zeroexp.formulas.paper import padded_numel
from zeroexp.formulas.peak.phases import fsdp_phase_peaks, fsdp_sync_phase_peaks
from zeroexp.formulas.shapes import Shard

__all__ = ["Fsdp1Units", "FSDP1", "ROWS", "OS_G_P", "twice_unless_root", "packed_units"]

OS_G_P = frozenset({"optim", "grad", "param"})


def twice_unless_root(root: bool, knobs) -> int:
    return 1 if root else 2  # FSDP1 FULL_SHARD keeps the root unit after forward (_post_forward_reshard)


def packed_units(family, row, shape, n: int, knobs, align: int, narrow: int) -> list:
    """Each wrap unit of an exact ``shape`` as it is gathered: its parameters packed (each at a multiple of
    ``align``), padded to ``n`` (FSDP1's FlatParameter; the paper's stage 3 with ``align`` 0)."""
    numels, units = shape.numels, []
    for u, (unit, root) in enumerate(zip(shape.units, shape.root)):
        size = padded_numel(pack([numels[i] for i in unit], align)[1], n)
        reduced = size if any(shape.train(i) for i in unit) else 0
        if size:
            units.append(family.unit(size, row.gathers_per_unit(root, knobs), shape.calls(u), shape.backward(u),
                                     reduced, shape.next_reached(u), narrow=bool(narrow)))
    return units


class Fsdp1Units(FsdpFamily):
    """FSDP1: flat units; with ``use_orig_params`` (zeroexp's default) each parameter 16-byte aligned in its
    FlatParameter and AdamW stepping each original parameter's view (:mod:`zeroexp.formulas.orig_params`)."""

    name = "fsdp1"
    flat_buffers = True
    views_with_orig_params = True
    holds_kept_units = True

    def no_sync_checkpointing(self, row):
        return True  # the trace's segments checkpointed (recompute inside each unit's backward, gathered)

    def frozen_accumulation_limit(self, row):
        # measured (LoRA GPT, n_layer=2, n_embd=32, fp32, grad_accum=2, N=2 and 3, fsdp_grad_op and fsdp_full):
        # under no_sync each unit's held unsharded gradient is the FlatParameter's, its frozen views included
        # (118,016 B at N=2, where the trained parameters' are 29,440 B and the padded unit 128,512 B); under no_sync
        # and reducing every micro-batch alike, a later micro-batch's forward holds 16,380-17,412 B of activations more
        # than the traced step: unplaced
        return ("no peak model yet for FSDP1's accumulation with frozen parameters: a later micro-batch's forward "
                "holds more activations than the traced step, and under no_sync each unit's held gradient spans its "
                "FlatParameter's frozen views (measured on a LoRA GPT, fp32, grad_accum=2: forward 848,960 B where "
                "740,416 are predicted under no_sync, 789,952 where 772,544 reducing every micro-batch)")

    def sync_accumulation(self, row):
        return True  # fsdp_sync_phase_peaks, HSDP included (its all_reduce on the reduced shard, in place)

    def groups_kind(self, row):
        return "units"

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        numels, out = shape.numels, Cut()
        rest = 4 if row.fp32_at_rest else itemsize
        align = 16 // rest if knobs.use_orig_params else 0
        for u, unit in enumerate(shape.units):  # a unit forward never calls gets no gradient at all
            spans, length = pack([numels[i] for i in unit], align)
            if length:
                out.shards.append(Shard(spans, padded_numel(length, n)))
                trained = tuple(sp for sp, i in zip(spans, unit) if shape.train(i) and sp[1] > sp[0])
                if trained and shape.calls(u) and shape.backward(u):
                    out.grad_shards.append(Shard(trained, padded_numel(length, n)))
        out.units = packed_units(self, row, shape, n, knobs, align, narrow)
        return out

    def extra_groups(self, row, shape, full, cut):
        frozen = bool(full.frozen) or (shape.exact and len(cut.grad_shards) < len(cut.shards))
        return {"grad_shards": tuple(cut.grad_shards) if frozen else None}

    # --- time ---------------------------------------------------------------------------------------------------
    def follows_prefetch(self, row):
        return row.reshard_after_forward  # SHARD_GRAD_OP keeps its units into backward: nothing to prefetch

    def call_path(self, cost, orig_params, notes):
        if not orig_params:
            return "fsdp1_call"
        if cost.fsdp1_orig_call_s is None:
            notes.append("the calibration has no fsdp1_orig_call_s: FSDP1's calls with use_orig_params=true "
                         "timed at the flat parameters' cost; recalibrate (python -m zeroexp.calibrate) for it")
            return "fsdp1_call"
        return "fsdp1_orig_call"

    def backward_and_step_terms(self, groups, itemsize, cost, terms):
        terms["fsdp1_gradient_copies"] = 2 * sum(u.numel for u in groups.units) * itemsize * cost.copy_s_per_byte
        return terms["fsdp1_backward_calls"] + terms["fsdp1_gradient_copies"], 0.0

    # --- the peak model -----------------------------------------------------------------------------------------
    def unit_terms(self, row, unit, members, shape, n, itemsize, terms, block):
        return (counted(unit.numel // n * itemsize, block) if terms.module_dtype else 0), ()

    def unit_phase_peaks(self, row, groups, shape, trace, itemsize, held, *, rank, prefetch, gloo, micro_batches,
                         root_kept, knobs, block, foreach, in_place=None):
        """SHARD_GRAD_OP and FULL_SHARD, the root unit kept unsharded from forward into backward; ``grad_accum`` > 1
        reducing every micro-batch (``strategy.sync_each_microbatch``:
        :func:`zeroexp.formulas.peak.phases.fsdp_sync_phase_peaks`) or under ``no_sync``, hybrid sharding's within
        its shard group (:func:`zeroexp.formulas.peak.accumulation.fsdp1_no_sync_phase_peaks`)."""
        n, kept, adamw = groups.shard_over, held.adamw["optimizer_itemsize"], held.adamw
        shards = [u.scattered // n for u in groups.units]
        # what zero_grad frees between steps: each unit's gradient shard, one storage (the flat gradient)
        steady_grads = counted_sum((k * kept for k in shards), block)
        orig = knobs.use_orig_params  # zeroexp.formulas.orig_params
        # AdamW's tensors in the optimizer's order: each FlatParameter, the root's first; with use_orig_params each
        # original parameter's view of this rank's shard, in the model's order
        stepped = (orig_param_views(groups, shape, held.members, rank % n) if orig
                   else tuple(shards[-1:] + shards[:-1]))
        full_shard = row.reshard_after_forward and not held.alone
        common = dict(root=held.root, steady_grad_bytes=steady_grads, reshard_after_forward=full_shard,
                      prefetch=prefetch if full_shard else "none", gloo=gloo, optimizer_numels=stepped,
                      grads_held_into_backward=orig, **adamw)
        if micro_batches > 1 and knobs.sync_each_microbatch:
            return fsdp_sync_phase_peaks(trace, held.units, **common)
        if micro_batches > 1:
            if not row.no_sync_accumulation:
                raise ValueError(f"no accumulation model for {row.label} (plan.memory.uncovered names it)")
            return fsdp1_no_sync_phase_peaks(trace, held.units, held.flat_grads, micro_batches=micro_batches,
                                             root_grads=held.root_flat, **common)
        return fsdp_phase_peaks(trace, held.units, **common)

    def init_peak_bytes(self, shape, init, world_size, itemsize, use_orig_params):
        return fsdp1_init_peak_bytes(shape, init, world_size, itemsize, use_orig_params)


    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """zeroexp.strategies.fsdp: a full save (``FULL_STATE_DICT``, rank 0 only) unshards each unit and rank 0
        keeps every parameter and moment whole (a lower bound: FSDP1's gathering of the flat moments is not sized;
        a rank that keeps nothing holds at least one unsharded unit); a full load reads the file on every rank and
        keeps the moments of the rank's flat shards, the real elements of them (``optim_state_dict_to_load``; a lower
        bound where a unit holds frozen parameters: measured above it, not sized); a
        sharded save copies no state on its own (its optimizer state dict all-gathers: not sized); a sharded load at
        least the zero step's gradients and moments over the rank's elements (checkpoint_peak.zero_step)."""
        n, world, cpu, b = groups.shard_over, groups.world_size, device.name == "cpu", device.block
        unit = max((counted(MASTER_BYTES * sh.numel, b) for sh in groups.shards), default=0)
        by_rank = local_numels_by_rank(groups.trained_shards, n)
        logical = [sum(by_rank[r % n]) for r in range(world)]
        if kind == "full":
            save = phase([{"kept": full_file if cpu else unit}] + [{"one_unit": unit}] * (world - 1), [False] * world,
                         None if cpu else [full_file] + [0] * (world - 1), unsized=("flat_state", "gather_transients"))
            whole = not sum(groups.frozen)  # a unit with frozen parameters: FSDP1 flattens their moments apart
            load = phase([{"file": full_file if cpu else 0, "moments": 2 * counted(MASTER_BYTES * k, b)}
                          for k in logical], [whole] * world, None if cpu else [full_file] * world,
                         unsized=() if whole else ("flat_state",))
            return CheckpointPeaks(kind, save, load)
        save = phase([{"copied": 0}] * world, [False] * world, unsized=("flat_state", "dcp_objects"))
        load = phase([{"grads": counted(MASTER_BYTES * k, b), "moments": 2 * counted(MASTER_BYTES * k, b)}
                      for k in logical], [False] * world, unsized=("flat_state", "dcp_objects"))
        return CheckpointPeaks(kind, save, load)


FSDP1 = Fsdp1Units()

ROWS = {
    "fsdp_grad_op": StateLayout("FSDP SHARD_GRAD_OP", 2, OS_G_P, "never", FSDP1, gather_units(kept_under_no_sync=True),
                                "all", fp32_at_rest=True, precisions=MIXED, casts_buffers=True,
                                source="zeroexp.strategies.fsdp; [FSDP]", no_sync_accumulation=True,
                                init_modelled=True, min_world_size=2),
    "fsdp_full": StateLayout("FSDP FULL_SHARD", 3, OS_G_P, "never", FSDP1, gather_units(), "largest",
                             fp32_at_rest=True, precisions=MIXED, gathers_per_unit=twice_unless_root,
                             casts_buffers=True, source="zeroexp.strategies.fsdp; [FSDP]", reshard_after_forward=True,
                             init_modelled=True, min_world_size=2, no_sync_accumulation=True),
    # hybrid sharding: FULL_SHARD (SHARD_GRAD_OP for _HYBRID_SHARD_ZERO2) within shard_size ranks, replicated across
    "fsdp__HYBRID_SHARD_ZERO2": StateLayout("FSDP _HYBRID_SHARD_ZERO2", 2, OS_G_P, "never", FSDP1,
                                            hybrid_units(kept_under_no_sync=True), "all", fp32_at_rest=True,
                                            precisions=MIXED, hybrid=True, casts_buffers=True,
                                            source="zeroexp.strategies.fsdp_hybrid; [FSDP]; zeroexp.formulas.hybrid",
                                            min_world_size=2, no_sync_accumulation=True),
    "fsdp_HYBRID_SHARD": StateLayout("FSDP HYBRID_SHARD", 3, OS_G_P, "never", FSDP1, hybrid_units(), "largest",
                                     fp32_at_rest=True, precisions=MIXED, gathers_per_unit=twice_unless_root,
                                     hybrid=True, casts_buffers=True, reshard_after_forward=True,
                                     source="zeroexp.strategies.fsdp_hybrid; [FSDP]; zeroexp.formulas.hybrid",
                                     min_world_size=2, no_sync_accumulation=True),
}
