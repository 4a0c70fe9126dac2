"""DeepSpeed stage 3's fetch and release schedule (zeroexp/formulas/deepspeed_fetch.py): the coordinator replayed on
given calls, the strategy.stage3_* keys refused where they do not apply, and cells beyond one prefetch bucket and
under activation checkpointing whose plan checks all pass."""

from __future__ import annotations

import pytest
from conftest import STEPS, WINDOWS

from zeroexp.cell.strategy import check_ds_stage3_limits
from zeroexp.errors import ConfigError
from zeroexp.formulas.deepspeed import DS_MAX_REUSE_DISTANCE, ds_stage3_limits
from zeroexp.formulas.deepspeed_fetch import ModuleCall, ds_stage3_events, ds_stage3_schedule
from zeroexp.strategies import deepspeed as ds_adapter

#: The engine's root (no parameters of its own), a Sequential inside it, 8 Linear(64, 64) without bias in it.
CHAIN = (ModuleCall(0, (), False, True, 0), ModuleCall(1, (), False, True, 1),
         *(ModuleCall(2 + i, (i,), i > 0, True, 2) for i in range(8)))
NUMELS = (4096,) * 8


def _schedule(calls=CHAIN, prefetch=50_000_000, live=1_000_000_000, persistence=0, reuse=DS_MAX_REUSE_DISTANCE,
              recomputed=frozenset()):
    return ds_stage3_schedule(calls, NUMELS, prefetch_bucket=prefetch, max_live=live, persistence=persistence,
                              max_reuse=reuse, recomputed=recomputed)


def test_hooks_nest_forward_and_mirror_in_backward():
    calls = CHAIN[:4]  # root > Sequential > Linear 0 (its input the batch), Linear 1
    assert ds_stage3_events(calls) == [
        ("forward", 0, True), ("forward", 1, True), ("forward", 2, True), ("forward", 2, False),
        ("forward", 3, True), ("forward", 3, False), ("forward", 1, False), ("forward", 0, False),
        # backward: an output's pre-backward hook before those nested in it; a post-backward hook only where the
        # call's input needs a gradient (Linear 1's; not Linear 0's, on the batch, nor the containers')
        ("backward", 0, True), ("backward", 1, True), ("backward", 3, True), ("backward", 3, False),
        ("backward", 2, True)]


def test_the_prefetch_bucket_cuts_the_forward_gathers():
    # One bucket holds the model: the root's fetch prefetches every parameter in one all_gather, none released.
    assert _schedule().gathers == (tuple(range(8)),)
    # 10000 elements: each prefetch pops the queue until 3 x 4096 >= 10000; the root's, the Sequential's and Linear
    # 0's fetches each prefetch one bucket (measured: 3 all_gathers of 131072 B in all, the mlp at N=2).
    assert _schedule(prefetch=10_000).gathers == ((0, 1, 2), (3, 4, 5), (6, 7))
    # No prefetch room (max_live 0): each Linear is gathered by its own fetch; nothing is released before backward
    # (every parameter is used again within the reuse distance), so backward gathers none.
    schedule = _schedule(live=0)
    assert schedule.gathers == tuple((i,) for i in range(8))
    assert not any(e.released for e in schedule.events if e.phase == "forward")


def test_the_flat_buffer_lives_until_its_last_parameter_is_fetched():
    schedule = _schedule(prefetch=10_000)
    forward = [e for e in schedule.events if e.phase == "forward"]
    first = next(e for e in forward if e.fetch and e.call == 2)  # Linear 0: the first wait makes gather 0's tensors
    # at its highest after its own prefetch (gather 2): gathers 0 (parameters 1 and 2 still in flight) and 1 (the
    # Sequential's prefetch) still held
    assert first.peak == (frozenset({0, 1, 2}), (0, 1, 2))
    assert first.whole == frozenset({0, 1, 2}) and first.flats == (0, 1, 2)
    linear2 = next(e for e in forward if e.fetch and e.call == 4)  # Linear 2, gather 0's last parameter
    assert 0 not in linear2.flats


def test_beyond_the_reuse_distance_a_parameter_is_released_and_gathered_again():
    # A reuse distance of one Linear: each Linear's parameter is released after its forward unless the next module
    # of the trace uses it (Linear 7's: its backward comes next), and fetched again by its backward hook.
    schedule = _schedule(live=0, reuse=4096)
    assert sum(len(g) for g in schedule.gathers) == 8 + 7
    released = [p for e in schedule.events if e.phase == "forward" for p in e.released]
    assert released == list(range(7))
    # persistent parameters are never released
    assert not any(e.released for e in _schedule(live=0, reuse=4096, persistence=4096).events)


