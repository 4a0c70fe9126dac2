"""What FSDP1's flat units and FSDP2's per-parameter rows share: units gathered before their forward and backward,
reduce-scattered after their backward [FSDP] [FSDP2]; the timeline of those calls, the framework's cost per call,
the peak model over units (:func:`zeroexp.formulas.peak.phases.fsdp_phase_peaks`,
:mod:`zeroexp.formulas.peak.fsdp2`), the tensors gloo may free late. Each family
(:mod:`~zeroexp.formulas.families.fsdp1`, :mod:`~zeroexp.formulas.families.fsdp2`) says where they differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroexp.formulas.peak.allocator import counted, counted_sum
from zeroexp.formulas.families.base import Family
from zeroexp.formulas.families.ddp import ADAMW
from zeroexp.formulas.time.overlap import Slot, cumulative
from zeroexp.formulas.shapes import POST_FORWARD, WORLD, Groups, Payload, PlanKnobs
from zeroexp.formulas.hybrid import MESH_DIMS
from zeroexp.formulas.paper import (Collectives, add_collectives, clip_norm_all_reduces, collectives_of,
                                    fp16_inf_syncs, fsdp2_padded_numel)
from zeroexp.formulas.peak.phases import FsdpUnit
from zeroexp.formulas.peak.precision import FP32_TERMS, PrecisionTerms, sharded_grad_upcast

__all__ = ["FsdpFamily", "UnitTerms", "fsdp_unit_slots", "gather_units", "hybrid_units"]


def fsdp_unit_slots(groups: Any, mode: str, f: float, b: float, o: float, fwd: int, bwd: int) -> tuple[list, str]:
    """FSDP's units on the step's timeline: each unit's forward all_gather issued ``fwd`` units ahead; its
    reduce_scatter after its backward; a resharded unit's backward all_gather by the backward prefetch ``mode``
    (``pre``, ``post``, ``none``; ``bwd`` units ahead)."""
    end_b = f + b
    units = groups.units
    c = cumulative([u.numel for u in units])
    fs = [f * x / c[-1] for x in c]  # unit i's forward: [fs[i], fs[i + 1]]
    bs = [f + b * (c[-1] - x) / c[-1] for x in c]  # unit i's backward: [bs[i + 1], bs[i]]
    # FSDP2 reshard_after_forward=k: a unit's forward gather runs over the world, its backward one over k ranks
    narrow = groups.post_forward_size > 0
    slots = [Slot("all_gather", u.numel, fs[max(i - fwd, 0)], fs[i], group=WORLD if narrow else "")
             for i, u in enumerate(units)]
    for i, u in enumerate(units):
        slots.append(Slot("reduce_scatter", u.numel, bs[i], end_b, order=1 if mode == "post" else 0))
        if u.gathers < 2:
            continue
        later = i + 1 < len(units)  # the unit whose backward runs before this one's
        issue = {"pre": bs[min(i + 1 + bwd, len(units))] if later else bs[i + 1],
                 "post": bs[i + 1], "none": bs[i + 1]}[mode]
        slots.append(Slot("all_gather", u.numel, issue, bs[i + 1], order=0 if mode == "post" else 1,
                          group=(POST_FORWARD if u.post_forward else WORLD) if narrow else ""))
    ahead_s = f"{fwd} unit{'s' * (fwd > 1)}"
    return slots, f"FSDP: forward all_gather {ahead_s} ahead; backward prefetch {mode}" + (
        f" ({bwd} units ahead)" if bwd > 1 else "")


def gather_units(dtensor_grads: bool = False, kept_under_no_sync: bool = False) -> Payload:
    """FSDP [ZeRO 7.2.2]: per unit of padded bytes b, its all_gathers S = b (two when resharded after forward) and one
    reduce_scatter S = b; fp16 adds the loss scaler's found_inf all_reduces (:func:`fp16_inf_syncs`); clipping one
    fp32 all_reduce of the norms: FSDP1's ``clip_grad_norm_`` sums the squared norm of the rank's shards (4 bytes);
    FSDP2's ``get_total_norm`` stacks one partial norm per gradient DTensor, made whole by one all_reduce (4 bytes
    each). ``grad_accum=K``: every micro-batch gathers its units again (FSDP1 SHARD_GRAD_OP under ``no_sync``,
    ``kept_under_no_sync``, keeps them unsharded to the step's last instead: once per step); the gradients are
    reduce-scattered once per step under ``no_sync``, every micro-batch with ``strategy.sync_each_microbatch``;
    FSDP2's (``dtensor_grads``) in its ``reduce_dtype`` where set (:meth:`PlanKnobs.reduce_itemsize`); with
    ``Groups.post_forward_size`` its all_gathers by group: the world's, and the post-forward group's."""
    def payload(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
        k, each = knobs.micro_batches, knobs.sync_each_microbatch
        r = knobs.reduce_itemsize(c) if dtensor_grads else c  # FSDP2's reduce_dtype; FSDP1 reduces in c
        syncs = fp16_inf_syncs(dtensor_grads) if knobs.loss_scaling else 0
        norms = clip_norm_all_reduces(len(g.numels), dtensor_grads) if knobs.clipping else []
        gathered, narrow = (1 if kept_under_no_sync and not each else k), g.post_forward_size
        model = collectives_of(all_gather=[] if narrow else [u.numel * c for u in g.units
                                                            for _ in range(u.gathers * gathered)],
                               reduce_scatter=[u.scattered * r for u in g.units if u.scattered] * (k if each else 1),
                               all_reduce=[4] * syncs + norms)
        for group, gathers in (((WORLD, g.world_size), lambda u: u.gathers - u.post_forward),
                               ((POST_FORWARD, narrow), lambda u: u.post_forward)) if narrow else ():
            add_collectives(model, "all_gather", [u.numel * c for u in g.units for _ in range(gathers(u) * gathered)],
                            group)  # FSDP2 reshard_after_forward=k: a unit's gathers by group (Unit.post_forward)
        return model
    return payload


def hybrid_units(dtensor_grads: bool = False, kept_under_no_sync: bool = False) -> Payload:
    """HSDP [FSDP, FSDP2]: per unit of b padded bytes (padded to shard_size), its all_gathers S = b and one
    reduce_scatter S = b over the shard group, one all_reduce S = b / shard_size (the gradient shard) over the
    replicate group (both in FSDP2's ``reduce_dtype`` where set); fp16 adds the loss scaler's found_inf all_reduce
    over the world and, with DTensor gradients (FSDP2), DTensor's own over the shard group (:func:`fp16_inf_syncs`);
    clipping one norm all_reduce over the shard group (:func:`clip_norm_all_reduces`). ``grad_accum=K``: as FSDP's
    (:func:`gather_units`), every micro-batch gathers its units again
    (``kept_under_no_sync``, _HYBRID_SHARD_ZERO2 under ``no_sync``: once per step); the gradients are
    reduce-scattered and all-reduced once per step under ``no_sync``, every micro-batch with
    ``strategy.sync_each_microbatch``."""
    def payload(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
        s, k, each = g.shard_over, knobs.micro_batches, knobs.sync_each_microbatch
        r = knobs.reduce_itemsize(c) if dtensor_grads else c  # FSDP2's reduce_dtype; FSDP1 reduces in c
        shard, replicate = (MESH_DIMS[1], s), (MESH_DIMS[0], g.world_size // s)
        gathered, reduced = (1 if kept_under_no_sync and not each else k), (k if each else 1)
        model: Collectives = {}
        add_collectives(model, "all_gather", [u.numel * c for u in g.units for _ in range(u.gathers * gathered)],
                        shard)
        add_collectives(model, "reduce_scatter", [u.scattered * r for u in g.units if u.scattered] * reduced, shard)
        add_collectives(model, "all_reduce", [u.scattered // s * r for u in g.units if u.scattered] * reduced,
                        replicate)
        syncs = fp16_inf_syncs(dtensor_grads) if knobs.loss_scaling else 0
        # ShardedGradScaler's found_inf over the world; DTensor's own inf check (FSDP2) over the gradients' Partial
        # dimension, the shard group (torch/distributed/tensor/_dispatch.py found_inf_reduce_handler)
        add_collectives(model, "all_reduce", [4] * min(syncs, 1), (WORLD, g.world_size))
        add_collectives(model, "all_reduce", [4] * (syncs - 1), shard)
        # clipping: FSDP1's clip_grad_norm_ all-reduces its squared shard norm over its process group, the shard
        # group; FSDP2's get_total_norm(...).full_tensor() the stacked partial norms, one per gradient, over the same
        norms = clip_norm_all_reduces(len(g.numels), dtensor_grads) if knobs.clipping else []
        return add_collectives(model, "all_reduce", norms, shard)
    return payload


@dataclass(frozen=True)
class UnitTerms:
    """The peak model's terms of a rank's units, in ``block``-byte blocks (:meth:`FsdpFamily.phase_peaks`): each
    non-root unit's (``units``), the root unit's unsharded parameters, its parameters' own gradients and its flat
    gradient, its parameters' padded rows (FSDP2); each non-root unit's flat gradient (under ``no_sync``); whether the
    model is one unit (``alone``); each unit's parameter indices (``members``); AdamW's keywords."""

    units: list[FsdpUnit]
    root: int
    root_grads: int
    root_flat: int
    root_params: tuple[int, ...]
    flat_grads: list[int]
    alone: bool
    members: list[tuple[int, ...]]
    adamw: dict[str, Any]


class FsdpFamily(Family):
    """A family of gathered units (its subclasses: FSDP1, FSDP2)."""

    shards_frozen = True
    gathers_each_name = True
    steps_per_shard = True
    gathers_units = True
    covered_rank = 1

    def below_min_world(self, row):
        return "at one rank torch's FSDP shards nothing"

    def covered_key(self, row):
        return (row.hybrid, not row.reshard_after_forward)  # FULL_SHARD, SHARD_GRAD_OP, then hybrid sharding's

    # --- time ---------------------------------------------------------------------------------------------------
    def slot_rule(self, row, prefetch: str, knobs: PlanKnobs) -> tuple[str, int, int]:
        """The backward prefetch mode and the units the forward and backward gathers run ahead."""
        return prefetch, 1, 1

    def collective_slots(self, row, groups, prefetch, f, b, o, knobs):
        if not groups.units:
            return super().collective_slots(row, groups, prefetch, f, b, o, knobs)
        mode, fwd, bwd = self.slot_rule(row, prefetch, knobs)
        return fsdp_unit_slots(groups, mode, f, b, o, fwd, bwd)

    def call_path(self, cost: Any, orig_params: bool, notes: list[str]) -> str:
        """The calibration's per-call path of this family's gathers and reduce-scatters."""
        return f"{self.name}_call"

    def framework_terms(self, row, groups, itemsize, cost, orig_params, terms, notes):
        if not groups.units:
            return super().framework_terms(row, groups, itemsize, cost, orig_params, terms, notes)
        path = self.call_path(cost, orig_params, notes)
        one = [cost.call_s(path, u.numel * itemsize) for u in groups.units]  # a gather or reduce_scatter
        terms[f"{self.name}_forward_calls"] = sum(one)
        terms[f"{self.name}_backward_calls"] = sum(c * (2 if u.gathers >= 2 else 1) for c, u in zip(one, groups.units))
        b, o = self.backward_and_step_terms(groups, itemsize, cost, terms)
        return terms[f"{self.name}_forward_calls"], b, o

    def backward_and_step_terms(self, groups, itemsize: int, cost: Any, terms: dict) -> tuple[float, float]:
        raise NotImplementedError

    # --- the peak model -----------------------------------------------------------------------------------------
    def flow(self, row):
        return self.name

    def precision_terms(self, row, precision, param_dtype, compute_itemsize):
        """Units gathered in the compute dtype (FSDP1 ``MixedPrecision``, FSDP2 ``MixedPrecisionPolicy``); fp16 under
        Lightning's autocast too (zeroexp/strategies/_amp.py ``with_sharded_scaler``)."""
        if precision == "fp32":
            return FP32_TERMS
        return PrecisionTerms(param_dtype if precision == "fp16" else None, param_dtype, compute_itemsize, False)

    def trace_options(self, row):
        # a model with no unit of a wrap class is one unit
        return {"own_params_units": False, "root_unit": True, "converts_module": False, "tensor_bytes": False}

    def shape_limits(self, row, shape):
        """Units called other than once, a root that trains beside frozen parameters (before the shared limits);
        opaque kernels (after the RNN one)."""
        first, later, label = [], [], self.name.upper()
        if shape.exact:
            if shape.frozen and any(shape.train(i) for u, root in zip(shape.units, shape.root) if root for i in u):
                first.append(f"no peak model yet for {label} with frozen parameters and a root unit that "
                             "trains (its reduce-scatter at the end of backward); state, collectives and groups are "
                             "checked")
            if any(shape.calls(u) != 1 or not shape.backward(u) for u in range(len(shape.units))):
                first.append(f"no peak model yet for {label} units called other than once per forward or "
                             "that backward does not reach (traced step); state, collectives and groups are checked")
        rnn = [c for c in shape.opaque if c in ("RNN", "LSTM", "GRU")]
        if shape.opaque and len(rnn) < len(shape.opaque):
            later.append(f"no peak model yet for {', '.join(shape.opaque)} under {label}: their CPU backward "
                         "kernels allocate workspace the fake-tensor trace does not see (2,276 B beyond it measured "
                         "on a 4-channel convnet, the model one unit); state, collectives and groups are checked")
        return first, later, []

    def reduce_itemsize(self, knobs, itemsize: int) -> int:
        """The bytes per element of a unit's reduce-scatter input and output shard."""
        return itemsize

    def unit_terms(self, row, unit, members, shape, n: int, itemsize: int, terms: PrecisionTerms, block: int):
        """What the family adds to a unit's :class:`FsdpUnit`: its sharded compute-dtype copy (FSDP1 below fp32) and
        its parameters' padded rows (FSDP2)."""
        return 0, ()

    def phase_peaks(self, row, groups, shape, trace, itemsize, *, rank, prefetch, gloo, micro_batches, in_place,
                    bucket_cap_bytes, terms, reduce, root_kept, foreach, knobs, block):
        """The groups' units (padded FlatParameters or FSDP2's padded rows, in post-order, the root last) beside the
        shape's (their parameters' own gradients), gathered and reduced in the compute dtype (``itemsize``), their
        gradient shards kept in fp32 (below fp32: up-cast, ``terms``). Each tensor counted in ``block``-byte blocks
        (CUDA's 512): a unit's flat parameter or all-gather output, each parameter's gradient and unsharded rows, a
        shard."""
        terms = terms or FP32_TERMS
        # sharded over the shard group (hybrid sharding: shard_size ranks; else all); the gradient shards: AdamW's
        n, kept = groups.shard_over, ADAMW["optimizer_itemsize"]
        adamw = {**ADAMW, "foreach": foreach, "block": block}

        def b(nbytes: int) -> int:
            return counted(nbytes, block)
        r = self.reduce_itemsize(knobs, itemsize)
        sized = [(unit, root) for unit, root in zip(shape.units, shape.root) if sum(shape.numels[i] for i in unit)]
        if len(sized) != len(groups.units):
            raise ValueError(f"{len(sized)} units with parameters in the shape, {len(groups.units)} in the groups")
        units, root, root_grads, root_params = [], 0, 0, ()
        flat_grads, root_flat = [], 0  # under no_sync: each unit's gradient one storage (FSDP1's .grad)
        alone = all(is_root for _, is_root in sized)  # one unit: the model itself, traced as a unit, kept
        for (members, is_root), unit in zip(sized, groups.units):
            if is_root and not alone:
                root += b(unit.numel * itemsize)
                root_grads += counted_sum((shape.numels[i] * itemsize for i in members), block)
                root_flat += b(sum(shape.numels[i] for i in members) * itemsize)
                root_params = tuple(b(fsdp2_padded_numel(shape.params[i], n) * itemsize) for i in members)
            else:  # the gradients autograd computes: of the trainable parameters a step uses
                trained = [i for i in members if shape.train(i) and i not in shape.unused]
                flat_grads.append(b(sum(shape.numels[i] for i in trained) * itemsize))
                module_shard, params = self.unit_terms(row, unit, members, shape, n, itemsize, terms, block)
                units.append(FsdpUnit(b(unit.numel * itemsize), b(unit.scattered // n * r),
                                      counted_sum((shape.numels[i] * itemsize for i in trained), block),
                                      b(sharded_grad_upcast(unit.scattered // n, terms)) if r < kept else 0,
                                      module_shard,
                                      None if unit.reduced is None and r == itemsize else b(unit.scattered * r),
                                      b(shape.numels[max(trained)] * itemsize) if trained else 0, params))
        held = UnitTerms(units, root, root_grads, root_flat, root_params, flat_grads, alone, [m for m, _ in sized],
                         adamw)
        return self.unit_phase_peaks(row, groups, shape, trace, itemsize, held, rank=rank, prefetch=prefetch,
                                     gloo=gloo, micro_batches=micro_batches, root_kept=root_kept, knobs=knobs,
                                     block=block, foreach=foreach, in_place=in_place)

    def unit_phase_peaks(self, row, groups, shape, trace, itemsize, held: UnitTerms, **kw) -> dict[str, dict]:
        raise NotImplementedError

    def late_free(self, row, groups, itemsize, micro_batches, bucket_cap_bytes=0):
        """In backward and the optimizer step a unit's reduce-scatter input, gloo's copy of it or its output (gloo
        frees them when the work object goes, which may be after a later moment of the phase; docs/results.md
        measures how often)."""
        if not groups.units:
            return {}
        n = groups.shard_over
        sizes = sorted({u.numel * itemsize for u in groups.units} | {u.numel // n * itemsize for u in groups.units})
        unit = [("one unit's reduce-scatter tensor (its unsharded gradient, gloo's copy of it, or its sharded "
                 "output)", b) for b in sizes]
        # gloo's work object holds its input copy and its output together: one reduce-scatter's pair, freed as one
        # (measured: fsdp_grad_op fp16 N=2, 12,296 B above the prediction on one rank under load, a unit's 8,192 B
        # input and its 4,096 B output)
        unit += [("one unit's reduce-scatter work, its input copy and its output held together by gloo", b)
                 for b in sorted({u.numel * itemsize + u.numel // n * itemsize for u in groups.units})]
        # the last units' reductions are waited for at backward's end: gloo's work may hold one into the update
        # (measured once in the suite: fsdp_hybrid N=4, a unit's unsharded gradient through AdamW)
        return {"backward": unit, "optimizer": unit, **self.forward_late_free(sizes)}

    def forward_late_free(self, sizes: list[int]) -> dict[str, list[tuple[str, int]]]:
        return {}
