"""The peak model: the traced step, AdamW's temporaries, each gradient flow's phase peaks, and plan.memory
checked against the memory probe in real cells (exact predicted categories on small cases, not only the tolerance)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.phases import Segment, StepTrace, phase_peaks
from zeroexp.plan.check.judge import judge as _judge
from zeroexp.plan.steptrace import trace_step
from conftest import FLOW

W, DEPTH, B = 64, 8, 8  # tests/conftest.py's BASE model at its per-rank batch
ACT = B * W * 4  # one Linear's output, fp32
P = DEPTH * W * W * 4


def _mlp(width: int = W, depth: int = DEPTH):
    return OmegaConf.create({"name": "mlp", "_target_": "zeroexp.models.LinearStack", "width": width, "depth": depth,
                             "input_shape": [width]})


def test_adamw_temporaries_single_tensor_and_foreach():
    # Single-tensor: the previous parameter's denom is still bound while the next one's sqrt and quotient exist.
    assert adamw_temporaries([10], 4, foreach=False) == 2 * 10 * 4
    assert adamw_temporaries([10, 10, 10], 4, foreach=False) == 3 * 10 * 4
    assert adamw_temporaries([100, 10], 4, foreach=False) == 2 * 100 * 4  # 100 + 2*10 < 2*100
    assert adamw_temporaries([10, 100], 4, foreach=False) == (10 + 200) * 4
    assert adamw_temporaries([10, 100], 4, foreach=True) == 110 * 4  # one _foreach_sqrt list
    assert adamw_temporaries([], 4, foreach=False) == 0


def test_trace_of_the_linear_stack_is_exact():
    trace = trace_step(_mlp(), B, [torch.nn.Linear])
    fwd = [s for s in trace.segments if s.phase == "forward" and s.at == "end" and s.unit != "loss"]
    assert [s.end_bytes for s in fwd] == [ACT * (k + 1) for k in range(DEPTH)]  # each Linear saves its input
    loss = next(s for s in trace.segments if s.unit == "loss")
    # out ** 2 (ACT) and the mean (4 B) at the loss's peak; the loss and Lightning's copy of it held after; the copy
    # kept to the next step's forward (and the loss itself where the cell logs it: StepTrace.for_cell)
    assert loss.peak_bytes == DEPTH * ACT + ACT + 4 and trace.loss_bytes == trace.seed_bytes == 4
    assert trace.for_cell(True).loss_bytes == 8 and trace.for_cell(False) == trace
    end = trace.segments[-1]
    assert (end.phase, end.unit) == ("backward", "root") and end.end_by_category["gradients"] == P


def _trace(*segments: tuple[str, int, dict]) -> StepTrace:
    segs = tuple(Segment(ph, f"u{i}", "end", sum(c.values()), c, sum(c.values()), c)
                 for i, (ph, _, c) in enumerate(segments))
    return StepTrace(batch_size=1, segments=segs, loss_bytes=8, seed_bytes=4)


def test_each_gradient_flow_on_a_given_trace():
    t = _trace(("forward", 0, {"activations": 1000}),
               ("backward", 0, {"activations": 500, "temporaries": 300, "gradients": 200}),
               ("backward", 0, {"activations": 100, "temporaries": 50, "gradients": 400}))
    kw = {"buckets": (400,), "optimizer_numels": (10, 10), "optimizer_itemsize": 4, "foreach": False}
    new = phase_peaks(t, **FLOW["new"], steady_grad_bytes=400, **kw)
    assert new["forward"] == {"bytes": 992, "by_category": {"activations": 992}}
    # zero_grad freed the 400 B of steady gradients; autograd allocates them again.
    assert new["backward"] == {"bytes": 592, "by_category": {"activations": 492, "temporaries": 300, "gradients": -200}}
    assert new["optimizer"] == {"bytes": 120, "by_category": {"optimizer_state": 120}}
    in_place = phase_peaks(t, **FLOW["in_place"], steady_grad_bytes=0, **kw)
    assert in_place["backward"] == {"bytes": 792, "by_category": {"activations": 492, "temporaries": 300}}
    # The bucket opens with the first ready gradient (after segment 1): held in segment 2 only; segment 1 may have
    # opened it before its peak: the upper end of the range.
    bucket = phase_peaks(t, **FLOW["bucket"], steady_grad_bytes=0, **kw)
    lower = {k: v for k, v in bucket["backward"].items() if not k.startswith("upper")}
    assert lower == {"bytes": 792, "by_category": {"activations": 492, "temporaries": 300}}
    assert bucket["backward"]["upper_bytes"] == 792 + 400
    assert bucket["backward"]["upper_by_category"] == {"activations": 492, "temporaries": 300, "comm": 400}
    # ... and stays open after its last gradient, until the step releases it.
    t2 = _trace(*t_segments(t), ("backward", 0, {"activations": 50, "temporaries": 700, "gradients": 400}))
    assert phase_peaks(t2, **FLOW["bucket"], steady_grad_bytes=0, **kw)["backward"]["by_category"] == {
        "activations": 42, "temporaries": 700, "comm": 400}
    # The step begins with the bucket alive (400 B > AdamW's 120 B); it is released before the update.
    assert bucket["optimizer"] == {"bytes": 400, "by_category": {"comm": 400}}
    with pytest.raises(ValueError, match="open_buckets needs live_grads"):
        phase_peaks(t, steady_grad_bytes=0, open_buckets=True, **kw)


def test_gloos_reduced_copy_at_each_buckets_wait():
    """Two buckets, reduced in backward order (300 B, then 100 B), waited for by the step in definition order (100 B
    first): at the first wait both buckets and the 100 B copy (500), at the second the 300 B bucket and its copy (600):
    the peak; waited in the other order it would be 700."""
    t = _trace(("forward", 0, {"activations": 10}), ("backward", 0, {"activations": 5, "gradients": 400}))
    kw = {"buckets": (300, 100), "optimizer_numels": (10,), "optimizer_itemsize": 4, "foreach": False}
    zero2 = phase_peaks(t, **FLOW["bucket"], steady_grad_bytes=0, reduce_copies=True, **kw)
    assert zero2["optimizer"] == {"bytes": 600, "by_category": {"comm": 300, "optimizer_state": 300}}
    zero1 = phase_peaks(t, **FLOW["in_place"], steady_grad_bytes=0, reduce_copies=True, **kw)  # buckets are steady
    assert zero1["optimizer"] == {"bytes": 300, "by_category": {"optimizer_state": 300}}
    nccl = phase_peaks(t, **FLOW["bucket"], steady_grad_bytes=0, **kw)  # no copy: the buckets alone
    assert nccl["optimizer"] == {"bytes": 400, "by_category": {"comm": 400}}
    new = phase_peaks(t, **FLOW["new"], steady_grad_bytes=0, reduce_copies=True, **kw)
    assert new["optimizer"]["bytes"] == 80  # AdamW


def t_segments(t: StepTrace):
    return [(s.phase, 0, s.peak_by_category) for s in t.segments]


def test_the_check_is_a_lower_bound_within_two_percent_with_one_named_late_tensor():
    assert _judge(1000, 1000, [])[0] == "PASS"
    assert _judge(1000, 981, [])[0] == "PASS"
    assert _judge(1000, 979, [])[0] == "FAIL"  # 2.1 % short
    assert _judge(1000, 1001, [])[0] == "FAIL"  # never above the measurement
    verdict, note, _ = _judge(1500, 1000, [("bucket 0", 500), ("bucket 1", 800)])  # the smallest that covers it
    assert verdict == "PASS" and note == "500 B above the prediction, within one late-freed tensor: bucket 0 (500 B)"
    assert _judge(2000, 1000, [("bucket 0", 500), ("bucket 1", 800)])[0] == "FAIL"  # at most one such tensor
    assert _judge(1000, 1500, [("bucket 0", 500)])[0] == "FAIL"  # never above
    # a range (a moment only gloo's timing decides) and one earlier late tensor at once: FSDP2's frozen_middle at N=3
    # measured 5,384 B in backward against 3,332-4,228, one unit's 1,152-B reduce-scatter input more than the range
    late = [("one unit's reduce-scatter tensor", 384), ("one unit's reduce-scatter tensor", 1152)]
    verdict, note, _ = _judge(5384, 3332, late, upper=4228, upper_note="gloo's copy")
    assert verdict == "PASS" and note.startswith("1156 B above the predicted range's upper end 4228 B (gloo's copy)")
    assert note.endswith("(1152 B)")  # the smallest that covers it
    assert _judge(5384, 3332, late[:1], upper=4228)[0] == "FAIL"  # not covered by the 384-B one
    assert _judge(4228 + 2 * 1152, 3332, late, upper=4228)[0] == "FAIL"  # at most one beside the range
    assert _judge(3000, 3332, late, upper=4228)[0] == "FAIL"  # never above


@pytest.mark.parametrize("strategy, logger", [("ddp", "none"), ("zro", "none"), ("zero1", "none"),
                                              ("zero2", "none"), ("ddp", "csv")])
def test_plan_memory_passes_with_exact_categories(cell, strategy, logger):
    memory = cell(f"strategy={strategy}", "world_size=2", f"logger={logger}").summary["plan"]["memory"]
    assert memory["check"] == "PASS", memory["reasons"]
    phases = memory["phases"]
    # the outputs, out ** 2 and the mean; the last step's copy of its loss freed (and, logged under logger=csv, the
    # loss itself: self.log held it)
    fwd = DEPTH * ACT + ACT + 4 - (8 if logger == "csv" else 4)
    assert phases["forward"]["predicted_by_category"] == {"activations": fwd}
    assert phases["forward"]["measured_bytes"] == fwd
    if strategy in ("ddp", "zro"):  # AdamW's temporaries: a W^2 denom beside the next one's sqrt and quotient
        assert phases["optimizer"]["predicted_by_category"] == {"optimizer_state": 3 * W * W * 4}
    else:  # gloo's reduce_scatter hands back a reduced copy of the bucket at its wait (AdamW's over the shard: P too)
        want = {"comm": P, "optimizer_state": P} if strategy == "zero2" else {"optimizer_state": P}
        assert phases["optimizer"]["predicted_by_category"] == want  # zero2: beside the bucket, not released yet
    if strategy == "zero2":  # the first wait is the phase's peak, exactly: no tensor freed late
        assert "late_free" not in phases["optimizer"]
        assert phases["optimizer"]["measured_by_category"] == {**want, "activations": 4}  # + the loss (released later)
        assert phases["backward"]["predicted_by_category"]["comm"] == P  # the bucket, open through backward
    elif strategy == "zero1":  # under load gloo may free its reduce_scatter's copy of the bucket late (one, named)
        late = phases["optimizer"].get("late_free")
        assert late is None or late.endswith(f"bucket 0's copy gloo's reduce_scatter made of its full gradient ({P} B)")
    else:
        assert "late_free" not in phases["optimizer"]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp_full"])
def test_the_launching_process_plans_after_the_ranks(cell, compose, strategy):
    """Rank 0 leaves what the ranks measured (``.ranks/measured.json``: no plan); the launching process adds the plan
    (zeroexp.launch.epilogue) from the Cell, and the same records planned again give the same plan."""
    from pathlib import Path

    from zeroexp.cell.resolved import Cell
    from zeroexp.plan.check.cell import plan_section
    from zeroexp.rank.summary import MEASURED, RANKS_DIR
    from zeroexp.results.files import read_json

    r = cell(f"strategy={strategy}", "world_size=2")
    measured = read_json(Path(r.cell_dir) / RANKS_DIR / MEASURED)
    assert set(measured) == {"summary", "live_groups", "itself"} and "plan" not in measured["summary"]
    assert {k: v for k, v in r.summary.items() if k != "plan"} == measured["summary"]
    assert r.summary["plan"]["memory"]["check"] == "PASS", r.summary["plan"]["memory"]["reasons"]
    again = plan_section(Cell.of(compose(f"strategy={strategy}", "world_size=2")), Path(r.cell_dir),
                         measured["summary"], itself=measured["itself"], live_groups=measured["live_groups"])
    assert {k: v for k, v in again.items() if k != "time"} == {k: v for k, v in r.summary["plan"].items()
                                                               if k != "time"}


def test_fsdp1_units_are_held_as_the_strategy_says(cell):
    # SHARD_GRAD_OP: every unit stays unsharded through forward, so the peak is at the loss with all 8 held.
    grad_op = cell("strategy=fsdp_grad_op", "world_size=2").summary["plan"]["memory"]
    assert grad_op["check"] == "PASS", grad_op["reasons"]
    fwd = DEPTH * ACT + ACT + 4 - 4  # the last step's copy of its loss freed
    assert grad_op["phases"]["forward"]["predicted_by_category"] == {"activations": fwd, "unsharded": P}
    # use_orig_params (the default): backward starts holding the steady gradient shards (zero_grad dropped only the
    # original parameters' views; the root's pre-backward hook frees them), the forward's end (the new loss beside
    # its copy, steady's copy freed: 4 B) and the loss's 4-B seed; without it zero_grad freed them before backward,
    # whose peak is later.
    back = grad_op["phases"]["backward"]
    assert back["predicted_by_category"] == {"activations": DEPTH * ACT + 4, "unsharded": P, "temporaries": 4}
    flat = cell("strategy=fsdp_grad_op", "world_size=2", "strategy.use_orig_params=false").summary["plan"]["memory"]
    assert flat["check"] == "PASS", flat["reasons"]
    assert flat["phases"]["backward"]["predicted_by_category"]["gradients"] < 0
    # FULL_SHARD at N=3 on width 10: each unit's 100 elements padded to 102 (408 B unsharded, 136 B a shard); the
    # forward peak is the last unit computing, one unit held.
    act, unit = B * 10 * 4, 102 * 4
    full = cell("strategy=fsdp_full", "prefetch=pre", "world_size=3", "model.width=10").summary["plan"]["memory"]
    assert all(p["measured_bytes"] >= p["predicted_bytes"] for ph, p in full["phases"].items() if ph != "steady")
    assert full["phases"]["forward"]["predicted_by_category"] == {"activations": DEPTH * act - 4, "unsharded": unit}
    # AdamW over eight 34-element shards: 3 x 34 x 4 B.
    assert full["phases"]["optimizer"]["predicted_by_category"] == {"optimizer_state": 3 * 34 * 4}


def test_fsdp2_keeps_an_all_gather_output_beside_the_unsharded_parameters(cell):
    memory = cell("strategy=fsdp2_full", "world_size=3", "model.width=10").summary["plan"]["memory"]
    # FSDP2 pads each weight's 10 rows to 12 (N=3): 480 B a unit. At the last unit's copy-out the previous
    # all-gather output, its own and its unsharded parameters: three unit-sizes beside the first seven activations.
    act, unit = B * 10 * 4, 12 * 10 * 4
    assert memory["phases"]["forward"]["predicted_by_category"] == {"activations": 7 * act - 4, "unsharded": 3 * unit}
    # A lower bound in every phase (its PASS is not asserted here: on units this small one batch-sized tensor
    # freed late by the training loop or gloo, seen once in a run, is more than the 2 % band).
    assert all(p["measured_bytes"] >= p["predicted_bytes"] for ph, p in memory["phases"].items() if ph != "steady")


def test_plan_memory_judges_fsdp1_below_fp32(cell):
    # SHARD_GRAD_OP's no_sync in bf16: the unsharded gradients bf16 (autograd's), the steady shards zero_grad frees
    # fp32 (FSDP1 casts each reduced shard to the parameters' dtype); every rank PASS
    memory = cell("strategy=fsdp_grad_op", "world_size=2", "precision=bf16", "grad_accum=2").summary["plan"]["memory"]
    assert memory["check"] == "PASS" and [r["check"] for r in memory["ranks"]] == ["PASS", "PASS"], memory["reasons"]
    # bf16 with checkpointing: judged, every phase PASS
    memory = cell("strategy=fsdp_full", "world_size=2", "precision=bf16",
                  "activation_checkpointing=full").summary["plan"]["memory"]
    assert memory["check"] == "PASS", memory["reasons"]


def test_planner_rows_judge_fits_on_the_peak():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.cli.plan import register, run

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        base = ["model=mlp", f"model.width={W}", f"model.depth={DEPTH}", "world_size=2", "device_memory=1000000",
                "device=cpu", "strategies=[ddp,zero2,fsdp_full,deepspeed_stage0]"]  # a CPU cell's semantics
        cfg = hydra_compose(config_name="plan", overrides=[*base, f"batch_size={B}"])
        twice = hydra_compose(config_name="plan", overrides=[*base, f"batch_size={2 * B}"])
        counted = hydra_compose(config_name="plan", overrides=["params=1e6", "batch_size=8"])
    rows = {r["strategy"]: r for r in run(cfg)[0]}
    ddp = rows["ddp"]
    # DDP: 4P of state + P of buckets + AdamW's single-tensor temporaries (3 layers) in the optimizer step.
    assert ddp["phase_bytes"]["optimizer"] == 3 * W * W * 4 and ddp["peak_phase"] == "optimizer"
    assert ddp["peak_bytes"] == ddp["device_bytes"] + P + 3 * W * W * 4
    assert ddp["fits_on"] == "peak" and ddp["fits"] == (ddp["peak_bytes"] <= 1_000_000)
    assert ddp["init_peak_bytes"] == P  # every rank builds the whole fp32 model first
    # DeepSpeed stage 0 (zeroexp.formulas.peak.ds_stage0): the step frees every gradient; backward's epilogue holds
    # them beside their flat all_reduce copy (one chunk: 2P) and the step's loss (4 B: its copy replaced steady's),
    # above the optimizer's P + AdamW's 3 layers
    ds0 = rows["deepspeed_stage0"]
    assert ds0["phase_bytes"]["backward"] == 2 * P + 4 and ds0["phase_bytes"]["optimizer"] == P + 3 * W * W * 4
    assert ds0["peak_phase"] == "backward"
    assert ds0["peak_bytes"] == ds0["device_bytes"] - ds0["grad_bytes"] + 2 * P + 4
    assert ds0["fits_on"] == "peak" and not ds0.get("peak_note")
    # Forward holds the activations: twice the batch, twice the traced forward (less the loss scalar kept).
    doubled = {r["strategy"]: r for r in run(twice)[0]}
    assert doubled["ddp"]["phase_bytes"]["forward"] + 4 == 2 * (ddp["phase_bytes"]["forward"] + 4) - 4
    counted_rows = run(counted)[0]
    assert all(r["peak_bytes"] is None for r in counted_rows)
    assert all("give model=" in r["peak_note"] for r in counted_rows if r["strategy"] in ("ddp", "zero2"))
    assert all(r["fits_on"] == "state" for r in counted_rows)  # a count: no activations to add


def test_fsdp1_root_prefetches_the_first_unit_under_backward_pre():
    from zeroexp.formulas.peak.phases import FsdpUnit, fsdp_phase_peaks

    def seg(phase, unit, at, peak, end=None):
        end = peak if end is None else end
        return Segment(phase, unit, at, peak, {"activations": peak}, end, {"activations": end})

    # Two units; the loss's backward (before unit b's pre-backward hook) is the step's largest transient: 1000 B.
    trace = StepTrace(1, (seg("forward", "a", "start", 0), seg("forward", "a", "end", 10),
                          seg("forward", "b", "start", 10), seg("forward", "b", "end", 20),
                          seg("forward", "loss", "end", 30, 28), seg("backward", "b", "start", 1000, 20),
                          seg("backward", "b", "end", 20), seg("backward", "a", "start", 10),
                          seg("backward", "a", "end", 10), seg("backward", "root", "end", 8)),
                      loss_bytes=8, seed_bytes=4)
    units = [FsdpUnit(100, 50, 100)] * 2

    def backward(prefetch: str, root: int) -> int:
        return fsdp_phase_peaks(trace, units, root=root, steady_grad_bytes=100, reshard_after_forward=True,
                                prefetch=prefetch, gloo=False, optimizer_numels=(25, 25), optimizer_itemsize=4,
                                foreach=False)["backward"]["bytes"]

    # 992 B of the trace, the root's 10 B, zero_grad's -100 B; a root with parameters prefetches unit b in its own
    # pre-backward hook under BACKWARD_PRE (+100 B); without a root unit, or under POST, nothing is held yet.
    assert backward("pre", 10) == 992 + 10 + 100 - 100
    assert backward("post", 10) == 992 + 10 - 100
    assert backward("pre", 0) == 992 - 100
