"""``model=hf`` and its presets: Hugging Face causal LMs by architecture or local config.json, their config's fields
flat under ``model.``, built on the meta device to the parameter counts their publishers give, shrunk by plain
overrides, a typo refused naming the key; the units, token range and input follow the config."""

from __future__ import annotations

import importlib.util

import pytest

from zeroexp.errors import ConfigError
from conftest import PROBED, STEPS, WINDOWS, compose_config, held_checks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed")

#: Each preset's parameter count as its publisher's model card gives it (huggingface.co, "Model size"; Meta's, Mistral
#: AI's, Qwen's and Google's configs of the YAML's comment): the meta build must count exactly these.
PUBLISHED = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800,
             "llama2_7b": 6_738_415_616, "mistral_7b": 7_241_732_096, "qwen2_7b": 7_615_616_512,
             "mixtral_8x7b": 46_702_792_704, "gemma2_9b": 9_241_705_984}

#: A Llama 3 8B shrunk by plain overrides: 2 layers, hidden 64, grouped-query attention (4 heads, 2 K/V heads).
SHRUNK = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
          "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
LLAMA_LAYER = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)


def _numel(model_cfg) -> int:
    import torch

    from zeroexp.models import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(model_cfg).parameters())


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_a_preset_builds_to_its_published_parameter_count(preset):
    assert _numel(compose_config([f"model={preset}"]).model) == PUBLISHED[preset]


def test_a_shrunk_preset_follows_its_fields():
    """The token range is the vocabulary, a sample seq_len tokens, the unit the model's decoder layer (its
    _no_split_modules), the weights built in the precision's master dtype; a field set on the command line reaches
    the config, one left null keeps the architecture's (head_dim derived from hidden_size / heads)."""
    from zeroexp.models import token_range, wrap_paths
    from zeroexp.models.hf import hf_config

    cfg = compose_config([*SHRUNK, "precision=bf16"])
    assert token_range(cfg.model) == (0, 256) and list(cfg.model.input_shape) == [16]
    assert wrap_paths(cfg) == [LLAMA_LAYER]
    config = hf_config(cfg.model)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (64, 2, 16)
    assert str(config.dtype) == "torch.float32" and config.use_cache is False
    assert config.rope_parameters["rope_theta"] == 500000.0
    assert wrap_paths(compose_config([*SHRUNK, "strategy=fsdp_full", "strategy.wrap=[torch.nn.Linear]"])) == [
        "torch.nn.Linear"]


def test_the_architecture_alone_and_a_local_config_json(tmp_path):
    """``model=hf model.arch=...`` builds the architecture's defaults under the node's fields; ``model.config_path``
    reads a local config.json (no download), the node's fields over it, the vocabulary from the file."""
    from transformers import MistralConfig

    from zeroexp.models import token_range
    from zeroexp.models.hf import hf_config

    cfg = compose_config(["model=hf", "model.arch=qwen2", "model.num_hidden_layers=1", "model.hidden_size=32",
                          "model.intermediate_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=1",
                          "model.vocab_size=128"])
    assert type(hf_config(cfg.model)).__name__ == "Qwen2Config" and _numel(cfg.model) > 0
    MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=96).to_json_file(tmp_path / "config.json")
    cfg = compose_config(["model=hf", f"model.config_path={tmp_path / 'config.json'}", "model.num_hidden_layers=1"])
    config = hf_config(cfg.model)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("mistral", 1, 32)
    assert token_range(cfg.model) == (0, 96)
    with pytest.raises(ConfigError) as e:  # a file of another architecture
        hf_config(compose_config(["model=hf", f"model.config_path={tmp_path}", "model.arch=llama"]).model)
    assert e.value.key == "model.arch"


@pytest.mark.parametrize("override, key", [
    ("+model.hidden_sise=64", "model.hidden_sise"),  # a field the config class lacks
    ("model.arch=lama", "model.arch"),               # an architecture transformers does not know
    ("model.num_hidden_layers=0", "model.num_hidden_layers"),
    ("model.arch=null", "model.arch"),               # no architecture and no config.json
])
def test_a_bad_field_is_refused_before_launch_naming_it(override, key):
    from zeroexp.config.schemas import validate

    with pytest.raises(ConfigError) as e:
        validate(compose_config([*BASE, *SHRUNK, override, "world_size=2"]))
    assert e.value.key == key
    if key == "model.hidden_sise":
        assert "hidden_size" in str(e.value)  # the nearest field, named


