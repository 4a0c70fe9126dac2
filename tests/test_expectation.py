"""One expectation model: the groups a strategy's adapter reads off its live structure equal, element for
element, the groups the planner derives from shapes on the meta device; the plan check compares calls as well as
bytes, and a derived dry run's plan check reads n/a.

The grid: every strategy at N = 3 on an mlp whose Linear(64, 64) N does not divide (padding) with a 0.05 MiB bucket
cap (several DDP, zeroexp and DeepSpeed buckets), and on a GPT with tied weights (DDP's buckets follow gradient
readiness: the tied embedding is ready last, not first).
"""

from __future__ import annotations

import pytest

from zeroexp.cell.resolved import Cell
from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, cut_buckets, derive_groups, step_collectives
from zeroexp.strategies.deepspeed import deepspeed_available
from zeroexp.results.verdict import Code
from conftest import PROBED, STEPS, WINDOWS

STRATEGIES = ["ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp_full", "fsdp2_full", "deepspeed"]
MODELS = {"mlp": ("model=mlp", "strategy.bucket_cap_mb=0.05"),  # 3 x 4096 elements of 4 B fit in 0.05 MiB
          "gpt": ("model=gpt", "model.n_layer=2", "strategy.bucket_cap_mb=0.1")}  # above the 16384-element embedding
GPT_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)  # conftest's BASE without the mlp's width
_NO_BUCKETS = {"fsdp_grad_op", "fsdp_full", "fsdp2_full"}  # strategies without a bucket cap


def _overrides(strategy: str, model: str) -> list[str]:
    keys = [o for o in MODELS[model] if not (strategy in _NO_BUCKETS and o.startswith("strategy.bucket_cap_mb"))]
    return [f"strategy={strategy}", "world_size=3", f"steps={PROBED}", *keys]  # warm-up, profiled, memory: timing n/a


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plan_equals_live_groups_counts_and_bytes(cell, strategy, model):
    if strategy == "deepspeed" and not deepspeed_available():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    result = cell(*_overrides(strategy, model), **({"base": GPT_BASE} if model == "gpt" else {}))
    s = result.summary
    assert s["status"] == "ok", s
    plan = s["plan"]
    assert plan["groups"]["check"] == "PASS", plan["groups"]["reasons"]
    assert plan["check"] == "PASS", plan["reasons"]
    rows = plan["collectives"]
    assert rows and {r["op"] for r in rows} == set(s["collectives"]["counts"])
    for row in rows:
        assert row["predicted_count"] == row["measured_count"] and row["predicted_bytes"] == row["measured_bytes"], row
    assert s["collectives"]["check"] == "PASS", s["collectives"]["reasons"]
    groups = plan["groups"]["planned"]
    if strategy in ("ddp", "zro", "deepspeed") or strategy.startswith("zero"):  # the cap makes several buckets
        assert len(groups["buckets"] or groups["shards"]) > 1, groups


def test_ddp_buckets_follow_gradient_readiness(compose):
    """The planner's DDP buckets follow the gradient-ready order of a meta-device backward (DDP's Reducer rebuilds
    its buckets in that order), not reverse definition order, which a tied embedding breaks."""
    from zeroexp.models import wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.plan.shape import model_shape

    cfg = compose("model=gpt", "model.n_layer=2", "world_size=3", "strategy.bucket_cap_mb=0.05", base=GPT_BASE)
    shape = model_shape(cfg.model, wrap_paths(cfg))
    assert shape.ready is not None and shape.ready != tuple(range(len(shape.params)))[::-1]
    assert shape.ready[-1] == 0  # the tied embedding: its gradient is complete only after the head's
    flat = [k for bucket in cell_groups(Cell.of(cfg)).buckets for k in bucket]
    assert flat == [shape.numels[i] for i in shape.ready]
    tiny = ModelShape(((4,), (4,), (4,)), ((0, 1, 2),), (True,), ready=(1, 2, 0))
    assert derive_groups("ddp", LAYOUTS["ddp"], tiny, 2, 4, PlanKnobs(bucket_cap_bytes=32)).buckets == ((4, 4), (4,))


def test_one_cutter_three_rules():
    assert cut_buckets([4, 4, 4], 8) == [[0, 1], [2]]  # fit: never past the cap
    assert cut_buckets([4, 12, 4], 8) == [[0], [1], [2]]  # an item above the cap is a bucket alone
    assert cut_buckets([4, 4, 4], 8, "reach") == [[0, 1], [2]]
    assert cut_buckets([4, 4, 4], 7, "reach") == [[0, 1], [2]]  # DDP: closes once it holds the cap or more
    assert cut_buckets([4, 4, 4], 8, "exceed") == [[0, 1, 2]]  # DeepSpeed ZeRO-0: once it holds more


def test_count_only_plan_keeps_the_papers_collectives():
    """A model known by its count has no structure: one bucket, one flat buffer (Figure 1 / Table 1 unchanged)."""
    shape = ModelShape.from_count(7_500_000_000)
    for name, want in (("ddp", {"all_reduce": 1}), ("zero_stage3", {"all_gather": 2, "reduce_scatter": 1})):
        groups = derive_groups(name, LAYOUTS[name], shape, 64, 2)
        got = {op: v["count"] for op, v in step_collectives(LAYOUTS[name], groups, 2).items()}
        assert got == want


def test_derived_dry_run_plan_check_reads_na(cell):
    """A derived dry run's state and collectives are the planner's model: comparing them cannot fail, so n/a."""
    s = cell("strategy=ddp", "world_size=64", "dry_run=true", "model.width=256").summary
    assert s["plan"]["check"] == "n/a" and s["plan"]["reason_codes"] == [Code.NOT_CHECKED], s["plan"]
    assert s["plan"]["groups"]["check"] == "n/a" and s["plan"]["groups"]["reason_codes"] == [Code.NOT_CHECKED]
    assert s["collectives"]["check"] == "n/a"
