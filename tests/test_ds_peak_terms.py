"""DeepSpeed's model-state peak term by term (zeroexp.formulas.peak.deepspeed_terms) in the planner's rows, beside
DeepSpeed's own estimators: t5-3b (2,851M parameters, its largest layer the 32128 x 1024 shared embedding) at N=8
in fp16, and models nobody here wrote at N=2 and N=3."""

from __future__ import annotations

import importlib.util
import io

import pytest
from hydra import compose, initialize_config_dir

from zeroexp.errors import ConfigError
from zeroexp.formulas.peak.deepspeed_terms import TERMS, ds_estimator_bytes, ds_term_peak

DS = importlib.util.find_spec("deepspeed") is not None
HF = importlib.util.find_spec("transformers") is not None
TT = importlib.util.find_spec("expecttest") is not None  # PyTorch's test Transformer imports it
T5_3B, T5_LAYER = 2_851_000_000, 32128 * 1024
ROWS = "strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]"


def _plan(*overrides: str) -> dict:
    from zeroexp.cli.plan import register, run
    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=[ROWS, *overrides])
    return {r["strategy"]: r for r in run(cfg)[0]}


def _deepspeed_estimate(stage: int, total: int, largest: int, n: int, offload: str = "none") -> int:
    """DeepSpeed's own estimator (its per-GPU figure), called where deepspeed imports; else its formula."""
    if not DS:
        return ds_estimator_bytes(stage, total, n, largest, offload)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=n, cpu_offload=offload != "none",
                                                     cpu_offload_params=offload == "full", zero_init=True)[1]
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=n, cpu_offload=offload != "none")[1]


def test_t5_3b_fp16_rows_name_each_term_and_meet_deepspeeds_estimators():
    rows = _plan(f"params={T5_3B}", f"largest_layer={T5_LAYER}", "world_size=8", "precision=fp16", "device=cuda")
    part, bucket = T5_3B // 8, 25 * 2**20 // 4 * 2  # each rank's partition; the ipg bucket in fp16
    for name, r in rows.items():
        d, stage = r["ds_peak"], r["zero_stage"]
        assert set(d["terms"]) <= set(TERMS) and d["bytes"] == sum(d["terms"].values()), name
        assert d["terms"] == d["moments"][d["moment"]] and d["largest_layer"] == T5_LAYER
        est = d["estimator"]
        deepspeed = _deepspeed_estimate(stage, T5_3B, T5_LAYER, 8)
        assert est["bytes"] == deepspeed
        assert abs(est["counted_bytes"] - deepspeed) <= 0.02 * deepspeed, name  # the same terms, within 2 %
    # ZeRO-2: DeepSpeed's 2P + 18P/N at the step, plus the flat fp16 partition its .to(fp32) copies
    two = rows["deepspeed_stage2"]["ds_peak"]
    assert two["moment"] == "fp32_copy" and two["estimator"]["extra"] == ["flat_grads"]
    assert two["estimator"]["elsewhere"] == [] and two["bytes"] == 2 * T5_3B + (4 + 8 + 2 + 2 + 4) * part
    # ZeRO-3: the step holds 18P/N of the estimator's, the persistent gradient buffer, the bucket and foreach AdamW's
    # temporaries; the largest layer gathered with its gradients (the estimator's 4L) is backward's, not the step's
    three = rows["deepspeed_stage3"]["ds_peak"]
    assert three["moment"] == "update" and three["estimator"]["elsewhere"] == ["layer", "layer_grads"]
    assert set(three["estimator"]["extra"]) == {"grads", "bucket", "adamw_tmp"}
    assert three["bytes"] == (2 + 2 + 4 + 8 + 4 + 4) * part + bucket
    assert three["moments"]["backward"]["layer"] == three["moments"]["backward"]["layer_grads"] == 2 * T5_LAYER
    # fp16's overflow check: a bool mask of the gradient buffer beside the state, below the step's other moments
    assert three["moments"]["overflow_check"]["overflow_mask"] == part
    # ZeRO-1: autograd's gradients of the whole model wait for backward's epilogue
    one = rows["deepspeed_stage1"]["ds_peak"]
    assert one["moment"] == "backward" and one["terms"]["full_grads"] == 2 * T5_3B
    assert "full_grads" in one["estimator"]["extra"] and one["estimator"]["elsewhere"] == ["grads", "fp32_grads"]
    # the figures DeepSpeed prints for this set-up, GiB: 11.28 (ZeRO-2), 6.10 (ZeRO-3)
    assert [round(rows[f"deepspeed_stage{s}"]["ds_peak"]["estimator"]["bytes"] / 2**30, 2) for s in (2, 3)] == [
        11.28, 6.10]


