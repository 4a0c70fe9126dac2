"""Activations traced, not guessed: one forward at the per-rank batch under FakeTensorMode, what
autograd saves per FSDP unit, plus the output and the loss; the planner's ``batch_size`` column."""

from __future__ import annotations

import pytest
import torch

from zeroexp.models.gpt import Block
from zeroexp.plan.activations import korthikanti_layer_bytes, trace_activations

MLP = {"_target_": "zeroexp.models.LinearStack", "width": 64, "depth": 8, "input_shape": [64], "dtype": "float32",
       "loss": "mean_square"}
GPT = {"_target_": "zeroexp.models.gpt.GPT", "vocab_size": 256, "seq_len": 32, "n_layer": 2, "n_head": 4, "n_embd": 64,
       "bias": True, "tie_weights": True, "input_shape": [32], "dtype": "long", "low": 0, "high": 256,
       "loss": "next_token"}


def test_a_linear_stack_saves_each_layers_input():
    b = 8
    trace = trace_activations(MLP, b, [torch.nn.Linear])
    # each Linear saves its input (b x 64 fp32), not its weight; the loss's square saves the last output
    assert trace.unit_bytes == {**{str(i): b * 64 * 4 for i in range(8)}, "root": b * 64 * 4}
    assert trace.held_bytes == 4  # the loss (the output is saved already: counted once)
    assert trace.total_bytes == 9 * b * 64 * 4 + 4


def test_gpt_activations_are_linear_in_the_batch_and_per_block():
    t4, t8, t12 = (trace_activations(GPT, b, [Block]) for b in (4, 8, 12))
    assert t12.total_bytes - t8.total_bytes == t8.total_bytes - t4.total_bytes > 0
    assert list(t8.unit_bytes) == ["h.0", "h.1", "root"] and t8.unit_bytes["h.0"] == t8.unit_bytes["h.1"]
    assert t8.unit_bytes["h.0"] == 2 * t4.unit_bytes["h.0"]  # a block saves only batch-sized tensors
    bf16 = trace_activations(GPT, 8, [Block], dtype=torch.bfloat16)
    assert bf16.unit_bytes["h.0"] < t8.unit_bytes["h.0"]  # autocast: matmul inputs saved in 2 bytes


def test_korthikanti_closed_form_beside_the_trace():
    # 34 s b h + 5 a s^2 b at 2 bytes; the trace saves less here: no dropout masks, and SDPA's CPU kernel keeps a
    # logsumexp (b a s floats) where the closed form counts the s^2 probabilities and their mask
    s, b, h, a = 32, 8, 64, 4
    assert korthikanti_layer_bytes(s, b, h, a) == 34 * s * b * h + 5 * a * s * s * b
    traced = trace_activations(GPT, b, [Block]).unit_bytes["h.0"]
    assert traced < korthikanti_layer_bytes(s, b, h, a, itemsize=4)


def test_planner_reports_activations_at_the_batch(compose):
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.cli.plan import register, run

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="plan", overrides=["model=gpt", "world_size=[8,64]", "batch_size=8",
                                                           "strategies=[ddp,fsdp_full]"])
        counted = hydra_compose(config_name="plan", overrides=["params=7.5e9", "batch_size=8"])
    records, notes = run(cfg)
    acts = {r["activation_bytes"] for r in records}
    assert len(acts) == 1 and acts.pop() == trace_activations(cfg.model, 8, [Block]).total_bytes
    assert all(r["korthikanti_bytes"] for r in records)
    records, notes = run(counted)
    assert all(r["activation_bytes"] is None for r in records) and any("unknown" in n for n in notes)


def _corpus_models() -> list:
    from tests.test_corpus import MODELS

    return [pytest.param(name, overrides, marks=pytest.mark.skipif(needs is False, reason=f"{name}: not installed"))
            for name, (overrides, needs) in MODELS.items()]


@pytest.mark.parametrize("name,overrides", _corpus_models())
def test_one_fake_build_traced_at_several_batches_counts_what_fresh_builds_do(compose, name, overrides):
    """The planner's and the recommender's forwards (``zeroexp.plan.row_peak.forward_trace``) run one fake build of a
    model at every batch and autocast dtype: each trace equals the trace of a fresh build, field by field, whatever
    ran on the build before it (the batches out of order, the autocast trace between), on the corpus of foreign
    models (Hugging Face's, PyTorch's test Transformer, frozen and unused parameters, BatchNorm's buffers)."""
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.activations import fake_build

    from tests.test_corpus import BASE

    cfg = compose(*overrides, "world_size=2", base=BASE)
    wrap = [import_class(p) for p in wrap_paths(cfg)]
    for cast in (None, torch.bfloat16):
        build = fake_build(cfg.model, module_dtype=cast)
        ways = [{"module_dtype": cast}] if cast else [{}, {"dtype": torch.bfloat16}]
        for batch, way in [(3, w) for w in ways] + [(1, w) for w in ways] + [(2, w) for w in ways]:
            shared = trace_activations(cfg.model, batch, wrap, build=build, **way)
            assert shared == trace_activations(cfg.model, batch, wrap, **way), (name, batch, way)
            assert shared.total_bytes > 0


def test_the_activations_with_and_without_checkpointing_read_one_forward():
    """``activation_bytes`` with and without checkpointing: the same figures as from fresh traces, from one forward
    per batch and dtype (two below fp32: autocast's and the module cast's)."""
    from zeroexp.formulas.peak.checkpointing import checkpointed_forward_bytes
    from zeroexp.plan import row_peak

    from zeroexp.cell.memo import invocation_memo

    cfg = {**GPT, "n_layer": 3}
    with invocation_memo(fresh=True) as memo:  # an invocation of its own: what it traces, counted
        got = {ckpt: row_peak.activation_bytes(cfg, 4, [Block], "bfloat16", ckpt) for ckpt in (False, True)}
        assert len(memo["forward_traces"]) == 2
    fresh = [trace_activations(cfg, 4, [Block], dtype=torch.bfloat16),
             trace_activations(cfg, 4, [Block], module_dtype=torch.bfloat16)]
    assert got[False] == min(t.total_bytes for t in fresh)
    assert got[True] == min(checkpointed_forward_bytes(t.total_bytes, t.unit_bytes, t.unit_input_bytes)
                            for t in fresh) < got[False]
