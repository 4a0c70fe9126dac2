"""DDP's family: replicated state, gradient buckets all-reduced in backward (torch/nn/parallel/distributed.py,
torch/csrc/distributed/c10d/reducer.cpp), new gradients each step (``zero_grad(set_to_none=True)``); its row ``ddp``.
ZeroRedundancyOptimizer on DDP (:mod:`zeroexp.formulas.families.zro`) is this family with owners."""

from __future__ import annotations

from typing import Any

from zeroexp.formulas.peak.accumulation import accumulated_grad_bytes, accumulated_phase_peaks
from zeroexp.formulas.peak.allocator import counted_sum
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, full_load, phase, zero_step
from zeroexp.formulas.families.base import Family
from zeroexp.formulas.init import replica_init_peak_bytes
from zeroexp.formulas.layout import ModelShape, PlanKnobs, StateLayout, cut_buckets
from zeroexp.formulas.paper import Collectives, collectives_of
from zeroexp.formulas.time.overlap import Slot, cumulative
from zeroexp.formulas.peak.precision import FP32_TERMS, PrecisionTerms
from zeroexp.formulas.shapes import Groups

__all__ = ["DdpBuckets", "DDP", "ROWS", "MIXED", "ddp_buckets", "buffer_broadcasts", "ddp_unused",
           "ddp_bucket_slots", "ddp_bucket_terms", "BUFFER_BROADCAST_CAP", "all_reduce_buckets"]

#: The precisions every runtime row trains in.
MIXED = frozenset({"fp32", "bf16", "fp16"})
#: The optimizer every covered row steps: torch's AdamW over fp32 state, single-tensor (torch's default on CPU; a
#: CUDA rank's foreach: zeroexp.formulas.device).
ADAMW = {"optimizer_itemsize": 4, "foreach": False}


def ddp_buckets(shape: ModelShape, knobs: PlanKnobs) -> tuple[tuple[int, ...], ...]:
    """DDP's steady gradient buckets, each its parameters' numels: the parameters in gradient-ready order (the first
    backward's, which ``Reducer::rebuild_buckets`` keeps; with ``find_unused_parameters`` the reducer rebuilds none,
    ``should_rebuild_buckets``, so DDP's first assignment stays: cut in definition order, the buckets reversed,
    each in definition order), a bucket closed once it holds ``bucket_cap_mb``
    or more (``compute_bucket_assignment_by_size``; zeroexp passes the cap explicitly, so it holds for the first
    bucket too). One dtype assumed (fp32 at rest, also under autocast)."""
    numels = shape.numels
    if _finds_unused(shape, knobs):  # DDP's first assignment: cut in definition order, the list of buckets reversed
        cut = cut_buckets([k * 4 for k in numels], knobs.bucket_cap_bytes, "reach")
        return tuple(tuple(numels[i] for i in b) for b in reversed(cut))
    order = shape.ready_order
    buckets = cut_buckets([numels[i] * 4 for i in order], knobs.bucket_cap_bytes, "reach")
    return tuple(tuple(numels[order[j]] for j in b) for b in buckets)


#: DDP's ``broadcast_bucket_size``: the buffers' coalesced broadcasts are cut at 250 MiB (torch's DDP default).
BUFFER_BROADCAST_CAP = 250 * 2**20


def buffer_broadcasts(buffers: tuple[tuple[str, int], ...], cap: int = BUFFER_BROADCAST_CAP) -> tuple[int, ...]:
    """Bytes of each broadcast DDP's ``broadcast_buffers`` issues per step (``_sync_module_buffers`` ->
    ``dist._broadcast_coalesced``): the buffers grouped by dtype, in first-seen order, each group flattened into
    broadcasts of at most ``cap`` bytes (a tensor above it alone). Once per step: DDP syncs before a forward that
    follows a synchronised backward, so under ``no_sync`` accumulation too."""
    by_dtype: dict[str, list[int]] = {}
    for dtype, nbytes in buffers:
        by_dtype.setdefault(dtype, []).append(nbytes)
    return tuple(sum(sizes[i] for i in b) for sizes in by_dtype.values() for b in cut_buckets(sizes, cap))


