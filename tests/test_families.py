"""Strategy families (zeroexp.formulas.families): a strategy in an existing family is one row. The worked example
of docs/architecture.md: Megatron-LM's distributed optimizer as a planner-only row of zeroexp's ZeRO buckets family,
added here without touching any other file, planned state, collectives and peak; and every row's family answers for
it (the rows each family lists are the rows ``LAYOUTS`` holds)."""

from __future__ import annotations

from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, derive_groups, rank_state_bytes, step_collectives
from zeroexp.formulas.families import Family
from zeroexp.formulas.families import ddp, deepspeed, fsdp1, fsdp2, paper, zero, zro
from zeroexp.formulas.families.ddp import MIXED
from zeroexp.formulas.families.zero import ZERO, scatter_gather
from zeroexp.formulas.layout import StateLayout

from test_plan_fits import _run

#: Megatron-LM's distributed optimizer (megatron/core/optimizer/distrib_optimizer.py): DDP-like contiguous gradient
#: buckets, each reduce-scattered, the fp32 main parameters and Adam's moments sharded by bucket, the updated
#: parameters all-gathered per bucket; an fp32 main copy only when the model computes below fp32 (``mixed``).
MEGATRON = StateLayout("Megatron distributed optimizer", 1, frozenset({"optim"}), "mixed", ZERO, scatter_gather,
                       precisions=MIXED, source="Megatron-LM distrib_optimizer.py")


def test_each_row_is_listed_by_its_family_once():
    listed = [name for module in (paper, ddp, zro, zero, fsdp1, fsdp2, deepspeed) for name in module.ROWS]
    assert sorted(listed) == sorted(LAYOUTS) and len(listed) == len(set(listed))
    families = {paper: paper.PAPER, ddp: ddp.DDP, zro: zro.ZRO, zero: zero.ZERO, fsdp1: fsdp1.FSDP1,
                fsdp2: fsdp2.FSDP2, deepspeed: deepspeed.DEEPSPEED}
    for module, family in families.items():  # each module's rows are its family's
        assert isinstance(family, Family) and {r.family for r in module.ROWS.values()} == {family}, module.__name__


def test_a_megatron_distributed_optimizer_is_one_row_of_an_existing_family(monkeypatch):
    shape = ModelShape(((64, 64), (64,), (64, 64), (64,)), ((0, 1, 2, 3),), (True,))
    knobs = PlanKnobs(bucket_cap_bytes=2**14)
    for itemsize in (4, 2):
        mine, theirs = (derive_groups(n, r, shape, 4, itemsize, knobs) for n, r in (("megatron", MEGATRON),
                                                                                   ("zero1", LAYOUTS["zero1"])))
        assert mine.shards == theirs.shards and len(mine.shards) > 1  # the family's buckets
        # per bucket one reduce_scatter and one all_gather
        coll = step_collectives(MEGATRON, mine, itemsize, knobs)
        assert {op: c["count"] for op, c in coll.items()} == {"reduce_scatter": len(mine.shards),
                                                                  "all_gather": len(mine.shards)}
        state = rank_state_bytes(MEGATRON, mine, itemsize, knobs)
        # fp32: no main copy (zeroexp's ZeRO-1 keeps one always); bf16: the fp32 main shard, as ZeRO-1's
        assert ("master" in state) == (itemsize == 2)
        if itemsize == 2:
            assert state == rank_state_bytes(LAYOUTS["zero1"], theirs, itemsize, knobs)
    # planned beside the strategies, with its peak, by the row alone
    monkeypatch.setitem(LAYOUTS, "megatron_distopt", MEGATRON)
    records, _ = _run("model=gpt", "model.n_layer=2", "world_size=4", "batch_size=2", "precision=bf16",
                      "device=cpu", "strategies=[megatron_distopt,zero1]")
    rows = {r["strategy"]: r for r in records}
    assert rows["megatron_distopt"]["peak_bytes"] == rows["zero1"]["peak_bytes"] is not None
    assert rows["megatron_distopt"]["counts"] == rows["zero1"]["counts"]
