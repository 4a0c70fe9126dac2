"""What the planner's ``fits`` is judged on, and which rows it may recommend: the peak model wherever it covers a
row, in fp32, bf16 and fp16; model state with the traced activations, or model state alone, elsewhere, said beside
every ``fits``; the ZeRO paper's rows (no strategy runs them) shown as references and never the fastest that fits."""

from __future__ import annotations

import os

import pytest

from conftest import run_cli
from zeroexp.formulas import LAYOUTS, PlanKnobs, derive_groups
from zeroexp.cli.plan import register, run
from zeroexp.plan.shape import model_shape

PAPER = ["zero_stage0", "zero_stage1", "zero_stage2", "zero_stage3"]
#: A 65B GPT (80 layers x 8192 wide, 64 heads, 4096 tokens a sample): at N=64 its model state is 16.2 GB per rank
#: under stage 3 while one sample's activations are 173 GB.
GPT_65B = ["model=gpt", "model.n_layer=80", "model.n_embd=8192", "model.n_head=64", "model.seq_len=4096",
           "model.vocab_size=32000", "batch_size=1"]
TINY_GPT = ["model=gpt", "model.n_layer=3", "batch_size=8"]


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="plan", overrides=list(overrides))


def _run(*overrides: str):
    return run(_compose(*overrides))


def test_every_paper_row_is_a_reference_and_no_strategy_runs_one():
    from zeroexp.strategies import registered

    assert sorted(name for name, layout in LAYOUTS.items() if layout.reference) == PAPER
    # deepspeed's row follows strategy.stage (deepspeed_stage<k>), fsdp_hybrid's strategy.sharding (fsdp_<sharding>)
    run_rows = (set(registered()) & set(LAYOUTS)) | {n for n in LAYOUTS if n.startswith(("deepspeed_", "fsdp_"))}
    assert not any(LAYOUTS[name].reference for name in run_rows)


def test_a_65b_gpt_fits_nowhere_at_64_ranks_on_the_peak_and_no_paper_row_is_fastest():
    records, _ = _run(*GPT_65B, "world_size=64", "network=h100_ib")  # h100_ib: 80 GB a device
    rows = {r["strategy"]: r for r in records}
    memory = 80 * 10**9
    acts = rows["fsdp_full"]["activation_bytes"]
    assert acts > 170e9 and all(r["activation_bytes"] == acts for r in records)  # 173 GB: one sample's forward
    stage3 = rows["zero_stage3"]
    # on state alone (16.2 GB + a 3.2 GB unit gathered) it would fit
    assert stage3["reference"] and stage3["device_bytes"] + stage3["gather_floor_bytes"] < 20e9
    assert stage3["fits_on"] == "state+activations" and stage3["fits"] is False
    # h100_ib: CUDA, two 32 MiB cuBLAS workspaces; beside the figure, NCCL's buffers and the CUDA context
    assert stage3["beside_bytes"] == stage3["nccl_bytes"] + stage3["context_bytes"] > 0
    assert stage3["fits_bytes"] == (stage3["device_bytes"] + stage3["gather_floor_bytes"] + acts
                                    + stage3["workspace_bytes"] + stage3["beside_bytes"])
    for name in ("ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp2_grad_op", "fsdp_full", "fsdp2_full",
                 "deepspeed_stage0", "deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3"):
        r = rows[name]  # the peak model covers them: the largest phase above steady holds the activations; on a GPU
        # fits is judged on the device as nvidia-smi counts it: the caching allocator's segments for it (reserved),
        # NCCL's buffers and the CUDA context
        assert r["fits_on"] == "device" and r["reserved_peak_bytes"] >= r["peak_bytes"], name
        assert r["fits_bytes"] == r["device_total_bytes"] == (r["reserved_peak_bytes"] + r["nccl_bytes"]
                                                              + r["context_bytes"]), name
        assert r["peak_bytes"] >= r["device_bytes"] + acts, name
        assert r["fits"] is False, name
    assert all(r["fits_bytes"] > memory for r in records)
    assert not any(r["fastest"] for r in records)  # nothing fits: nothing is recommended
    from zeroexp.plan.output import fastest_sentences

    assert fastest_sentences(records, "GB") == ["N=64: no row a strategy runs fits 72.0 GB (80.0 less 10 %)"]