def test_the_table_names_the_terms_and_what_differs():
    from rich.console import Console

    from zeroexp.plan.output import render_tables

    rows = _plan(f"params={T5_3B}", f"largest_layer={T5_LAYER}", "world_size=8", "precision=fp16", "device=cuda")
    console = Console(file=io.StringIO(), width=250, record=True)
    render_tables(list(rows.values()), [], "GiB", console)
    text = console.export_text()
    assert "DeepSpeed's peak by term" in text and "11.3 / 11.3" in text and "@backward: layer layer_grads" in text
    assert "11.9 (fp32_copy)" in text and "8.0 (update)" in text
    assert all(t in text for t in ("fp32_grads", "flat_grads", "adamw_tmp", "full_grads"))


def test_without_the_largest_layer_stage_3_names_what_it_leaves_out():
    rows = _plan(f"params={T5_3B}", "world_size=8", "precision=fp16")
    three = rows["deepspeed_stage3"]["ds_peak"]
    assert three["largest_layer"] is None and "layer" not in three["moments"]["backward"]
    assert three["estimator"]["bytes"] is None and "largest layer" in three["estimator"]["note"]
    assert "largest_layer=" in three["basis"]
    assert rows["deepspeed_stage2"]["ds_peak"]["estimator"]["bytes"] is not None  # ZeRO-2's needs no layer
    fp32 = _plan(f"params={T5_3B}", "world_size=8")["deepspeed_stage2"]["ds_peak"]
    assert fp32["estimator"]["bytes"] is None and "flat_grads" not in fp32["moments"]["fp32_copy"]  # .to: no copy
    offload = _plan(f"params={T5_3B}", "world_size=8", "offload=optimizer", "precision=fp16")
    assert offload["deepspeed_stage3"]["ds_peak"] == {"note": "no term model yet for offload=optimizer (covered: "
                                                              "offload none)"}


@pytest.mark.parametrize("value, why", [("3e9", "> params"), ("lots", "a parameter count"), ("-5", "")])
def test_largest_layer_is_a_count_up_to_params(value, why):
    with pytest.raises(ConfigError) as e:
        _plan(f"params={T5_3B}", f"largest_layer={value}")
    assert "largest_layer" in str(e.value) and why in str(e.value)
    with pytest.raises(ConfigError, match="largest_layer"):
        _plan("model=mlp", "largest_layer=1000")


@pytest.mark.skipif(not DS, reason="deepspeed does not import")
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["none", "optimizer", "full"])
def test_the_estimator_formula_is_deepspeeds(stage, offload):
    if offload == "full" and stage < 3:
        return
    for total, largest, n in ((T5_3B, T5_LAYER, 8), (7_500_000_001, 10**8, 64), (218_496, 16_384, 3)):
        assert ds_estimator_bytes(stage, total, n, largest, offload) == _deepspeed_estimate(stage, total, largest, n,
                                                                                             offload)


def test_the_terms_are_each_a_closed_form():
    c, p, n, b, big = 2, 10**9, 4, 10**6, 5 * 10**5
    one, two, three = (ds_term_peak(s, p, n, c, b, big, foreach=False) for s in (1, 2, 3))
    part = p // n
    assert two.moments["backward"] == {"params": c * p, "master": 4 * part, "moments": 8 * part, "grads": c * part,
                                       "bucket": c * b, "bucket_copy": c * (b - big)}
    assert one.moments["backward"] == {"params": c * p, "master": 4 * part, "moments": 8 * part, "bucket": c * b,
                                       "full_grads": c * p}
    # single-tensor AdamW: 2 partitions of temporaries beside the fp32 gradient, above the flat copy's moment
    assert two.moments["update"] == {"params": c * p, "master": 4 * part, "moments": 8 * part,
                                        "fp32_grads": 4 * part, "adamw_tmp": 8 * part}
    assert three.moments["backward"]["layer"] == c * big and three.moments["update"]["params"] == c * part
    assert "overflow_check" not in three.moments  # bf16: no overflow check
    assert ds_term_peak(3, p, n, c, b, big, foreach=False, fp16=True).moments["overflow_check"]["overflow_mask"] == part
    assert "overflow_check" not in ds_term_peak(2, p, n, c, b, big, foreach=False, fp16=True).moments  # two scalars
    # one rank: the bucket's flatten is a view; a model within one bucket: the whole gradient is copied once
    assert "bucket_copy" not in ds_term_peak(2, p, 1, c, b, big, foreach=True).moments["backward"]
    assert ds_term_peak(2, 1000, 2, c, b, 10, foreach=True).moments["backward"]["bucket_copy"] == c * 1000