def test_a_checkpointed_unit_recompute_gathers_again_and_holds_both_copies():
    # root > Block (checkpointed) > Linear 0, Linear 1; no prefetch room, a reuse distance of one Linear
    calls = (ModuleCall(0, (), False, True, 0), ModuleCall(1, (), True, True, 1),
             ModuleCall(2, (0,), True, True, 2), ModuleCall(3, (1,), True, True, 2))
    plain = _schedule(calls, live=0, reuse=4096)
    assert plain.gathers == ((0,), (1,), (0,))  # Linear 0 released after forward, gathered again in backward
    schedule = _schedule(calls, live=0, reuse=4096, recomputed=frozenset({1}))
    # the pre-backward hooks of the Block and of its last call, Linear 1, fire first; then the Block's forward again,
    # stopping inside Linear 1 (every saved tensor made again): Linear 0 gathered and released, Linear 1 still held
    assert [(p, k, f) for p, k, f in ds_stage3_events(calls, frozenset({1})) if p != "forward"] == [
        ("backward", 0, True), ("backward", 1, True), ("backward", 3, True),
        ("recompute", 1, True), ("recompute", 2, True), ("recompute", 2, False), ("recompute", 3, True),
        ("backward", 3, False), ("backward", 2, True), ("backward", 2, False), ("backward", 1, False)]
    assert schedule.gathers == ((0,), (1,), (0,), (0,))
    # the recompute's gather (2) stays held by its saved tensors while Linear 0's pre-backward gathers it again (3)
    fetch = next(e for e in schedule.events if e.phase == "backward" and e.fetch and e.call == 2)
    assert fetch.flats == (2,) and fetch.whole == frozenset({0})
    assert not next(e for e in schedule.events if e.phase == "backward" and not e.fetch and e.call == 2).flats


def test_the_stage3_keys_are_refused_below_stage_3_and_out_of_range():
    check_ds_stage3_limits({"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": None}, 3)
    with pytest.raises(ConfigError, match="strategy.stage3_max_live_parameters=-1"):
        check_ds_stage3_limits({"stage3_max_live_parameters": -1}, 3)
    with pytest.raises(ConfigError, match="strategy.stage3_prefetch_bucket_size=True"):
        check_ds_stage3_limits({"stage3_prefetch_bucket_size": True}, 3)
    with pytest.raises(ConfigError, match="strategy.stage=2"):
        check_ds_stage3_limits({"stage3_prefetch_bucket_size": 10}, 2)
    check_ds_stage3_limits({"stage3_prefetch_bucket_size": None}, 2)  # unset: nothing to refuse
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshold=1.5"):  # the planner's flat key
        check_ds_stage3_limits({"stage3_param_persistence_threshold": 1.5}, None, prefix="")
    with pytest.raises(ConfigError, match="strategy.stage3_max_reuse_distance=-1"):
        check_ds_stage3_limits({"stage3_max_reuse_distance": -1}, 3)
    with pytest.raises(ConfigError, match="strategy.stage3_max_reuse_distance=4096.*strategy.stage=2"):
        check_ds_stage3_limits({"stage3_max_reuse_distance": 4096}, 2)


def test_the_reuse_distance_reaches_the_ds_config():
    # null: DeepSpeed 0.19's default (runtime/zero/config.py max_reuse_distance, 1e9), written out as the others are
    assert ds_stage3_limits().ds_config()["stage3_max_reuse_distance"] == DS_MAX_REUSE_DISTANCE == 1_000_000_000
    assert ds_stage3_limits(max_reuse=4096).ds_config()["stage3_max_reuse_distance"] == 4096


needs_deepspeed = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                     reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

LLAMA = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
GPT = ("model=gpt", "model.n_layer=2")
MODEL_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)  # conftest's BASE without the mlp's width


@needs_deepspeed
def test_a_persistent_parameter_is_refused_by_name(compose):
    from zeroexp.errors import InvalidCell
    from zeroexp.plan.shape import model_shape

    cfg = compose("strategy=deepspeed", "strategy.stage=3", "world_size=2", "model.depth=4",
                  "strategy.stage3_param_persistence_threshold=5000")
    with pytest.raises(InvalidCell, match="stage3_param_persistence_threshold=5000.*unsharded through the step"):
        ds_adapter.DeepSpeedAdapter.validate_model(cfg, model_shape(cfg.model, ()))
    # below the smallest parameter (4096 elements) nothing is persistent: the cell runs as plain stage 3
    cfg = compose("strategy=deepspeed", "strategy.stage=3", "world_size=2", "model.depth=4",
                  "strategy.stage3_param_persistence_threshold=4095")
    ds_adapter.DeepSpeedAdapter.validate_model(cfg, model_shape(cfg.model, ()))


