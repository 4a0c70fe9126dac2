"""FSDP2's family: each parameter a DTensor chunked on dim 0 over the mesh, its chunks padded to the first's
(torch/distributed/fsdp/_fully_shard/_fsdp_param.py); a unit's parameters gathered and reduce-scattered together
(_fsdp_collectives.py); rows ``fsdp2_grad_op``, ``fsdp2_full`` and ``fsdp2_hybrid`` (HSDP)."""

from __future__ import annotations

import math

from zeroexp.formulas.peak.allocator import counted, counted_sum
from zeroexp.formulas.families._fsdp import FsdpFamily, gather_units, hybrid_units
from zeroexp.formulas.families.base import Cut
from zeroexp.formulas.families.ddp import MIXED
from zeroexp.formulas.families.fsdp1 import OS_G_P
from zeroexp.formulas.init import fsdp2_init_peak_bytes
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, full_load, phase, zero_step
from zeroexp.formulas.layout import MASTER_BYTES, StateLayout, local_numels, local_numels_by_rank
from zeroexp.formulas.paper import fsdp2_padded_numel
from zeroexp.formulas.peak.fsdp2 import fsdp2_no_sync_phase_peaks, fsdp2_sync_phase_peaks, fsdp2_phase_peaks
from zeroexp.formulas.shapes import Shard, Unit

__all__ = ["Fsdp2Rows", "FSDP2", "ROWS"]

#: FSDP2's CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state on the host (no
#: optimizer-only offload in FSDP2)
OFFLOADS = frozenset({"none", "full"})


def kept_after_forward(knobs, root: bool, last: bool = False) -> bool:
    """Whether FSDP2 keeps a unit unsharded from its forward to its backward under a resharding row's knobs: the root
    where ``reshard_after_forward=None`` (its default) or the policy keeps it; under ``strategy.reshard_policy``
    (torchtitan's, zeroexp.cell.strategy.RESHARD_POLICIES) ``never`` every unit, ``default`` the ``last`` (the last
    unit in forward order, outside the root)."""
    policy = knobs.reshard_policy
    return policy == "never" or (knobs.root_kept_after_forward if root else last and policy == "default")


def _twice(root: bool, knobs, last: bool = False) -> int:
    # FSDP2 reshard_after_forward=True passed explicitly: the root too; None (its default) keeps the root; a unit kept
    # after forward is gathered once
    return 1 if kept_after_forward(knobs, root, last) else 2


def _once(root: bool, knobs, last: bool = False) -> int:
    return 1  # FSDP2 reshard_after_forward=False: every unit kept after forward, gathered once


def _twice_hybrid(root: bool, knobs, last: bool = False) -> int:
    # FSDP2 HSDP passes reshard_after_forward=True: the root too, whatever the planner's fsdp2_full knob; a
    # strategy.reshard_policy sets it per unit, as under fsdp2_full
    return 1 if knobs.reshard_policy and kept_after_forward(knobs, root, last) else 2