def _corpus_model(which: str) -> tuple[list[str], object]:
    """Overrides of a model nobody here wrote, and a factory of the same model on the CPU."""
    if which == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return ["model=hf_gpt2"], lambda: GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64,
                                                                      n_layer=2, n_head=4))
    dt = "torch.testing._internal.distributed._tensor.common_dtensor"
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    return (["model=custom", f"model._target_={dt}.Transformer", "model.input_shape=[8]",
             f"+model.args._target_={dt}.ModelArgs", "+model.args.n_layers=2", "+model.args.vocab_size=32",
             "+model.args.max_seq_len=8", "+model.args.dim=32", "+model.args.n_heads=4", "+model.args.dropout_p=0.0",
             "model.dtype=long", "model.high=32", "model.loss=next_token", f"model.wrap=[{dt}.TransformerBlock]"],
            lambda: Transformer(ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=32, n_heads=4, dropout_p=0.0)))


@pytest.mark.skipif(not (DS and HF), reason="needs deepspeed and transformers")
@pytest.mark.parametrize("which", ["hf_gpt2", "torch_transformer"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_models_largest_layer_and_estimate_are_deepspeeds(which, n):
    """The largest layer the planner reads off a model's modules is the one DeepSpeed's ``model_to_params`` finds (a
    tied embedding counted once in the total); the fp16 traced peak model covers DeepSpeed's rows as bf16's."""
    from deepspeed.runtime.zero.stage3 import model_to_params

    if which == "torch_transformer" and not TT:
        pytest.skip("PyTorch's test Transformer needs expecttest")
    overrides, build = _corpus_model(which)
    total, largest = model_to_params(build())
    half = _plan(*overrides, f"world_size={n}", "precision=fp16", "batch_size=2")
    bf16 = _plan(*overrides, f"world_size={n}", "precision=bf16", "batch_size=2")
    for name, r in half.items():
        d = r["ds_peak"]
        assert r["numel"] == total and d["largest_layer"] == largest
        deepspeed = _deepspeed_estimate(r["zero_stage"], total, largest, n)
        assert d["estimator"]["bytes"] == deepspeed and abs(d["estimator"]["counted_bytes"] - deepspeed) <= (
            0.02 * deepspeed + 4 * n)  # our partitions round each rank's share up: a few bytes a rank
        assert r["peak_bytes"] is not None and "peak_note" not in r, (name, r.get("peak_note"))
        assert r["peak_bytes"] == bf16[name]["peak_bytes"]  # fp16 runs bf16's path: the loss scaler's scalars aside


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_terms_are_the_traced_models_step(n, device):
    """The traced peak model's step (a model's shapes, rank by rank) is the term model's step above the state, plus
    what a count cannot know: the norms' scalars and the partition's padding (stages 1-2: the flat group padded to
    2N; stage 3: each parameter padded to N), each an fp32 gradient and AdamW's temporaries. On a CPU rank AdamW's
    update is the step's highest moment; on a CUDA rank (foreach) the fp32 copy can be, beside the whole of the
    parameters the partition cuts (``grads_in_partition``), which a count takes as the partition: a lower bound."""
    from zeroexp.formulas import DS_NORM_BYTES

    width, depth = 64, 8  # mlp: 8 bias-free 64 x 64 Linear layers
    for precision in ("fp32", "bf16", "fp16"):
        rows = _plan("model=mlp", f"model.width={width}", f"model.depth={depth}", f"world_size={n}", "batch_size=8",
                     "bucket_cap_mb=1", f"precision={precision}", f"device={device}")
        for name, r in rows.items():
            stage, moments = r["zero_stage"], r["ds_peak"]["moments"]
            state = {k: moments["update"][k] for k in ("params", "master", "moments", "grads", "bucket")
                     if k in moments["update"]}
            above = {k: sum(moments[k].values()) - sum(state.values()) for k in ("fp32_copy", "update")}
            part = -(-depth * width * width // n)
            padded = (-(-depth * width * width // (2 * n)) * 2 if stage < 3 else depth * -(-width * width // n))
            norms = (2 if stage < 3 else 3) * DS_NORM_BYTES[stage]  # stage 3: one sub-group's norm too
            traced = r["phase_bytes"]["optimizer"]
            if device == "cpu":  # the fp32 gradient and two partitions of single-tensor AdamW's temporaries
                assert traced == above["update"] + (padded - part) * 12 + norms, (name, precision)
            assert traced >= max(above.values()), (name, precision)
