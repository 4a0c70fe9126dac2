"""``activation_checkpointing=none|full|selective_layer|selective_op``: which units each checkpoints, what the policy
keeps, what a forward keeps and a step recomputes by mode (the planner's figures against the traced step), the keys
refused where they do not apply, and cells of foreign models under each mode with every check PASS or n/a."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from zeroexp.errors import ConfigError
from zeroexp.formulas.peak.checkpointing import (FULL, NONE, SAVE_OPS, Checkpointing, checkpointed_forward_bytes,
                                                 checkpointing_of)
from conftest import STEPS, WINDOWS, compose_config, held_checks
from test_recommend import _compose

HF = importlib.util.find_spec("transformers") is not None
LLAMA = ("model=llama3_8b", "model.num_hidden_layers=4", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
MIXTRAL = ("model=mixtral_8x7b", "model.num_hidden_layers=2", "model.hidden_size=32", "model.intermediate_size=64",
           "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.vocab_size=64", "model.seq_len=8",
           "model.num_local_experts=2")
SELECTIVE = ("selective_layer", "selective_op")


def test_which_units_each_mode_checkpoints():
    units = ["h.0", "h.1", "h.2", "h.3", "h.4", "root"]
    assert NONE.chosen(units) == () and FULL.chosen(units) == tuple(units[:5])
    # torchtitan's layer SAC: the units whose 1-based index is a multiple of k
    assert Checkpointing("selective_layer", every=2).chosen(units) == ("h.1", "h.3")
    assert Checkpointing("selective_layer", every=3).chosen(units) == ("h.2",)
    assert Checkpointing("selective_op").chosen(units) == tuple(units[:5])
    assert not NONE and FULL and Checkpointing("selective_op")


def test_the_policy_saves_every_other_matmul_and_attention_never_a_collective():
    op = Checkpointing("selective_op")
    assert [op.saves("mm", i) for i in (1, 2, 3, 4)] == [True, False, True, False]
    assert op.saves("_scaled_dot_product_flash_attention_for_cpu", 2) and op.saves("bmm", 1)
    assert not op.saves("add", 1) and not op.saves("all_gather_into_tensor", 1)
    assert all(Checkpointing("selective_op", matmul_recompute_every=0).saves("mm", i) for i in (1, 2, 3))


def test_a_node_reads_its_modes_keys_and_the_defaults_of_its_yaml(compose):
    assert checkpointing_of(compose("activation_checkpointing=selective_layer").activation_checkpointing) == \
        Checkpointing("selective_layer", every=2)
    op = checkpointing_of(compose("activation_checkpointing=selective_op").activation_checkpointing)
    assert op == Checkpointing("selective_op", save_ops=SAVE_OPS, matmul_recompute_every=2) and op.label == \
        "selective_op"
    # a key of another mode (a sweep over modes sets it for them) does not apply
    assert checkpointing_of({"name": "selective_op", "every": 3}) == op
    assert checkpointing_of({"name": "selective_layer", "every": 3}).label == "selective_layer-every3"


@pytest.mark.parametrize("overrides, key", [
    (("activation_checkpointing=full", "activation_checkpointing.every=2"), "activation_checkpointing.every"),
    (("activation_checkpointing=selective_layer", "activation_checkpointing.every=0"),
     "activation_checkpointing.every"),
    (("activation_checkpointing=selective_op", "activation_checkpointing.save_ops=[mm,not_an_op]"),
     "activation_checkpointing.save_ops"),
    (("activation_checkpointing=selective_layer", "activation_checkpointing.save_ops=[mm]"),
     "activation_checkpointing.save_ops")])
def test_a_key_that_does_not_apply_or_a_bad_value_is_refused_naming_it(compose, overrides, key):
    from zeroexp.cli.run import explicit_keys
    from zeroexp.config.schemas import validate

    with pytest.raises(ConfigError) as e:
        validate(compose(*overrides), explicit_keys(list(overrides)))
    assert e.value.key == key


def test_the_runtime_wraps_the_units_the_mode_names():
    from zeroexp.models import LinearStack, checkpoint_units

    for mode, wrapped in ((FULL, 4), (Checkpointing("selective_layer", every=2), 2),
                          (Checkpointing("selective_layer", every=3), 1), (Checkpointing("selective_op"), 4)):
        net = LinearStack(8, 4)
        checkpoint_units(net, (nn.Linear,), mode)
        kinds = [type(m).__name__ for m in net]
        assert kinds.count("CheckpointWrapper") == wrapped, (mode, kinds)
        if mode.mode == "selective_layer":
            assert [k == "CheckpointWrapper" for k in kinds] == [mode.checkpointed(i) for i in range(4)]


def test_a_selective_step_computes_the_plain_steps_gradients():
    """The policy changes what is kept, never what is computed: every gradient equal to the step without it."""
    from zeroexp.models import checkpoint_units
    from zeroexp.models.gpt import GPT, Block

    grads = []
    for mode in (NONE, Checkpointing("selective_op"), Checkpointing("selective_layer", every=2)):
        torch.manual_seed(0)
        net = GPT(vocab_size=32, seq_len=8, n_layer=2, n_embd=16, n_head=2)
        checkpoint_units(net, (Block,), mode)
        x = torch.randint(0, 32, (2, 8))
        net(x).float().logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


def _kept(*overrides: str) -> tuple[dict, dict]:
    """Per mode: the planner's forward figure (activation_bytes) and the traced step's activations at the loss."""
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.row_peak import activation_bytes
    from zeroexp.plan.steptrace import trace_step

    figure, traced = {}, {}
    for ac in ("none", "full", *SELECTIVE):
        cfg = compose_config([*overrides, f"activation_checkpointing={ac}"])
        mode = checkpointing_of(cfg.activation_checkpointing)
        wrap = [import_class(p) for p in wrap_paths(cfg)]
        figure[ac] = activation_bytes(cfg.model, 2, wrap, "float32", mode)
        at_loss = [s for s in trace_step(cfg.model, 2, wrap, checkpointing=mode).segments if s.phase == "forward"][-1]
        traced[ac] = at_loss.end_by_category["activations"]
    return figure, traced


def test_what_a_forward_keeps_by_mode_is_what_the_traced_step_holds():
    """What each mode saves against none's: the planner's per-unit figures (the forward traced once, the policy
    counted per unit) give what the checkpointed step traced on fake tensors holds at its loss, to the byte on the
    GPT; on a shrunk Llama, whose rotary tables every layer takes as an input, within 1 %."""
    figure, traced = _kept("model=gpt")
    assert {ac: figure["none"] - figure[ac] for ac in figure} == {ac: traced["none"] - traced[ac] for ac in traced}
    if HF:
        figure, traced = _kept(*LLAMA)
        for ac in ("full", *SELECTIVE):
            saved, held = figure["none"] - figure[ac], traced["none"] - traced[ac]
            assert abs(saved - held) <= 0.01 * held, (ac, saved, held)
    assert traced["full"] < min(traced[ac] for ac in SELECTIVE) <= max(traced[ac] for ac in SELECTIVE) < traced["none"]


def test_the_recompute_counts_what_each_mode_reruns():
    """FLOPs through torch's checkpoint: selective_layer every 2nd of 4 blocks recomputes half of full's; the
    policy's saved matmuls and attention are not rerun, so selective_op recomputes less than full, more than none."""
    from zeroexp.models.gpt import Block
    from zeroexp.plan.flops import recompute_share, step_flops

    model = compose_config(["model=gpt"]).model
    bare, full = step_flops(model, 2, (Block,)), step_flops(model, 2, (Block,), FULL)
    layer = step_flops(model, 2, (Block,), Checkpointing("selective_layer", every=2))
    assert 2 * (layer - bare) == full - bare
    share = recompute_share(model, 2, (Block,), Checkpointing("selective_op"))
    assert 0 < share < 1
    assert recompute_share(model, 2, (Block,), FULL) == 1.0