@needs_deepspeed
@pytest.mark.parametrize("overrides,gathers", [
    # GPT (wte, wpe, 2 blocks, ln_f; lm_head tied) beyond one prefetch bucket, fp32 at N=2 and under full
    # checkpointing in bf16 at N=3: the recompute finds every parameter still gathered
    ((*GPT, "world_size=2", "strategy.stage3_prefetch_bucket_size=10000"), 8),
    ((*GPT, "world_size=3", "precision=bf16", "activation_checkpointing=full",
      "strategy.stage3_prefetch_bucket_size=10000"), 8),
    # the shrunk Llama (its modules called in another order than defined) with a live-parameter limit: the prefetch
    # stops once 20000 elements are live; bf16 under selective_op at N=3, fp32 under full at N=2
    ((*LLAMA, "world_size=3", "precision=bf16", "activation_checkpointing=selective_op",
      "strategy.stage3_max_live_parameters=20000"), 19),
    ((*LLAMA, "world_size=2", "activation_checkpointing=full", "strategy.stage3_prefetch_bucket_size=5000"), 12),
])
def test_stage3_cells_beyond_one_bucket_pass_every_plan_check(cell, overrides, gathers):
    res = cell("strategy=deepspeed", "strategy.stage=3", *overrides, base=MODEL_BASE)
    assert res.status == "ok", res.error
    plan = res.summary["plan"]
    assert (plan["check"], plan["payload_check"]) == ("PASS", "PASS"), (plan["reasons"], plan["payload_reasons"])
    for part in ("state", "calls", "groups", "memory"):
        assert plan[part]["check"] == "PASS", (part, plan[part]["reasons"])
    assert plan["time"]["check"] == "PASS" or plan["time"]["reason_codes"], plan["time"]
    measured = res.summary["collectives"]["counts"]["all_gather"]
    planned = {c["op"]: c for c in plan["collectives"]}["all_gather"]
    assert planned["predicted_count"] == measured and planned["predicted_bytes"] == planned["measured_bytes"]
    assert measured == gathers


def _gathering_again(cell, gathers: int, *overrides: str) -> dict:
    """A stage-3 cell at a reuse distance of 1000 elements: it ran, its plan's state, calls, groups and memory PASS,
    and its all_gathers are ``gathers``, planned as measured (count and bytes); its plan section."""
    res = cell("strategy=deepspeed", "strategy.stage=3", *overrides, "strategy.stage3_max_reuse_distance=1000",
               base=MODEL_BASE)
    assert res.status == "ok", res.error
    plan = res.summary["plan"]
    for part in ("state", "calls", "groups", "memory"):
        assert plan[part]["check"] == "PASS", (part, plan[part]["reasons"])
    measured = res.summary["collectives"]["counts"]["all_gather"]
    planned = {c["op"]: c for c in plan["collectives"]}["all_gather"]
    assert planned["predicted_count"] == measured == gathers
    assert planned["predicted_bytes"] == planned["measured_bytes"]
    return plan


@needs_deepspeed
@pytest.mark.parametrize("overrides,gathers", [
    # no prefetch and a reuse distance of 1000 elements: each module's parameters are released after its forward
    # (__params_to_release) and gathered again by its pre-backward hook; the GPT fp32 at N=2 (measured 31
    # all_gathers, 1013760 B; every phase's peak within 8 bytes), the shrunk Llama in bf16 at N=3 (41, 394620 B)
    ((*GPT, "world_size=2"), 31),
    ((*LLAMA, "world_size=3", "precision=bf16"), 41),
])
def test_stage3_cells_gathering_again_in_backward_pass_every_plan_check(cell, overrides, gathers):
    plan = _gathering_again(cell, gathers, *overrides, "strategy.stage3_prefetch_bucket_size=0")
    backward = plan["memory"]["phases"]["backward"]
    assert abs(backward["predicted_bytes"] - backward["measured_bytes"]) <= 16, backward


