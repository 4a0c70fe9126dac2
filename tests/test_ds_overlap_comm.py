"""DeepSpeed's ``overlap_comm`` (``strategy.overlap_comm``, the planner's ``overlap_comm``): stage 2 holds the ipg
bucket's second buffer (DeepSpeed 0.19 stage_1_and_2.py ``setup_buckets``, "double buffers"), measured in cells on
models zeroexp did not write; the reductions overlap backward in the step-time model where the device has streams;
stages 0 and 1 refuse it, naming the key and why."""

from __future__ import annotations

import pytest
from hydra import compose as hydra_compose, initialize_config_dir

from conftest import STEPS, WINDOWS
from zeroexp.config.schemas import ConfigError
from zeroexp.formulas import LAYOUTS, PlanKnobs, derive_groups
from zeroexp.formulas.deepspeed import deepspeed_reduce_bucket_numel, ipg_buffers
from zeroexp.formulas.time.overlap import collective_slots
from zeroexp.strategies import deepspeed as ds_adapter

pytestmark = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

ON = ("strategy=deepspeed", "strategy.overlap_comm=true")
#: A 2-layer Llama (Hugging Face config, grouped-query attention) in 0.01 MiB buckets: 21 of them, filled in the order
#: the hooks fire (tests/test_deepspeed.py's buckets test).
LLAMA = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")


def _stack():
    """12 bias-free Linear(64, 64) (4,096 elements each) as the planner reads them, on the meta device."""
    import torch
    from torch import nn

    from zeroexp.models import LinearStack
    from zeroexp.plan.shape import shape_of

    with torch.device("meta"):
        return shape_of(LinearStack(64, 12), [nn.Linear])


def _plan_ok(r) -> dict:
    assert r.status == "ok", r.error
    plan = r.summary["plan"]
    for part in ("state", "groups", "calls", "memory"):
        assert plan[part]["check"] == "PASS", (part, plan[part].get("reasons"))
    assert all(rank["check"] == "PASS" for rank in plan["memory"]["ranks"])
    return plan


def test_stage2_holds_the_second_ipg_buffer_on_every_rank(cell):
    """The default mlp at N=3 (uneven partitions) in one 25 MiB bucket: backward holds both buffers, 2 x 6,553,600
    fp32 elements; without the second one the plan would be 48 % under the measurement (plan.memory FAIL)."""
    r = cell(*ON, "strategy.stage=2", "world_size=3")
    plan = _plan_ok(r)
    bucket = deepspeed_reduce_bucket_numel(25 * 2**20) * 4
    for rank in plan["memory"]["ranks"]:
        assert rank["backward"]["measured_bytes"] >= 2 * bucket, rank
    assert plan["memory"]["phases"]["backward"]["predicted_by_category"]["gradients"] == 2 * bucket


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hugging_face_llama_in_many_buckets_holds_every_check(cell, stage):
    """The buckets fill in the hooks' order with overlap_comm as without (the same calls), the peak model holds at
    stage 2 (two buffers) and stage 3 (its one kept bucket: overlap_comm moves its reduce-scatters to a side stream,
    none on a CPU), on every rank."""
    n = 3 if stage == 2 else 2
    r = cell(*ON, f"strategy.stage={stage}", f"world_size={n}", "strategy.bucket_cap_mb=0.01", *LLAMA,
             base=("logger=none", f"steps={STEPS}", *WINDOWS))
    _plan_ok(r)
    op, coll = "reduce_scatter" if stage == 3 else "all_reduce", r.summary["collectives"]
    # 21 buckets (at N=3 a bucket's slices past the size limit make more all_reduce calls: predicted, measured)
    assert coll["check"] == "PASS" and coll["counts"][op] == coll["expected_counts"][op] >= 21


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_below_2_refuse_it_naming_the_key(compose, stage):
    from zeroexp.config.schemas import validate

    with pytest.raises(ConfigError, match="strategy.overlap_comm") as e:
        validate(compose(*ON, f"strategy.stage={stage}", "world_size=2"))
    assert e.value.key == "strategy.overlap_comm"


