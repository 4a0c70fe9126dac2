"""The ZeRO paper's stages [ZeRO] 5.1, 7: closed forms no strategy runs (``reference`` rows: planned beside the
strategies for comparison, never recommended): stage 0 replicated with one gradient bucket, stages 1-3 one flat
buffer padded to N; rows ``zero_stage0`` .. ``zero_stage3``."""

from __future__ import annotations

from zeroexp.formulas.families.base import Cut, Family
from zeroexp.formulas.families.ddp import ddp_bucket_slots, ddp_bucket_terms
from zeroexp.formulas.families.fsdp1 import OS_G_P, packed_units, twice_unless_root
from zeroexp.formulas.families.ddp import all_reduce_buckets
from zeroexp.formulas.families.zero import scatter_gather
from zeroexp.formulas.layout import ModelShape, PlanKnobs, StateLayout, pack
from zeroexp.formulas.paper import Collectives, collectives_of, fp16_inf_syncs
from zeroexp.formulas.paper import padded_numel
from zeroexp.formulas.shapes import Groups, Shard

__all__ = ["PaperStages", "PAPER", "ROWS", "gather_shards_twice"]

_MIXED = frozenset({"fp32", "bf16", "fp16"})
_OS, _OS_G = frozenset({"optim"}), frozenset({"optim", "grad"})
_OFF = [frozenset({"none"}), frozenset({"none", "optimizer"}), frozenset({"none", "optimizer", "full"})]


def _one_bucket(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    return {"buckets": (shape.numels if shape.exact else (shape.numel,),)}


def gather_shards_twice(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
    """P_os+g+p as the paper counts it [ZeRO 7.2.2]: every padded buffer all-gathered before forward and again before
    backward, its gradient reduce-scattered once: 2P + P; fp16 adds the loss scaler's found_inf all_reduce."""
    sizes = [sh.numel * c for sh in g.shards]
    syncs = fp16_inf_syncs(dtensor_grads=False) if knobs.loss_scaling else 0
    return collectives_of(all_gather=sizes + sizes, reduce_scatter=sizes, all_reduce=[4] * syncs)


class PaperStages(Family):
    """The paper's stages: no runtime, so no peak model, no init, no framework cost."""

    name = "paper"
    def sharded_written(self, row, groups, itemsize, knobs, state, again):
        return None  # no runtime, no files

    def unmodelled(self, row):
        return (f"{row.label}: the paper's stage has no runtime whose step holds memory, so no peak model (its state "
                "and communication are the paper's formulas)")

    def groups_kind(self, row):
        return "flat" if row.stage else "none"

    def pads_count(self, row):
        return row.stage > 0

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        if not row.stage:
            return Cut()
        spans, length = pack(list(shape.numels))
        units = packed_units(self, row, shape, n, knobs, 0, narrow) if row.gather != "none" else []
        return Cut(shards=[Shard(spans, padded_numel(length, row.pad * n))], units=units)

    def collective_slots(self, row, groups, prefetch, f, b, o, knobs):
        if not row.stage:
            return ddp_bucket_slots(groups, f, b, o)
        return super().collective_slots(row, groups, prefetch, f, b, o, knobs)

    def framework_terms(self, row, groups, itemsize, cost, orig_params, terms, notes):
        if not row.stage and groups.buckets:
            b, o = ddp_bucket_terms(groups, itemsize, cost, terms)
            return 0.0, b, o
        return super().framework_terms(row, groups, itemsize, cost, orig_params, terms, notes)


PAPER = PaperStages()

ROWS = {
    "zero_stage0": StateLayout("baseline (paper)", 0, frozenset(), "mixed", PAPER, all_reduce_buckets,
                               comm=_one_bucket, precisions=_MIXED, source="[ZeRO] 5.1, 7.1, Figure 1",
                               reference=True),
    "zero_stage1": StateLayout("P_os (paper)", 1, _OS, "mixed", PAPER, scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]", reference=True),
    "zero_stage2": StateLayout("P_os+g (paper)", 2, _OS_G, "mixed", PAPER, scatter_gather, precisions=_MIXED,
                               offloads=_OFF[1], source="[ZeRO] 5.1, 7.2.1, Figure 1; [OFFLOAD]", reference=True),
    "zero_stage3": StateLayout("P_os+g+p (paper)", 3, OS_G_P, "mixed", PAPER, gather_shards_twice, "largest",
                               precisions=_MIXED, offloads=_OFF[2], gathers_per_unit=twice_unless_root,
                               source="[ZeRO] 5.1, 7.2.2, Figure 1; [OFFLOAD]", reference=True),
}