def ddp_unused(shape: ModelShape, knobs: PlanKnobs) -> dict:
    """DDP with parameters a step gives no gradient: they keep no gradient (``.grad`` stays None) and so no optimizer
    state; ``find_unused_parameters`` (set when there are such parameters, unless given) adds one all_reduce of the
    reducer's used-parameter map, an int32 per trainable parameter (``Reducer::all_reduce_local_used_map``)."""
    find = _finds_unused(shape, knobs)
    return {"ungraded": shape.unused, "used_map_bytes": 4 * len(shape.numels) if find and shape.exact else 0}


def _finds_unused(shape: ModelShape, knobs: PlanKnobs) -> bool:
    """DDP's ``find_unused_parameters``: as given, else whether a traced step leaves a parameter ungraded."""
    return knobs.find_unused_parameters if knobs.find_unused_parameters is not None else bool(shape.unused)


def _ddp_comm(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    return {"buckets": ddp_buckets(shape, knobs), "buffer_broadcasts": buffer_broadcasts(shape.buffers),
            **ddp_unused(shape, knobs)}


def ddp_bucket_slots(groups: Groups, f: float, b: float, o: float) -> tuple[list[Slot], str]:
    """DDP's buckets all-reduced as backward fills them, each waited for at backward's end; ZeroRedundancyOptimizer's
    broadcasts after the step (issued async together, then waited)."""
    end_b, end = f + b, f + b + o
    c = cumulative([sum(k) for k in groups.buckets])
    slots = [Slot("all_reduce", sum(k), f + b * c[i + 1] / c[-1], end_b) for i, k in enumerate(groups.buckets)]
    several = len(groups.broadcasts) > 1  # ZeroRedundancyOptimizer issues them all async, then waits
    slots += [Slot("broadcast", k, end, end, burst=several) for k in groups.broadcasts]
    return slots, "DDP buckets overlap backward except the last" + (
        "; broadcasts after the step" if groups.broadcasts else "")


def ddp_bucket_terms(groups: Groups, itemsize: int, cost: Any, terms: dict[str, float]) -> tuple[float, float]:
    """DDP's bucket calls in backward, ZeroRedundancyOptimizer's broadcasts after the step: (backward, optimizer)
    seconds, each term added to ``terms``."""
    b = o = 0.0
    terms["ddp_bucket_calls"] = sum(cost.call_s("ddp_bucket", sum(k) * itemsize) for k in groups.buckets)
    b += terms["ddp_bucket_calls"]
    if groups.broadcasts:
        terms["zro_broadcast_calls"] = sum(cost.call_s("zro_broadcast", k * itemsize) for k in groups.broadcasts)
        o += terms["zro_broadcast_calls"]
    return b, o


def all_reduce_buckets(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
    """ZeRO-0 [ZeRO 7.1]: one gradient all_reduce per bucket; S totals P. DDP broadcasts the module's buffers from
    rank 0 before forward (``buffer_broadcasts``, bytes as they are) and, with ``find_unused_parameters``,
    all-reduces its map of the parameters used (``used_map_bytes``)."""
    return collectives_of(all_reduce=[sum(b) * c for b in g.buckets] + ([g.used_map_bytes] if g.used_map_bytes else []),
                          broadcast=list(g.buffer_broadcasts))


class DdpBuckets(Family):
    """DDP: every rank holds the whole state; gradients all-reduced in buckets; each step's gradients new."""

    name = "ddp"
    covered_rank = 0

    def pads_count(self, row):
        return False

    def groups_kind(self, row: StateLayout) -> str:
        return "none"

    def collective_slots(self, row, groups, prefetch, f, b, o, knobs):
        return ddp_bucket_slots(groups, f, b, o)

    def framework_terms(self, row, groups, itemsize, cost, orig_params, terms, notes):
        if not groups.buckets:
            return super().framework_terms(row, groups, itemsize, cost, orig_params, terms, notes)
        b, o = ddp_bucket_terms(groups, itemsize, cost, terms)
        return 0.0, b, o

    # --- the peak model: the ``new`` flow ----------------------------------------------------------------------
    def flow(self, row):
        return "new"

    def accumulates(self, row):
        return True

    def accumulated_grad_bytes(self, row, grad_bytes):
        return accumulated_grad_bytes(grad_bytes, live_grads=False)

    def precision_terms(self, row, precision, param_dtype, compute_itemsize):
        """Lightning's ``MixedPrecision`` plugin runs the step under ``torch.autocast``: parameters, their ``.grad``
        and AdamW stay fp32 (lightning/pytorch/plugins/precision/amp.py)."""
        return FP32_TERMS if precision == "fp32" else PrecisionTerms(param_dtype, None, 4, False)

    def needs_in_place(self, row, micro_batches):
        return micro_batches > 1  # a later micro-batch adds into the gradients

    def stepped(self, groups: Groups, rank: int) -> range | list[int]:
        """Indices of the parameters rank ``rank``'s optimizer steps: every one."""
        return range(len(groups.numels))

    def stepped_numels(self, groups: Groups, rank: int) -> tuple[int, ...]:
        """The sizes of the parameters rank ``rank``'s AdamW steps (:meth:`stepped`, less those a step gives no
        gradient): all :meth:`phase_peaks` reads of the rank."""
        idle = set(groups.ungraded)
        return tuple(groups.numels[i] for i in self.stepped(groups, rank) if i not in idle)

    def phase_peaks(self, row, groups, shape, trace, itemsize, *, rank, prefetch, gloo, micro_batches, in_place,
                    bucket_cap_bytes, terms, reduce, root_kept, foreach, knobs, block):
        """A parameter a step gives no gradient has no gradient and no moments to step; ``zero_grad`` frees the
        gradients of those that have one."""
        g = (terms or FP32_TERMS).grad_itemsize
        idle = set(groups.ungraded)
        numels = self.stepped_numels(groups, rank)
        graded = counted_sum((k * g for i, k in enumerate(groups.numels) if i not in idle), block)
        return accumulated_phase_peaks(trace, micro_batches, in_place=in_place, steady_grad_bytes=graded, buckets=(),
                                       optimizer_numels=numels, **{**ADAMW, "foreach": foreach,
                                                                          "block": block})

    def steady_buffers(self, row, groups, itemsize, bucket_cap_bytes, terms):
        """DDP's gradient buckets (``gradient_as_bucket_view=false``: a copy of every gradient)."""
        return sum(sum(b) for b in groups.buckets) * itemsize

    def init_peak_bytes(self, shape, init, world_size, itemsize, use_orig_params):
        return replica_init_peak_bytes(shape, init, itemsize)

    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """Every rank holds the whole state as plain tensors (torch's state-dict API, zeroexp.strategies._checkpoint):
        a full save makes rank 0's copy on the host, none on the CPU; a sharded one copies nothing (DCP writes each
        item where it lies); a full load reads the file on every rank and, on an accelerator, makes a device copy of
        each of its model tensors and moments; every load steps once at zero (checkpoint_peak.zero_step)."""
        n, cpu = groups.world_size, device.name == "cpu"
        zs = zero_step(tuple(groups.numels), device)
        none = [{"copied": 0}] * n
        if kind == "full":
            save = phase(none, [True] * n, None if cpu else [full_file] + [0] * (n - 1))
            made = 0 if cpu else state.params + state.frozen + state.buffers
            load = full_load(0 if not cpu else full_file, made, zs, 0 if cpu else state.moments)
            return CheckpointPeaks(kind, save, phase([load] * n, [True] * n, None if cpu else [full_file] * n))
        save = phase(none, [False] * n, unsized=("dcp_objects",))
        return CheckpointPeaks(kind, save, phase([zs.terms()] * n, [False] * n, unsized=("dcp_objects",)))


DDP = DdpBuckets()

#: ddp under bf16 / fp16: autocast, so parameters, gradients and what is all-reduced stay fp32
ROWS = {
    "ddp": StateLayout("DDP", 0, frozenset(), "never", DDP, all_reduce_buckets, fp32_at_rest=True,
                       fp32_on_the_wire=True, precisions=MIXED, comm=_ddp_comm, source="zeroexp.strategies.ddp",
                       init_modelled=True),
}