class Fsdp2Rows(FsdpFamily):
    """FSDP2: per-parameter rows; a parameter's gradient is its own, none for one a step does not use; the
    optimizer steps each DTensor's local rows."""

    name = "fsdp2"
    dtensor_params = True
    covered_rank = 2

    def groups_kind(self, row):
        return "rows"

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        numels, out = shape.numels, Cut()
        out.shards = [Shard(((0, k),), fsdp2_padded_numel(s, n)) for s, k in zip(shape.params, numels) if k]
        out.grad_shards = [Shard(((0, k),), fsdp2_padded_numel(s, n)) for i, (s, k) in
                           enumerate(zip(shape.params, numels)) if k and shape.train(i) and i not in shape.unused]
        last = max((u for u, root in enumerate(shape.root) if not root), default=-1)  # the last unit in forward
        for u, (unit, root) in enumerate(zip(shape.units, shape.root)):  # each unit as it is gathered
            size = sum(fsdp2_padded_numel(shape.params[i], n) for i in unit)
            reduced = sum(fsdp2_padded_numel(shape.params[i], n) for i in unit
                          if shape.train(i) and i not in shape.unused)
            if size:
                out.units.append(self.unit(size, row.gathers_per_unit(root, knobs, u == last), shape.calls(u),
                                           shape.backward(u), reduced, shape.next_reached(u), narrow=bool(narrow)))
        return out

    def state_note(self, row, shape, n):
        """Parameters whose dim 0 is short of N (a fused-experts tensor's expert dimension): FSDP2 pads each to N
        rows, so a rank's share of them stops shrinking at N = dim 0; named when the padding adds 10 % or more to
        what the row's parameters would hold unpadded."""
        if not shape.exact:
            return None
        short = [s for s in shape.params if s and s[0] < n]
        padded = sum(fsdp2_padded_numel(s, n) for s in short)
        numel = sum(math.prod(s) for s in short)
        if not short or padded - numel < 0.1 * shape.numel:
            return None
        dims = sorted({s[0] for s in short})
        return (f"FSDP2 chunks each parameter on dim 0: {len(short)} of {len(shape.params)} parameters have dim 0 < "
                f"N={n} ({', '.join(map(str, dims[:4]))}{', ...' if len(dims) > 4 else ''}), each padded to N rows: "
                f"{padded / max(numel, 1):.1f}x their elements; all parameters: {padded + shape.numel - numel:,} "
                f"elements across the N ranks against {shape.numel:,} unpadded, so a rank's share of them stops "
                f"shrinking at N = dim 0 [torch _fsdp_param.py]")

    def extra_groups(self, row, shape, full, cut):
        ungraded = bool(shape.unused)
        out = {"grad_shards": tuple(cut.grad_shards) if bool(full.frozen) or ungraded else None}
        if ungraded:  # indices among the trainable parameters
            idx = [i for i in range(len(shape.numels)) if shape.train(i)]
            out["ungraded"] = tuple(idx.index(i) for i in shape.unused)
        return out

    def unit(self, numel, gathers, calls=1, reached=True, reduced=None, next_reached=True, narrow=False):
        """FSDP2's hooks: each forward call's part of backward gathers a resharded unit again (its post-backward
        reshards after each part; a unit kept after forward: each part but the first); a unit backward never reaches
        is still gathered when the unit after it in forward order is reached (``next_reached``: FSDP2's implicit
        backward prefetch), and resharded at the end of backward. ``narrow`` (``reshard_after_forward=k``): a
        resharded unit keeps its post-forward shard after each forward call, so each further forward call and the
        first gather of its backward (its own or the implicit prefetch) run over the post-forward group
        (``Unit.post_forward``); its first forward call's gather, from the full shard, and those after a
        post-backward reshard (``_to_sharded``: the whole shard group again) run over the shard group
        (_fsdp_param_group.py ``_all_gather_process_group``)."""
        resharded, reached = gathers >= 2, reached and calls > 0
        if resharded:
            again = calls if reached else min(calls, 1) if next_reached else 0
        else:  # kept after forward: gathered again for each earlier call's part, after a reshard
            again = max(calls - 1, 0) if reached else 0
        total = (calls if resharded else min(calls, 1)) + again
        scattered = (numel if reduced is None else reduced) if reached else 0
        narrowed = max(calls - 1, 0) + min(again, 1) if narrow and resharded else 0
        return Unit(numel, total, None if scattered == numel else scattered, False, narrowed)

    # --- time ---------------------------------------------------------------------------------------------------
    def slot_rule(self, row, prefetch, knobs):
        # FSDP2's explicit prefetch; its own default is one unit
        fwd, bwd = (max(k, 1) for k in (knobs.forward_prefetch, knobs.backward_prefetch))
        return "pre", fwd, bwd

    def backward_and_step_terms(self, groups, itemsize, cost, terms):
        terms["dtensor_optimizer_step"] = len(groups.trained_shards) * cost.dtensor_param_step_s
        return terms["fsdp2_backward_calls"], terms["dtensor_optimizer_step"]

    # --- the peak model -----------------------------------------------------------------------------------------
    def reduce_itemsize(self, knobs, itemsize):
        return knobs.reduce_itemsize(itemsize)  # FSDP2's reduce_dtype (FSDP1 reduces in the compute dtype)

    def unit_terms(self, row, unit, members, shape, n, itemsize, terms, block):
        return 0, tuple(counted(fsdp2_padded_numel(shape.params[i], n) * itemsize, block) for i in members)

    def unit_phase_peaks(self, row, groups, shape, trace, itemsize, held, *, rank, prefetch, gloo, micro_batches,
                         root_kept, knobs, block, foreach, in_place=None):
        """AdamW steps each parameter's local rows, in definition order; the root kept unsharded from forward to
        backward where ``root_kept`` (``PlanKnobs.root_kept_after_forward``)."""
        n, kept, alone = groups.shard_over, held.adamw["optimizer_itemsize"], held.alone
        each = micro_batches > 1 and knobs.sync_each_microbatch
        if micro_batches > 1 and not each and (not row.no_sync_accumulation or in_place is None):
            raise ValueError(f"no accumulation model for {row.label} (plan.memory.uncovered names it)")
        # what zero_grad frees between steps: each unit's reduce-scatter output, of which each parameter's sharded
        # gradient is a view
        steady_grads = counted_sum((u.scattered // n * kept for u in groups.units), block)
        # each unit's kept after forward: gathered once (strategy.reshard_policy: per unit), in held.units' order
        sized = [root for unit, root in zip(shape.units, shape.root) if sum(shape.numels[i] for i in unit)]
        kept_units = tuple(u.gathers < 2 for u, root in zip(groups.units, sized) if alone or not root)
        terms = dict(units=held.units, root=held.root, steady_grad_bytes=steady_grads, gloo=gloo,
                     optimizer_numels=local_numels(groups.trained_shards, n, rank % n), **held.adamw,
                     kept_units=kept_units if knobs.reshard_policy else None,
                     reshard_after_forward=row.reshard_after_forward and not (alone and root_kept),
                     one_unit=alone, root_kept=root_kept and not alone,
                     ahead=(knobs.forward_prefetch, knobs.backward_prefetch),
                     post_forward=groups.post_forward_size, root_params=held.root_params,
                     all_reduce_held=row.hybrid)
        if each:
            return fsdp2_sync_phase_peaks(trace, **terms)
        if micro_batches > 1:
            return fsdp2_no_sync_phase_peaks(trace, in_place, micro_batches,
                                             held.root_grads + sum(u.grads for u in held.units), **terms)
        return fsdp2_phase_peaks(trace, **terms)

    def needs_in_place(self, row, micro_batches):
        return micro_batches > 1 and row.no_sync_accumulation

    def no_sync_checkpointing(self, row):
        return True  # the steps traced checkpointed, with and without the gradients allocated

    def sync_accumulation(self, row):
        return True  # fsdp2_sync_phase_peaks, HSDP's all-reduce buffers held to backward's end included

    def accumulation_limit(self, row, reduce_dtype, param_dtype):
        if reduce_dtype is not None and reduce_dtype != param_dtype:
            return (f"no peak model yet for FSDP2's grad_accum with strategy.reduce_dtype={reduce_dtype} (compute "
                    f"{param_dtype}): its no_sync keeps each unsharded gradient's copy in the reduce dtype "
                    "(unsharded_accumulated_grad)")
        return None

    def forward_late_free(self, sizes):
        # FSDP2 copies each shard into a fresh all-gather input (FSDP1 sends its shard)
        return {"forward": [("one unit's all-gather input (a shard copied in) or output", b) for b in sizes]}

    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """Each state-dict entry a DTensor of dim-0 chunks padded to the shard group (every name of a tied parameter
        its own entry). A full save gathers each whole on every rank (padded, then a view of it), rank 0 keeping it
        (and zeroexp copying each view compact, zeroexp.strategies._checkpoint.compact), on an accelerator to the
        host; a sharded save copies nothing. A full load makes each rank's padded chunk of every entry
        (``distribute_tensor``); every load steps once at zero over the rank's rows (checkpoint_peak.zero_step).
        A full load is exact only where every parameter's rows divide over the shard group: where one does not, the
        cells measured one padded chunk more than these terms (a 64-row embedding at N=3: 0.5 % of the load; a
        4-channel convolution at N=3: 3.4 %), an allocation not found yet, so the figure is a lower bound there."""
        if not shape.exact:
            return None
        n, world, cpu, b = groups.shard_over, groups.world_size, device.name == "cpu", device.block
        names = dict(shape.aliases)
        entries = []  # (padded numel, numel, bytes per element) of each state-dict entry the DTensors hold
        for i, s in enumerate(shape.params):
            each = MASTER_BYTES if shape.train(i) else row.at_rest_bytes(itemsize)
            entries += [(fsdp2_padded_numel(s, n), math.prod(s), each)] * (1 + names.get(i, 0))
            if shape.train(i) and i not in shape.unused:
                entries += [(fsdp2_padded_numel(s, n), math.prod(s), MASTER_BYTES)] * 2
        gathered = [counted(p * e, b) for p, _, e in entries if p]
        largest = max(gathered, default=0)
        if kind == "full":
            compact = counted_sum((k * e for p, k, e in entries if p != k), b)
            keep = {"gathered": sum(gathered), "compact_copies": compact} if cpu else {"gathered_one": largest}
            rest = {"gathered_one": largest}
            save = phase([keep] + [rest] * (world - 1), [cpu] + [False] * (world - 1),
                         None if cpu else [full_file] + [0] * (world - 1), unsized=("gather_transients",))
        else:
            save = phase([{"copied": 0}] * world, [False] * world, unsized=("dcp_objects",))
        loads, hosts = [], []
        model = [(i, s) for i, s in enumerate(shape.params) for _ in range(1 + names.get(i, 0))]
        made = counted_sum((fsdp2_padded_numel(s, n) // n * (MASTER_BYTES if shape.train(i) else
                            row.at_rest_bytes(itemsize)) for i, s in model), b)
        moments_in = 2 * counted_sum((fsdp2_padded_numel(s, n) // n * MASTER_BYTES for i, s in enumerate(shape.params)
                                      if shape.train(i) and i not in shape.unused), b)
        # the zero step gives every trainable parameter state, one no step graded too
        trainable = tuple(Shard(((0, k),), fsdp2_padded_numel(s, n)) for i, (s, k) in
                          enumerate(zip(shape.params, shape.numels)) if k and shape.train(i))
        by_rank = local_numels_by_rank(trainable, n)
        for r in range(world):
            zs = zero_step(by_rank[r % n], device)  # remembered: ranks alike computed once
            if kind == "full":
                loads.append(full_load(full_file if cpu else 0, made + (0 if cpu else state.buffers), zs, moments_in))
                hosts.append(full_file)
            else:
                loads.append(zs.terms())
        full = kind == "full"
        even = all(fsdp2_padded_numel(s, n) == math.prod(s) for s in shape.params)
        return CheckpointPeaks(kind, save, phase(loads, [full and even] * world, hosts if full and not cpu else None,
                                                 unsized=("uneven_chunk",) * (not even) if full else ("dcp_objects",)))

    def init_peak_bytes(self, shape, init, world_size, itemsize, use_orig_params):
        return fsdp2_init_peak_bytes(shape, init, world_size, itemsize)


FSDP2 = Fsdp2Rows()

ROWS = {
    "fsdp2_grad_op": StateLayout("FSDP2 reshard_after_forward=False", 2, OS_G_P, "never", FSDP2,
                                 gather_units(dtensor_grads=True), "all", fp32_at_rest=True, padded_moments=False,
                                 precisions=MIXED, offloads=OFFLOADS, gathers_per_unit=_once,
                                 source="zeroexp.strategies.fsdp2; [FSDP2]", no_sync_accumulation=True,
                                 init_modelled=True, min_world_size=2),
    "fsdp2_full": StateLayout("FSDP2 reshard_after_forward=True", 3, OS_G_P, "never", FSDP2,
                              gather_units(dtensor_grads=True), "largest", fp32_at_rest=True, padded_moments=False,
                              precisions=MIXED, offloads=OFFLOADS, gathers_per_unit=_twice, post_forward_group=True,
                              source="zeroexp.strategies.fsdp2; [FSDP2]", reshard_after_forward=True,
                              init_modelled=True, min_world_size=2, no_sync_accumulation=True),
    "fsdp2_hybrid": StateLayout("FSDP2 HSDP reshard_after_forward=True", 3, OS_G_P, "never", FSDP2,
                                hybrid_units(dtensor_grads=True), "largest", fp32_at_rest=True, padded_moments=False,
                                precisions=MIXED, offloads=OFFLOADS, gathers_per_unit=_twice_hybrid, hybrid=True,
                                source="zeroexp.strategies.fsdp2_hybrid; [FSDP2]; zeroexp.formulas.hybrid",
                                reshard_after_forward=True, min_world_size=2, no_sync_accumulation=True),
}