def test_ipg_buffers_follow_the_stage_and_the_knob():
    on, off = PlanKnobs(overlap_comm=True), PlanKnobs()
    # stage 1 with it is refused (a planner's stage-1 row is planned without it); stage 3's one bucket is kept
    assert [ipg_buffers(s, on) for s in (1, 2, 3)] == [1, 2, 1] and [ipg_buffers(s, off) for s in (1, 2, 3)] == [1] * 3


def test_stage2_buckets_overlap_backward_each_waited_when_the_next_is_reduced():
    """Three buckets of a 12-Linear stack: under overlap_comm each bucket's all_reduce is issued when it is full and
    needed when the next one is reduced (the last at backward's end, the norm's with it); without, no slot (every
    call exposed at backward's end). Stage 3 in six buckets: each reduce-scatter needed when the third bucket after it
    is reduced (DeepSpeed's two reductions in flight), the last three at backward's end."""
    shape = _stack()
    knobs = PlanKnobs(bucket_cap_bytes=4 * 4 * 4096, overlap_comm=True)
    layout = LAYOUTS["deepspeed_stage2"]
    groups = derive_groups("deepspeed_stage2", layout, shape, 2, 4, knobs)
    assert [sum(b) for b in groups.buckets] == [16384] * 3
    slots, rule = collective_slots(layout, groups, "pre", 1.0, 3.0, 0.5, knobs)
    buckets = [s for s in slots if s.weight > 1]
    assert [s.issue_s for s in buckets] == [2.0, 3.0, 4.0] and [s.need_s for s in buckets] == [3.0, 4.0, 4.0]
    assert [(s.op, s.issue_s, s.need_s) for s in slots if s.weight == 1] == [("all_reduce", 4.0, 4.0)]
    assert collective_slots(layout, groups, "pre", 1.0, 3.0, 0.5, PlanKnobs(bucket_cap_bytes=4 * 4 * 4096))[0] == []
    six = PlanKnobs(bucket_cap_bytes=2 * 4 * 4096, overlap_comm=True)
    stage3 = derive_groups("deepspeed_stage3", LAYOUTS["deepspeed_stage3"], shape, 2, 4, six)
    assert len(stage3.buckets) == 6
    s3, _ = collective_slots(LAYOUTS["deepspeed_stage3"], stage3, "pre", 1.0, 3.0, 0.5, six)
    assert {s.op for s in s3} == {"reduce_scatter"} and [s.issue_s for s in s3] == [1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    assert [s.need_s for s in s3] == [3.0, 3.5, 4.0, 4.0, 4.0, 4.0]


def test_a_cpu_places_its_reductions_as_without_it():
    """DeepSpeed's CPU accelerator has no streams: the same step with overlap_comm as without on a CPU network that
    overlaps (a calibration with cores to spare), hidden reductions on the same network as a GPU's."""
    from dataclasses import replace

    from omegaconf import OmegaConf

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.formulas import step_collectives
    from zeroexp.plan.network import network_of, predict_on

    gpu = network_of(OmegaConf.load(f"{CONF_DIR}/network/h100_ib.yaml"), "bf16", 1)
    cpu = replace(gpu, device="cpu", overlap=True)
    knobs = PlanKnobs(bucket_cap_bytes=2 * 4 * 4096)
    layout = LAYOUTS["deepspeed_stage2"]
    groups = derive_groups("deepspeed_stage2", layout, _stack(), 8, 2, knobs)
    assert step_collectives(layout, groups, 2, knobs)["all_reduce"]["count"] > 2
    step = {(net.device, on): predict_on(net, layout, groups, 2, replace(knobs, overlap_comm=on), 4, 8).step_s
            for net in (gpu, cpu) for on in (False, True)}
    assert step["cpu", True] == step["cpu", False] and step["cuda", True] < step["cuda", False]


def _plan(*overrides: str) -> list[dict]:
    from zeroexp.cli.plan import register, run
    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="plan", overrides=["model=gpt", "world_size=8", "batch_size=8",
                                                           "network=h100_ib", "precision=bf16", "bucket_cap_mb=0.5",
                                                           *overrides])
    return run(cfg)[0]