def test_a_paper_row_is_never_the_fastest_even_where_it_is_fastest():
    # the paper's ZeRO-2 (one reduce_scatter and one all_gather of the whole model) against DeepSpeed's stage 2 (its
    # buckets' all_reduce and all_gather): on NCCL's cost model at 8 nodes the paper's step is the shorter
    records, _ = _run(*TINY_GPT, "world_size=64", "network=h100_ib", "strategies=[zero_stage2,deepspeed_stage2]")
    paper, ds = records
    assert paper["reference"] and paper["fits"] and paper["step_ms"] < ds["step_ms"]
    assert not paper["fastest"] and ds["fastest"] and ds["fits_on"] == "device"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_rows_are_judged_on_the_peak(precision):
    names = ["ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp_full", "fsdp2_full", "deepspeed_stage1",
             "deepspeed_stage2", "deepspeed_stage3"]
    memory = 6_000_000
    records, _ = _run(*TINY_GPT, "world_size=2", f"precision={precision}", f"device_memory={memory}", "device=cpu",
                      "bucket_cap_mb=1", f"strategies=[{','.join(names)}]")
    fp32, _ = _run(*TINY_GPT, "world_size=2", f"device_memory={memory}", "device=cpu", "bucket_cap_mb=1",
                   f"strategies=[{','.join(names)}]")
    rows, full = {r["strategy"]: r for r in records}, {r["strategy"]: r for r in fp32}
    covered = names
    for name in covered:
        r = rows[name]
        assert r["fits_on"] == "peak" and r["fits"] == (r["peak_bytes"] <= r["usable_memory_bytes"]), \
            (name, r.get("peak_note"))
        # traced in the compute dtype: the forward holds 2-byte activations where fp32's are 4
        assert r["phase_bytes"]["forward"] < full[name]["phase_bytes"]["forward"], name
    assert {rows[n]["fits"] for n in covered} == {True, False}  # the peak decides: some fit 6 MB, some do not
    zero1 = rows["zero1"]  # its steady state holds each bucket's all-gather input (the master cast to 2 bytes)
    model = _compose(*TINY_GPT).model
    groups = derive_groups("zero1", LAYOUTS["zero1"], model_shape(model, model.wrap), 2, 2,
                           PlanKnobs(bucket_cap_bytes=2**20))
    inputs = sum(s.numel // 2 for s in groups.shards) * 2
    assert zero1["peak_bytes"] == zero1["device_bytes"] + inputs + max(max(zero1["phase_bytes"].values()), 0)
    if precision == "fp16":  # DeepSpeed fp16 runs bf16's path in 2-byte tensors: the loss scaler's scalars aside
        bf16, _ = _run(*TINY_GPT, "world_size=2", "precision=bf16", f"device_memory={memory}", "device=cpu",
                       "bucket_cap_mb=1", "strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]")
        for r in bf16:
            assert rows[r["strategy"]]["peak_bytes"] == r["peak_bytes"], r["strategy"]
    assert all(r["activation_cast_bytes"] is None for r in fp32)


def test_cli_says_a_row_is_judged_on_state_alone_and_marks_the_references():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = run_cli("params=7.5e9", "world_size=64", "precision=bf16", "batch_size=1", "network=h100_ib",
                  app="zeroexp.cli.plan", cwd=root)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "NO (state)" in text and "yes (state)" in text  # a parameter count: no activations, no peak model
    assert "(state): model state + gather floor alone" in text
    assert "zero_stage3 (reference)" in text and "never recommended" in text
    sentence = next(line for line in out.stdout.splitlines() if line.startswith("N=64:"))
    assert "the fastest that fits 67.1 GiB (74.5 less 10 %)" in sentence
    assert "judged on model state + gather floor alone" in sentence
    assert not any(name in sentence for name in PAPER)


def test_a_model_the_peak_model_does_not_cover_is_judged_on_state_with_the_cells_reason():
    """LoRA's GPT wrapped at Linear: each frozen base projection is an FSDP unit, and backward never reaches the first
    one (neither its weight nor its input needs a gradient), while the root unit (the adapters) trains. The planner
    gives the FSDP rows no peak, with the reason a cell's memory check gives (``plan.memory.shape_limits``), and still
    the rows the peak model covers their peak."""
    records, _ = _run("model=lora_gpt", "model.n_layer=2", "model.n_embd=32", "model.seq_len=16",
                      "model.vocab_size=64", "wrap=[torch.nn.Linear]", "world_size=2", "batch_size=2",
                      "precision=fp16", "device_memory=1GB", "strategies=[ddp,fsdp_full,fsdp_grad_op,fsdp2_full]")
    rows = {r["strategy"]: r for r in records}
    for name in ("fsdp_full", "fsdp_grad_op", "fsdp2_full"):
        assert rows[name]["peak_bytes"] is None and rows[name]["phase_bytes"] is None, name
        assert "that backward does not reach" in rows[name]["peak_note"], name
        assert "a root unit that trains" in rows[name]["peak_note"], name
    assert rows["ddp"]["peak_bytes"] > rows["ddp"]["total_bytes"] and not rows["ddp"].get("peak_note")


def test_fits_leaves_the_one_headroom_free_in_plan_and_recommend():
    """``fits`` is judged against the device's memory less ``headroom`` (zeroexp.plan.core.usable_bytes, 10 % by
    default): a row whose judged bytes lie between the usable memory and the whole device does not fit, and fits with
    ``headroom=0``; recommend's budget is the same figure; a headroom outside [0, 1) is refused naming its key."""
    from zeroexp.errors import ConfigError
    from zeroexp.plan.core import HEADROOM, usable_bytes

    first = {r["strategy"]: r for r in _run(*TINY_GPT, "world_size=4", "precision=bf16", "device_memory=1TB")[0]}
    judged = first["fsdp2_full"]["fits_bytes"]
    memory = int(judged / (1 - HEADROOM / 2))  # the row's bytes above the usable 90 %, below the whole
    for headroom, fits in ((None, False), (0, True), (0.04, True), (0.2, False)):
        extra = [] if headroom is None else [f"headroom={headroom}"]
        r = {r["strategy"]: r for r in _run(*TINY_GPT, "world_size=4", "precision=bf16", f"device_memory={memory}",
                                            *extra)[0]}["fsdp2_full"]
        h = HEADROOM if headroom is None else headroom
        assert (r["headroom"], r["usable_memory_bytes"]) == (h, usable_bytes(memory, h))
        assert r["fits_bytes"] == judged and r["fits"] is (judged <= usable_bytes(memory, h)) is fits
    from zeroexp.recommend.search import Problem

    assert Problem(None, 8, {}, None, memory, HEADROOM, {}, {}).budget == usable_bytes(memory, HEADROOM)
    for bad in (1.5, -0.1, True):
        with pytest.raises(ConfigError) as e:
            _run(*TINY_GPT, "world_size=4", f"headroom={bad}", "device_memory=1GB")
        assert e.value.key == "headroom"


def test_each_row_shows_the_one_activation_figure_its_fits_uses():
    """``row_activation_bytes``, the memory table's activations column: the forward in the dtypes the row computes in
    (the module cast under FSDP's and DeepSpeed's mixed precision, autocast under DDP's), and for a row judged on
    state + activations the figure its ``fits_bytes`` adds, the fewer of the two."""
    records, _ = _run(*TINY_GPT, "world_size=2", "precision=bf16", "device_memory=1TB", "device=cpu")
    rows = {r["strategy"]: r for r in records}
    autocast, cast = rows["ddp"]["activation_bytes"], rows["ddp"]["activation_cast_bytes"]
    assert cast < autocast  # autocast also saves each weight's bf16 copy
    assert rows["ddp"]["row_activation_bytes"] == rows["zro"]["row_activation_bytes"] == autocast
    for name in ("fsdp_full", "fsdp2_full", "zero2", "deepspeed_stage3"):
        assert rows[name]["row_activation_bytes"] == cast, name
    for r in records:
        if r["fits_on"] == "state+activations":
            assert r["fits_bytes"] == r["device_bytes"] + (r["gather_floor_bytes"] or 0) + r["workspace_bytes"] \
                + r["row_activation_bytes"], r["strategy"]
