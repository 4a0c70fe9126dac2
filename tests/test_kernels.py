"""The op-level step time on a GPU preset (zeroexp.formulas.time.kernels, zeroexp.plan.optrace): each kernel of the
traced step by its FLOPs and bytes, not 6 x parameters x tokens at an assumed efficiency."""

from __future__ import annotations

import pytest

from zeroexp.cell.memo import invocation_memo
from zeroexp.formulas.time.kernels import KernelRates, OpCost, op_seconds, ops_seconds

from test_plan_fits import _compose, _run

H100 = KernelRates(matmul_flops=7.945e14, peak_flops=9.89e14, attention_efficiency=0.31, memory_Bps=3.35e12,
                   launch_s=3.8e-6)
TINY = ["model=gpt", "model.n_layer=2", "model.n_embd=128", "model.seq_len=64", "model.vocab_size=512"]
LLAMA = ["model=hf", "model.arch=llama", "model.vocab_size=64", "model.hidden_size=32", "model.num_hidden_layers=5",
         "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.intermediate_size=64",
         "model.max_position_embeddings=16", "model.seq_len=8"]


def test_a_kernel_takes_the_longer_of_its_work_and_its_launch():
    big = OpCost("matmul", 2 * 8192**3, 3 * 8192**2 * 2)  # compute-bound: FLOPs at the matmul rate
    assert op_seconds(big, H100) == pytest.approx(big.flops / H100.matmul_flops)
    skinny = OpCost("matmul", 2 * 8192 * 8192 * 8, (8192 * 8192 + 2 * 8192 * 8) * 2)  # memory-bound: its bytes
    assert op_seconds(skinny, H100) == pytest.approx(skinny.bytes / H100.memory_Bps)
    attention = OpCost("attention", 10**12, 10**6)
    assert op_seconds(attention, H100) == pytest.approx(10**12 / (9.89e14 * 0.31))
    fp32 = KernelRates(6.7e13, 4.945e14, 0.31, 3.35e12, 3.8e-6)  # never above the matmul rate (CUDA cores in fp32)
    assert op_seconds(attention, fp32) == pytest.approx(10**12 / 6.7e13)
    assert op_seconds(OpCost("memory", 0, 335_000_000), H100) == pytest.approx(1e-4)
    assert op_seconds(OpCost("memory", 0, 64), H100) == H100.launch_s  # a tiny kernel costs its launch
    split = ops_seconds({big: 2, OpCost("memory", 0, 64): 3}, H100)
    assert split["kernels"] == 5 and split["matmul"] == pytest.approx(2 * op_seconds(big, H100))
    assert split["memory"] == pytest.approx(3 * H100.launch_s) and split["attention"] == 0


def test_the_traced_kernels_count_torchs_flops_and_skip_views():
    """GPT's matmuls and its causal attention: the matmuls' FLOPs are torch's FlopCounterMode's count of the same step;
    the causal attention kernel counts half of torch's count (FlashAttention skips the masked blocks)."""
    from zeroexp.plan.flops import step_flops
    from zeroexp.plan.optrace import step_kernels

    model = _compose(*TINY).model
    with invocation_memo(fresh=True):
        forward, backward = step_kernels(model, 4)
        bf16 = step_kernels(model, 4, "bfloat16")
        total = step_flops(model, 4, derive=False)
    flops = {kind: sum(op.flops * n for ops in (forward, backward) for op, n in ops.items() if op.kind == kind)
             for kind in ("matmul", "attention", "memory")}
    assert flops["memory"] == 0 and flops["attention"] > 0
    # FlopCounterMode counts the meta device's attention as its math path's matmuls: a backward of 2 forwards (3 in
    # all); the fused kernel's backward recomputes the scores, 2.5 forwards (torch's sdpa_backward_flop_count: 3.5 in
    # all), and a causal one does half of it
    assert 7 * (total - flops["matmul"]) == 3 * 2 * 2 * flops["attention"]
    assert sum(n for op, n in forward.items() if op.kind == "attention") == 2  # one a layer
    moved = [sum(op.bytes * n for op, n in ops.items()) for ops in (forward, bf16[0])]
    assert moved[1] < moved[0]  # bf16's kernels move fewer bytes
    assert {op.flops for op in forward if op.kind == "matmul"} == {op.flops for op in bf16[0] if op.kind == "matmul"}