def test_the_planner_overlaps_the_reductions_and_doubles_stage2s_bucket():
    """On an H100 node: the same calls and communication time, less of it exposed at stages 2 and 3; stage 2's term
    model holds two buckets in backward; a stage-1 row of the list is planned as without it (its cell refuses it), and
    a stage-1 cell's overlap_comm is refused by the planner too."""
    rows = ("strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]",)
    off, on = ({r["strategy"]: r for r in _plan(*rows, f"overlap_comm={v}")} for v in ("false", "true"))
    for name in ("deepspeed_stage2", "deepspeed_stage3"):
        assert on[name]["counts"] == off[name]["counts"] and on[name]["comm_ms"] == off[name]["comm_ms"]
        assert on[name]["exposed_comm_ms"] < off[name]["exposed_comm_ms"] and on[name]["step_ms"] < off[name]["step_ms"]
    stage1 = ("peak_bytes", "phase_bytes", "ds_peak", "step_ms", "exposed_comm_ms")
    assert {k: on["deepspeed_stage1"][k] for k in stage1} == {k: off["deepspeed_stage1"][k] for k in stage1}
    bucket = deepspeed_reduce_bucket_numel(2**19) * 2
    assert off["deepspeed_stage2"]["ds_peak"]["moments"]["backward"]["bucket"] == bucket
    assert on["deepspeed_stage2"]["ds_peak"]["moments"]["backward"]["bucket"] == 2 * bucket
    assert on["deepspeed_stage3"]["ds_peak"]["moments"] == off["deepspeed_stage3"]["ds_peak"]["moments"]
    with pytest.raises(ConfigError, match="overlap_comm"):
        _plan("strategy=deepspeed", "strategy.stage=1", "strategy.overlap_comm=true")
    with pytest.raises(ConfigError, match="true or false"):
        _plan(*rows, "overlap_comm=3")


def test_recommend_searches_it_and_prints_a_command_that_runs_as_printed(compose):
    """DeepSpeed's stage 2-3 rows with overlap_comm and without: with it faster on an H100 node (its reductions
    hidden behind backward), so the answer's first DeepSpeed configuration runs it, and its command line composes
    and validates as a cell; a stage-1 cell's overlap_comm is refused by the recommender as by a cell."""
    import shlex

    from zeroexp.cli.recommend import register as register_recommend, run as recommend
    from zeroexp.cli.run import CONF_DIR
    from zeroexp.config.schemas import validate

    register_recommend()
    given = ["model=gpt", "world_size=8", "network=h100_ib", "global_batch=64", "precisions=[bf16]",
             "recommend.strategies=[deepspeed_stage2,deepspeed_stage3]", "recommend.activation_checkpointing=[none]",
             "recommend.bucket_cap_mb=[0.5]", "recommend.top_k=2"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        answer = recommend(hydra_compose(config_name="recommend", overrides=given))
    first = answer["recommendations"][0]
    assert "strategy.overlap_comm=true" in first["overrides"] and first["config"].endswith("overlap_comm")
    args = shlex.split(first["command"])[3:]  # python -m zeroexp ...
    validate(compose(*args, base=()))
    with pytest.raises(ConfigError, match="overlap_comm"), initialize_config_dir(config_dir=CONF_DIR,
                                                                                 version_base="1.3"):
        recommend(hydra_compose(config_name="recommend", overrides=[
            *given[:-4], "strategy=deepspeed", "strategy.stage=1", "strategy.overlap_comm=true"]))