def test_a_field_not_in_the_schema_is_refused_by_hydra():
    """``model.hidden_sise=64`` without ``+``: the HF schema is typed, so Hydra refuses the key outright."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="hidden_sise"):
        compose_config([*SHRUNK, "model.hidden_sise=64"])


def test_every_command_recommend_prints_composes_to_its_row():
    """Each command recommend prints for a shrunk preset (its model overrides as given, the planner's ``wrap=`` as
    ``model.wrap=``), pasted, composes the configuration recommended: the same model node, the row, N, precision,
    checkpointing, micro-batch and accumulation. The table prints the command as it is (``[...]`` is not markup)."""
    import shlex

    from omegaconf import OmegaConf
    from rich.console import Console

    from test_recommend import _compose
    from zeroexp.cli.recommend import model_overrides, run
    from zeroexp.recommend.answer import render

    given = [*SHRUNK, f"wrap=[{LLAMA_LAYER}]"]
    cfg = _compose("recommend", *given, "world_size=4", "network=a100_ib", "device_memory=80GB", "global_batch=8",
                   "precisions=[bf16]", "recommend.strategies=[ddp,zero2,fsdp_full,fsdp2_full,deepspeed_stage3]",
                   "recommend.top_k=40", "recommend.micro_batches=[1]")
    answer = run(cfg, model_overrides(["+model.attention_dropout=0.0", *given, "world_size=4"]))
    recs = answer["recommendations"]
    assert {r["config"].split()[0] for r in recs} == {"ddp", "zero2", "fsdp_full", "fsdp2_full", "deepspeed_stage3"}
    planned = OmegaConf.to_container(cfg.model, resolve=True)
    for rec in recs:
        argv = shlex.split(rec["command"])
        assert argv[:3] == ["python", "-m", "zeroexp"], rec["command"]
        run_cfg = compose_config(argv[3:])
        model = OmegaConf.to_container(run_cfg.model, resolve=True)
        assert model.pop("wrap") == [LLAMA_LAYER] and model.pop("attention_dropout") == 0.0
        assert {k: v for k, v in model.items() if k not in ("wrap",)} == {
            k: v for k, v in planned.items() if k not in ("wrap", "attention_dropout")}
        row, precision = rec["config"].split()[:2]
        assert run_cfg.strategy.layout == row and run_cfg.world_size == 4 and run_cfg.precision.name == precision
        assert run_cfg.batch_size * run_cfg.grad_accum * 4 == 8
        assert run_cfg.activation_checkpointing.name == ("full" if " ac " in f" {rec['config']} " else "none")
    console = Console(record=True, width=100, highlight=False)
    render(answer, console)
    assert f"model.wrap=[{LLAMA_LAYER}]" in console.export_text().replace("\n", "")


def test_fsdp2_names_the_expert_padding_of_fused_experts():
    """A Mixtral's fused experts (2 experts: dim 0 = 2) under FSDP2 at N=8: each expert tensor padded to 8 rows; the
    row says so (``state_note``), FSDP1 (flat parameters) and N=2 do not."""
    from zeroexp.cli.plan import run
    from test_recommend import _compose

    cfg = _compose("plan", "model=mixtral_8x7b", "model.num_hidden_layers=2", "model.hidden_size=32",
                   "model.intermediate_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=1",
                   "model.vocab_size=64", "model.seq_len=8", "model.num_local_experts=2", "world_size=[2,8]",
                   "strategies=[fsdp2_full,fsdp_full]")
    records, notes = run(cfg)
    noted = {(r["strategy"], r["world_size"]) for r in records if r["state_note"]}
    assert noted == {("fsdp2_full", 8)}
    # 2 layers x (gate_up 2 x 128 x 32 + down 2 x 32 x 64) padded from 2 to 8 rows: 4x their elements
    assert "4.0x" in next(r["state_note"] for r in records if r["state_note"])
    assert any(n.startswith("fsdp2_full at world_size=8: FSDP2 chunks") for n in notes)


#: A Mixtral shrunk by plain overrides: 2 layers, 2 experts (2 routed a token), fused experts (torch._grouped_mm).
MIXTRAL = ("model=mixtral_8x7b", "model.num_hidden_layers=2", "model.hidden_size=32", "model.intermediate_size=64",
           "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.vocab_size=64", "model.seq_len=8",
           "model.num_local_experts=2")


@pytest.mark.parametrize("overrides", [("strategy=fsdp2_full", "world_size=3"),
                                       ("strategy=deepspeed", "strategy.stage=3", "precision=bf16", "world_size=2")],
                         ids=["fsdp2_full-fp32-n3", "deepspeed3-bf16-n2"])
def test_a_mixtral_cell_holds_every_check_and_its_peak(cell, overrides):
    """Fused experts trace on fake tensors in fp32 too (zeroexp._lib.grouped_mm), so the peak model judges the cell;
    DeepSpeed keeps the rotary inv_freq fp32 under bf16 as the plan says (plan.state, plan.groups)."""
    r = cell(*MIXTRAL, *overrides, base=("logger=none", f"steps={PROBED + 1}", *WINDOWS))
    checks = held_checks(r)
    assert {"state", "collectives", "equivalence", "plan.state", "plan.groups", "plan.memory"} <= {
        n for n, c in checks.items() if c.verdict == "PASS"}


def test_a_moe_step_counts_the_experts_each_token_is_routed_to():
    """Fused experts' grouped matmul (``aten._grouped_mm``, which torch's FlopCounterMode does not count) is counted:
    each further expert a token is routed to adds its two projections, forward and backward (x3), for every token
    of every layer: 3 x 2 x (h x 2i + i x h) x tokens x layers, exactly."""
    from zeroexp.plan.flops import step_flops

    h, i, layers, tokens = 32, 64, 2, 2 * 8  # MIXTRAL's sizes, 2 samples of 8 tokens
    flops = [step_flops(compose_config([*MIXTRAL, "model.num_local_experts=4",
                                        f"model.num_experts_per_tok={k}"]).model, 2) for k in (1, 2, 4)]
    per_expert = 3 * 2 * (h * 2 * i + i * h) * tokens * layers
    assert flops[1] - flops[0] == per_expert and flops[2] - flops[1] == 2 * per_expert