def test_the_formula_counts_inputs_and_policy_only_for_checkpointed_units():
    units, inputs, kept = {"a": 100, "b": 100, "root": 7}, {"a": 10, "b": 10}, {"a": 30, "b": 30}
    assert checkpointed_forward_bytes(300, units, inputs, FULL) == 300 - 200 + 20
    assert checkpointed_forward_bytes(300, units, inputs, Checkpointing("selective_layer", every=2),
                                      units=["a", "b"]) == 300 - 100 + 10
    assert checkpointed_forward_bytes(300, units, inputs, Checkpointing("selective_op"), kept) == 300 - 200 + 80


def test_plan_and_recommend_take_each_mode_and_print_commands_that_compose_to_it(compose):
    """The planner answers every mode with a peak model; recommend's command for a mode with keys carries them, and
    composes to the same option."""
    from zeroexp.config.checkpointing import overrides_of
    from zeroexp.cli.plan import run
    from zeroexp.recommend.space import Config, run_overrides

    for ac in SELECTIVE:
        cfg = _compose("plan", "model=gpt", "world_size=2", "batch_size=2", f"activation_checkpointing={ac}",
                       "strategies=[fsdp2_full]")
        records, _ = run(cfg)
        assert records[0]["peak_bytes"] and not records[0].get("peak_note")
        assert records[0]["activation_checkpointing"] == checkpointing_of(cfg.activation_checkpointing).label
    mode = Checkpointing("selective_layer", every=3)
    assert overrides_of(mode) == ["activation_checkpointing=selective_layer", "activation_checkpointing.every=3"]
    printed = run_overrides(Config("fsdp2_full", "bf16", "none", mode, 1, 1), ["model=gpt"], 2)
    assert checkpointing_of(compose(*printed, base=()).activation_checkpointing) == mode


CELLS = [pytest.param(("model=gpt", "strategy=zero2", "activation_checkpointing=selective_op", "world_size=3"),
                      id="gpt-zero2-selective_op-n3"),
         pytest.param((*LLAMA, "strategy=fsdp2_full", "activation_checkpointing=selective_op", "precision=bf16",
                       "world_size=2"), id="llama-fsdp2-selective_op-bf16-n2",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed")),
         pytest.param((*MIXTRAL, "strategy=fsdp_full", "activation_checkpointing=selective_layer", "world_size=3"),
                      id="mixtral-fsdp_full-selective_layer-n3",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed")),
         pytest.param((*LLAMA, "strategy=deepspeed", "strategy.stage=2", "activation_checkpointing=selective_layer",
                       "precision=bf16", "world_size=2"), id="llama-deepspeed2-selective_layer-bf16-n2",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed"))]


@pytest.mark.parametrize("overrides", CELLS)
def test_a_selective_cell_holds_every_check_and_its_peak(cell, overrides):
    r = cell(*overrides, base=("logger=none", f"steps={STEPS}", *WINDOWS))
    checks = held_checks(r)
    assert {"state", "collectives", "equivalence", "plan.state", "plan.memory"} <= {
        n for n, c in checks.items() if c.verdict == "PASS"}