def test_a_deep_stack_derives_the_kernels_a_whole_trace_counts():
    from zeroexp.plan.optrace import step_kernels

    model = _compose(*LLAMA).model
    with invocation_memo(fresh=True):
        derived = step_kernels(model, 2)
    with invocation_memo(fresh=True):
        traced = step_kernels(model, 2, derive=False)
    assert derived == traced


def test_attention_is_counted_where_six_n_tokens_is_not():
    """Twice the sequence at half the batch: the same tokens and 6N FLOPs, more attention: a longer step (the issue's
    seq 8192 x 1 against seq 4096 x 2, at a size this machine traces at once)."""
    common = ["model=hf", "model.arch=llama", "model.vocab_size=512", "model.hidden_size=512",
              "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=4",
              "model.intermediate_size=1024", "model.max_position_embeddings=2048", "world_size=8", "network=h100_ib",
              "strategies=[ddp]", "precision=bf16"]  # rotary: the parameters do not depend on the sequence
    (short,), _ = _run(*common, "batch_size=2", "model.seq_len=1024")
    (long,), _ = _run(*common, "batch_size=1", "model.seq_len=2048")
    assert long["step_ms"] > short["step_ms"]
    flat = [*common, "network.efficiency=0.4"]  # 6 x parameters x tokens: blind to it
    (a,), _ = _run(*flat, "batch_size=2", "model.seq_len=1024")
    (b,), _ = _run(*flat, "batch_size=1", "model.seq_len=2048")
    assert a["step_ms"] == pytest.approx(b["step_ms"])


def test_the_searchs_floors_stay_below_its_op_level_steps():
    from zeroexp.cli.recommend import run
    from zeroexp.recommend.search import Evaluator
    from zeroexp.recommend.space import configurations

    from test_recommend import _compose as compose, _problem

    cfg = compose("recommend", *TINY, "world_size=8", "network=h100_ib", "global_batch=32", "precisions=[bf16]",
                   "recommend.strategies=[ddp,zero2,fsdp2_full]")
    answer = run(cfg)
    assert answer["recommendations"]
    problem, axes = _problem(cfg)
    ev = Evaluator(problem)
    for c in configurations(axes, 8):
        assert ev.floor_s(c) <= ev.step(c).step_s, c


def test_mfu_counts_the_models_flops_and_hfu_the_recompute_too():
    from zeroexp.cli.recommend import run

    from test_recommend import _compose as compose

    answer = run(compose("recommend", *TINY, "world_size=8", "network=h100_ib", "global_batch=32",
                         "precisions=[bf16]", "recommend.strategies=[ddp]", "activation_checkpointing=full",
                         "recommend.top_k=1"))
    (rec,) = answer["recommendations"]
    # full checkpointing reruns each unit's forward: the step's FLOPs exceed the model's, HFU exceeds MFU by as much
    assert 0 < rec["mfu"] < rec["hfu"] < 1
    from zeroexp.formulas.peak.checkpointing import FULL
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.flops import step_flops

    model = _compose(*TINY).model
    wrap = tuple(import_class(p) for p in wrap_paths(compose("plan", *TINY)))
    m = int(dict(o.split("=", 1) for o in rec["overrides"])["batch_size"])
    assert rec["hfu"] / rec["mfu"] == pytest.approx(step_flops(model, m, wrap, FULL) / step_flops(model, m, wrap))


def test_fused_experts_grouped_matmuls_are_counted_as_matmuls():
    """A shrunk Mixtral's experts run torch._grouped_mm, which torch's registry lacks: counted as the FLOP count of
    the step counts them (zeroexp.plan.flops.grouped_mm_flops), so the kernels' matmuls and attention add up to it."""
    from zeroexp.plan.flops import step_flops
    from zeroexp.plan.optrace import step_kernels

    from test_hf_models import MIXTRAL

    model = _compose(*MIXTRAL).model
    with invocation_memo(fresh=True):
        kernels = step_kernels(model, 2, derive=False)
        total = step_flops(model, 2, derive=False)
    flops = {kind: sum(op.flops * n for ops in kernels for op, n in ops.items() if op.kind == kind)
             for kind in ("matmul", "attention")}
    assert 7 * (total - flops["matmul"]) == 3 * 2 * 2 * flops["attention"] > 0