@needs_deepspeed
@pytest.mark.parametrize("overrides,gathers,gap", [
    # as above under full checkpointing: each block's recompute gathers its modules again but the last (whose
    # pre-backward hook fired before it), their pre-backward hooks once more; measured on the GPT fp32 at N=2 41
    # all_gathers (1282048 B; 31 without checkpointing), backward 264 B above the prediction; on the shrunk Llama bf16
    # at N=3 57 (509868 B), within 12 B; with a prefetch bucket of 10000 (each checkpoint wrapper's call a prefetch of
    # its own) the GPT in bf16 at N=3 9 (274284 B), within 8 B. The GPT fp32 cell's residual varies between runs of
    # the same cell (264 B in most; 1,032 B and 66,824 B in some): one module's gathered parameters
    # (c_attn's bias, 768 B; the mlp's c_fc, (64 x 256 + 256) x 4 = 66,560 B) are still alive at the backward peak in
    # those runs, not yet placed; the bound allows the largest such module, c_fc's full weight and bias
    ((*GPT, "world_size=2", "strategy.stage3_prefetch_bucket_size=0"), 41, 264 + (64 * 256 + 256) * 4),
    ((*LLAMA, "world_size=3", "precision=bf16", "strategy.stage3_prefetch_bucket_size=0"), 57, 12),
    ((*GPT, "world_size=3", "precision=bf16", "strategy.stage3_prefetch_bucket_size=10000"), 9, 8),
])
def test_stage3_recompute_gathering_again_passes_every_plan_check(cell, overrides, gathers, gap):
    plan = _gathering_again(cell, gathers, *overrides, "activation_checkpointing=full")
    assert all(r["check"] == "PASS" for r in plan["memory"]["ranks"])
    for r in plan["memory"]["ranks"]:
        assert 0 <= r["backward"]["measured_bytes"] - r["backward"]["predicted_bytes"] <= gap, r


def test_the_planner_reads_the_stage3_keys_as_a_cell_does():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.plan import register, run
    from zeroexp.cli.run import CONF_DIR

    def plan(*overrides: str) -> dict:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose(config_name="plan", overrides=["model=mlp", "model.width=64", "world_size=2",
                                                               *overrides])
        return run(cfg)[0][0]

    register()
    # the mlp's 8 Linear(64, 64) (bias-free), a 10000-element prefetch bucket: 3 all_gathers (the cell's measured)
    assert plan("strategies=[deepspeed_stage3]", "stage3_prefetch_bucket_size=10000")["counts"]["all_gather"] == 3
    as_cell = plan("strategy=deepspeed", "strategy.stage=3", "strategy.stage3_prefetch_bucket_size=10000")
    assert as_cell["counts"]["all_gather"] == 3
    assert plan("strategies=[deepspeed_stage3]")["counts"]["all_gather"] == 1  # one bucket: the root's prefetch
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshold=4096"):
        plan("strategies=[deepspeed_stage3]", "stage3_param_persistence_threshold=4096")
    # a reuse distance of one Linear and no prefetch room: each Linear but the last is released after its forward and
    # gathered again in backward, 8 + 7 all_gathers (the replay's, test_beyond_the_reuse_distance_...); as a cell's key
    # too; within one prefetch bucket the root's prefetch pops every use, so nothing is released
    reuse = ("stage3_max_reuse_distance=4096", "stage3_max_live_parameters=0")
    assert plan("strategies=[deepspeed_stage3]", *reuse)["counts"]["all_gather"] == 15
    as_cell = plan("strategy=deepspeed", "strategy.stage=3", *(f"strategy.{k}" for k in reuse))
    assert as_cell["counts"]["all_gather"] == 15
    assert plan("strategies=[deepspeed_stage3]", reuse[0])["counts"]["all_gather"] == 1
    with pytest.raises(ConfigError, match="stage3_max_reuse_distance=-1"):
        plan("strategies=[deepspeed_stage3]", "stage3_max_reuse_distance=-1")


def test_a_parameter_gathered_again_has_a_peak_under_every_checkpointing_mode():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.plan import register, run
    from zeroexp.cli.run import CONF_DIR

    def plan(*overrides: str) -> dict:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = hydra_compose(config_name="plan", overrides=[*GPT, "world_size=2", "batch_size=8",
                                                               "strategies=[deepspeed_stage3]",
                                                               "stage3_max_reuse_distance=1000",
                                                               "stage3_prefetch_bucket_size=0", *overrides])
        return run(cfg)[0][0]

    register()
    # released after forward, gathered again by the pre-backward hooks: 31 all_gathers (the cell's measured) and a peak
    plain = plan()
    assert plain["counts"]["all_gather"] == 31 and plain["peak_bytes"]
    # under full checkpointing the recompute gathers each block's modules again, all but its last: 41 (the cell's)
    recomputed = plan("activation_checkpointing=full")
    assert recomputed["counts"]["all_gather"] == 41 and recomputed["peak_bytes"]
    # selective_layer checkpoints the second block alone: its recompute alone gathers again, 36 (the cell's measured);
    # selective_op each block, as full
    assert plan("activation_checkpointing=selective_layer")["counts"]["all_gather"] == 36
    selective = plan("activation_checkpointing=selective_op")
    assert selective["counts"]["all_gather"] == 41 and selective["peak_bytes"]
