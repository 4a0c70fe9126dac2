"""The peak model below fp32: how each gradient flow applies bf16 / fp16 (zeroexp.formulas.peak.precision),
the step traced in the precision the cell computes in, exact categories on given traces, and plan.memory checked
against the memory probe in a grid of real mixed-precision cells."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from zeroexp.formulas import LAYOUTS
from zeroexp.formulas.peak.phases import Segment, StepTrace, phase_peaks
from zeroexp.formulas.peak.precision import (PrecisionTerms, gather_input_bytes, master_upcast_bytes,
                                             sharded_grad_upcast)
from zeroexp.plan.check.judge import judge as _judge
from zeroexp.plan.check.memory import uncovered
from zeroexp.plan.steptrace import trace_step
from zeroexp.results.verdict import Code
from conftest import FLOW

W, DEPTH, B = 64, 8, 8  # tests/conftest.py's BASE model at its per-rank batch
BW2, WW2, BW4 = B * W * 2, W * W * 2, B * W * 4  # a bf16 activation, a bf16 weight, an fp32 activation


def _mlp():
    return OmegaConf.create({"name": "mlp", "_target_": "zeroexp.models.LinearStack", "width": W, "depth": DEPTH,
                             "input_shape": [W]})


def _terms(row: str, precision: str, dtype: str, itemsize: int):
    layout = LAYOUTS[row]
    return layout.family.precision_terms(layout, precision, dtype, itemsize)


def test_each_family_applies_the_precision_as_its_adapter_does():
    assert _terms("ddp", "fp32", "float32", 4) == PrecisionTerms(None, None, 4, False)
    # DDP / zro: autocast, fp32 parameters and gradients.
    for row in ("ddp", "zro"):
        assert _terms(row, "bf16", "bfloat16", 2) == PrecisionTerms("bfloat16", None, 4, False)
    # zeroexp's ZeRO: compute-dtype buckets and an fp32 master.
    for row in ("zero1", "zero2"):
        assert _terms(row, "fp16", "float16", 2) == PrecisionTerms(None, "float16", 2, True)
    # FSDP: units in the compute dtype; fp16 adds Lightning's autocast plugin (ShardedGradScaler).
    assert _terms("fsdp_full", "bf16", "bfloat16", 2) == PrecisionTerms(None, "bfloat16", 2, False)
    assert _terms("fsdp2_full", "fp16", "float16", 2) == PrecisionTerms("float16", "float16", 2, False)
    # DeepSpeed's rows and the paper's have none (DeepSpeed's bf16 converts the module: its trace options)
    assert _terms("deepspeed_stage2", "bf16", "bfloat16", 2) is None and _terms("zero_stage1", "bf16", "bfloat16",
                                                                                2) is None


def test_the_up_casts_and_all_gather_inputs_exist_only_below_fp32():
    low, fp32 = _terms("zero2", "bf16", "bfloat16", 2), _terms("zero2", "fp32", "float32", 4)
    assert master_upcast_bytes((100, 30), low) == 130 * 4 and master_upcast_bytes((100, 30), fp32) == 0
    assert gather_input_bytes((100, 30), low, 2) == 130 * 2 and gather_input_bytes((100, 30), fp32, 4) == 0
    assert sharded_grad_upcast(50, _terms("fsdp_full", "bf16", "bfloat16", 2)) == 200
    assert sharded_grad_upcast(50, _terms("fsdp_full", "fp32", "float32", 4)) == 0


def _forward_ends(trace: StepTrace) -> list[int]:
    return [s.end_bytes for s in trace.segments if s.phase == "forward" and s.at == "end" and s.unit != "loss"]


def test_the_step_is_traced_in_the_precision_the_cell_computes_in():
    # Autocast without its cast cache (as Lightning runs it): each Linear saves its bf16 input and, except the first
    # (whose input needs no gradient), its weight's bf16 cast; the input's cast is saved by the first.
    auto = trace_step(_mlp(), B, [torch.nn.Linear], dtype=torch.bfloat16)
    assert _forward_ends(auto) == [(k + 2) * BW2 + k * WW2 for k in range(DEPTH)]
    # The loss up-casts the bf16 output (out.float() ** 2, then the mean): two fp32 activations and 4 B.
    loss = next(s for s in auto.segments if s.unit == "loss")
    assert loss.peak_bytes == (DEPTH + 1) * BW2 + (DEPTH - 1) * WW2 + 2 * BW4 + 4
    # Parameters in bf16 (FSDP's MixedPrecision, zeroexp's ZeRO): no weight casts, the gradients in bf16.
    cast = trace_step(_mlp(), B, [torch.nn.Linear], module_dtype=torch.bfloat16)
    assert _forward_ends(cast) == [(k + 2) * BW2 for k in range(DEPTH)]
    assert cast.segments[-1].end_by_category["gradients"] == DEPTH * WW2


def test_zeros_master_up_casts_and_gather_inputs_on_a_given_trace():
    segs = (Segment("forward", "u0", "end", 1000, {"activations": 1000}, 1000, {"activations": 1000}),
            Segment("backward", "u0", "end", 700, {"activations": 300, "gradients": 400}, 700,
                    {"activations": 300, "gradients": 400}))
    t = StepTrace(batch_size=1, segments=segs, loss_bytes=8, seed_bytes=4)
    kw = {"steady_grad_bytes": 0, "optimizer_numels": (50,), "optimizer_itemsize": 4, "foreach": False}
    # Below fp32: 50 fp32 master gradients (200 B) beside AdamW's 400 B; steady's 100 B all-gather input freed in
    # forward, so every phase is 100 B lower.
    low = phase_peaks(t, **FLOW["bucket"], buckets=(200,), master_grads=200, gather_inputs=100, **kw)
    assert low["forward"] == {"bytes": 892, "by_category": {"activations": 992, "optimizer_state": -100}}
    assert {k: v for k, v in low["backward"].items() if not k.startswith("upper")} == \
        {"bytes": 192, "by_category": {"activations": 292, "optimizer_state": -100}}
    # the bucket the one backward segment opens: the upper end of the range
    assert low["backward"]["upper_by_category"] == {"activations": 292, "comm": 200, "optimizer_state": -100}
    assert low["optimizer"] == {"bytes": 500, "by_category": {"optimizer_state": 500}}
    # The bucket (700 B, a collective buffer: comm) alive at the step's start: more than the temporaries and up-casts.
    big = phase_peaks(t, **FLOW["bucket"], buckets=(700,), master_grads=200, gather_inputs=100, **kw)
    assert big["optimizer"] == {"bytes": 600, "by_category": {"comm": 700, "optimizer_state": -100}}
    assert phase_peaks(t, **FLOW["in_place"], buckets=(), **kw)["optimizer"] == {"bytes": 400,
                                                                        "by_category": {"optimizer_state": 400}}


def test_what_the_model_covers_and_why_not_elsewhere():
    for name in ("ddp", "zro", "zero1", "zero2", "fsdp_full", "fsdp_grad_op", "fsdp2_full", "fsdp2_grad_op"):
        assert all(uncovered(name, p, "none") == [] for p in ("fp32", "bf16", "fp16")), name
    for name in ("ddp", "zro", "zero1", "zero2", "fsdp_full", "fsdp_grad_op", "fsdp2_full", "fsdp2_grad_op"):
        assert uncovered(name, "bf16", "none", "full") == [], name  # checkpointing below fp32, as in fp32
    for name in ("ddp", "zro", "zero1", "zero2"):
        assert uncovered(name, "fp16", "none", "full", 2) == [], name  # and accumulation
    for stage in (1, 2, 3):  # DeepSpeed checkpointed as every family, in every precision
        assert uncovered(f"deepspeed_stage{stage}", "bf16", "none", "full") == []
    # stage 3 with frozen parameters refused by name (the recompute gathers the frozen modules' again)
    assert uncovered("deepspeed_stage3", "bf16", "none", "full", frozen=True)[0].startswith(
        "no peak model yet for DeepSpeed stage 3 with activation checkpointing and frozen parameters")
    for name in ("fsdp_grad_op", "fsdp_full"):  # FSDP1's no_sync, below fp32 as in fp32
        assert uncovered(name, "bf16", "none", "none", 2) == uncovered(name, "fp32", "none", "none", 2) == [], name
    assert uncovered("fsdp_full", "bf16", "full") == [
        "no peak model yet for offload=full (no strategy the peak model covers runs it on CPU: FSDP's CPUOffload "
        "needs a GPU; covered: offload none)"]
    for stage in (1, 2, 3):  # DeepSpeed's offloaded optimizer (tests/test_plan_deepspeed.py, test_ds_accumulation.py)
        assert uncovered(f"deepspeed_stage{stage}", "bf16", "optimizer") == []
        assert (uncovered(f"deepspeed_stage{stage}", "bf16", "optimizer", micro_batches=2) == []) == (stage != 1)
    (why,) = uncovered("deepspeed_stage1", "bf16", "optimizer", micro_batches=2)
    assert why.startswith("no peak model yet for offload=optimizer with grad_accum > 1 at stage 1: DeepSpeed's")
    (why,) = uncovered("deepspeed_stage3", "bf16", "full")  # its parameters offloaded too: runs on CPU, not modelled
    assert why.startswith("no peak model yet for offload=full at stage 3: DeepSpeed's")


def test_a_phase_below_steady_is_judged_on_its_magnitude():
    # zeroexp's ZeRO below fp32 frees steady's all-gather inputs: a phase may sit below steady.
    assert _judge(-1000, -1010, [])[0] == "PASS"  # 10 B short of 1000 B: within 2 %
    assert _judge(-1000, -1030, [])[0] == "FAIL"
    assert _judge(-1000, -990, [])[0] == "FAIL"  # never above the measurement


#: (strategy, precision) cells of the real grid: every covered row in both low precisions (fsdp_full: prefetch=pre).
GRID = [(s, p) for s in ("ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp_full", "fsdp2_full", "fsdp2_grad_op")
        for p in ("bf16", "fp16")]


def test_plan_memory_passes_below_fp32_with_exact_categories(cell):
    """One grid of real cells (each its own launch, cached for the session): every phase PASSes, the forward's
    categories are the closed forms above."""
    shard = DEPTH * W * W // 2  # one bucket's shard at N=2, elements
    for strategy, precision in GRID:
        memory = cell(f"strategy={strategy}", f"precision={precision}", "world_size=2").summary["plan"]["memory"]
        assert memory["check"] == "PASS", (strategy, precision, memory["reasons"])
        assert all(p["measured_bytes"] >= p["predicted_bytes"] for ph, p in memory["phases"].items() if ph != "steady")
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[precision]  # the step traced as the cell computes
        autocast = strategy in ("ddp", "zro") or (precision == "fp16" and strategy.startswith("fsdp"))
        assert memory["trace"]["autocast"] == (dtype if autocast else None)
        assert memory["trace"]["param_dtype"] == (None if strategy in ("ddp", "zro") else dtype)
        if strategy.startswith("fsdp"):
            if strategy == "fsdp_full":  # unit 7 gathered beside the first seven outputs: from its bf16 shard copy
                assert memory["phases"]["forward"]["predicted_by_category"] == {
                    "activations": DEPTH * BW2 - 4, "unsharded": WW2, "comm": WW2 // 2}
            continue
        fwd, opt = memory["phases"]["forward"], memory["phases"]["optimizer"]
        loss = 2 * BW4 + 4 - 4  # the loss's fp32 up-casts and mean, less the last step's copy of its loss
        if strategy in ("ddp", "zro"):  # autocast: seven weight casts saved
            assert fwd["predicted_by_category"] == {"activations": (DEPTH + 1) * BW2 + (DEPTH - 1) * WW2 + loss}
            assert fwd["measured_bytes"] == fwd["predicted_bytes"]
            assert opt["predicted_by_category"] == {"optimizer_state": 3 * W * W * 4}
        else:  # the all-gather input freed (gloo may hold it: one named tensor); AdamW + fp32 up-casts
            assert fwd["predicted_by_category"] == {"activations": (DEPTH + 1) * BW2 + loss,
                                                    "optimizer_state": -2 * shard}
            assert fwd["measured_bytes"] - fwd["predicted_bytes"] in (0, 2 * shard)
            assert opt["predicted_by_category"] == {"optimizer_state": 2 * shard * 4 + shard * 4 - 2 * shard}


def test_zero_below_fp32_with_several_buckets_reads_na(cell):
    # Four buckets (two Linears each): gloo may hold every all-gather input through forward, more than one late tensor.
    overrides = ("strategy=zero2", "precision=bf16", "strategy.bucket_cap_mb=0.02", "world_size=2")
    memory = cell(*overrides).summary["plan"]["memory"]
    assert memory["check"] == "n/a" and memory["reason_codes"] == [Code.MEMORY_NOT_MODELLED]
    assert "4 buckets" in memory["reasons"][0]  # the count of buckets it names


#: A GPT (biased Linears, LayerNorms, tied head) at N=3 below fp32 with checkpointing or accumulation.
GPT = ("model=gpt", "model.n_layer=2", "model.n_embd=32", "model.seq_len=16", "model.vocab_size=64", "world_size=3")


@pytest.mark.parametrize("overrides", [("strategy=ddp", "precision=bf16", "activation_checkpointing=full"),
                                       ("strategy=fsdp2_full", "precision=bf16", "activation_checkpointing=full"),
                                       ("strategy=zero2", "precision=fp16", "activation_checkpointing=full",
                                        "grad_accum=2"),
                                       ("strategy=deepspeed", "strategy.stage=2", "precision=bf16",
                                        "activation_checkpointing=full")])
def test_checkpointing_and_accumulation_below_fp32_pass_on_every_rank(cell, overrides):
    """Below fp32 the step is traced checkpointed and accumulating as in fp32: every phase of every rank PASS; DDP's
    buckets follow the autocast step's gradient order (a biased Linear's weight ready before its bias)."""
    from conftest import PROBED, WINDOWS

    r = cell(*GPT, *overrides, base=("logger=none", f"steps={PROBED + 1}", *WINDOWS))
    plan = r.summary["plan"]
    assert plan["memory"]["check"] == "PASS", plan["memory"]["reasons"]
    assert len(plan["memory"]["ranks"]) == 3 and all(k["check"] == "PASS" for k in plan["memory"]["ranks"])
    assert plan["groups"]["check"] == "PASS", plan["groups"]["reasons"]


def test_the_autocast_step_readies_a_weight_before_its_bias():
    from zeroexp.plan.shape import autocast_ready, model_shape
    from conftest import compose_config

    model = compose_config(list(GPT[:-1])).model
    meta, autocast = model_shape(model).ready, autocast_ready(model, "bfloat16")
    assert sorted(meta) == sorted(autocast) and meta != autocast
