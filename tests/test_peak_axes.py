"""The models' terms for activation checkpointing and gradient accumulation: the peak model over
the checkpointed step and over K micro-batches, the memory probe per micro-batch, recompute and micro-batches in the
step time, and the planner's rows; exact figures on given traces and groups, and real cells checked by plan.memory."""

from __future__ import annotations

import pytest

from zeroexp.cell.resolved import Cell
from zeroexp.formulas import (LAYOUTS, ComputeRate, ModelShape, PlanKnobs, Slot, accumulation_repeats,
                              checkpointed_numel, derive_groups, micro_batch_slots, predict_step, recompute_seconds,
                              step_collectives)
from zeroexp.formulas.peak.accumulation import accumulated_grad_bytes, accumulated_phase_peaks
from zeroexp.formulas.peak.checkpointing import checkpointed_forward_bytes, recompute_bytes
from zeroexp.formulas.peak.phases import Segment, StepTrace, phase_peaks
from zeroexp.plan.check.memory import uncovered
from conftest import FLOW, STEPS, WINDOWS

#: A 3-block GPT, small (conf/model/gpt.yaml's width), at N=2: the cells this module checks against the models.
GPT = ("model=gpt", "model.n_layer=3", "world_size=2")
GPT_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)  # conftest.BASE without the mlp's width


def _trace(*segments: dict) -> StepTrace:
    segs = tuple(Segment(ph, f"u{i}", "end", sum(c.values()), c, sum(c.values()), c)
                 for i, (ph, c) in enumerate(segments))
    return StepTrace(batch_size=1, segments=segs, loss_bytes=8, seed_bytes=4)


GIVEN = _trace(("forward", {"activations": 1000}),
               ("backward", {"activations": 500, "temporaries": 300, "gradients": 200}),
               ("backward", {"activations": 100, "temporaries": 50, "gradients": 400}))
TERMS = {"buckets": (400,), "optimizer_numels": (10, 10), "optimizer_itemsize": 4, "foreach": False}


def test_accumulation_takes_each_phase_highest_over_the_micro_batches():
    one = phase_peaks(GIVEN, **FLOW["new"], steady_grad_bytes=400, **TERMS)
    # K=1: the model without accumulation, unchanged.
    assert accumulated_phase_peaks(GIVEN, 1, steady_grad_bytes=400, **TERMS) == one
    two = accumulated_phase_peaks(GIVEN, 2, steady_grad_bytes=400, **TERMS)
    # The second micro-batch starts with the first one's 400 B of gradients and adds into them in place: its
    # backward holds the traced activations and temporaries, no new gradient (792 B), above the first's 592 B.
    assert one["backward"]["bytes"] == 592
    assert two["backward"] == {"bytes": 792, "by_category": {"activations": 492, "temporaries": 300}}
    assert two["forward"] == one["forward"] and two["optimizer"] == one["optimizer"]
    # ZeRO-1's buffers and ZeRO-2's buckets: every micro-batch as one step.
    for flow in ("in_place", "bucket"):
        assert accumulated_phase_peaks(GIVEN, 4, steady_grad_bytes=0, **FLOW[flow], **TERMS) == phase_peaks(
            GIVEN, steady_grad_bytes=0, **FLOW[flow], **TERMS)
    assert [accumulated_grad_bytes(400, live) for live in (False, True)] == [400, 0]
    # each family's: DDP's and ZRO's gradients new, zeroexp's ZeRO's live; FSDP's no_sync is its own model
    rows = {name: LAYOUTS[name] for name in ("ddp", "zro", "zero1", "zero2", "fsdp_full", "deepspeed_stage2")}
    assert {n: r.family.accumulated_grad_bytes(r, 400) for n, r in rows.items()} == {
        "ddp": 400, "zro": 400, "zero1": 0, "zero2": 0, "fsdp_full": None, "deepspeed_stage2": None}


def test_fsdp1_under_no_sync_holds_every_unsharded_gradient():
    from zeroexp.formulas.peak.accumulation import fsdp1_no_sync_phase_peaks
    from zeroexp.formulas.peak.phases import FsdpUnit

    def seg(phase, unit, at, cats):
        return Segment(phase, unit, at, sum(cats.values()), cats, sum(cats.values()), cats)

    trace = StepTrace(1, (seg("forward", "a", "end", {"activations": 100}),
                          seg("forward", "b", "end", {"activations": 200}),
                          seg("forward", "loss", "end", {"activations": 308}),
                          seg("backward", "b", "start", {"activations": 300, "temporaries": 50}),
                          seg("backward", "b", "end", {"activations": 150, "temporaries": 60, "gradients": 40}),
                          seg("backward", "a", "end", {"activations": 20, "temporaries": 60, "gradients": 80}),
                          seg("backward", "root", "end", {"gradients": 90})), loss_bytes=8, seed_bytes=4)

    def peaks(reshard_after_forward: bool, prefetch: str = "none") -> dict:
        return fsdp1_no_sync_phase_peaks(trace, [FsdpUnit(48, 24, 40)] * 2, [40, 40], micro_batches=2,
                                         reshard_after_forward=reshard_after_forward, root=16, root_grads=10,
                                         steady_grad_bytes=45, prefetch=prefetch, gloo=False, optimizer_numels=(7,),
                                         optimizer_itemsize=4, foreach=False)

    got = peaks(False)  # SHARD_GRAD_OP
    # Later micro-batches: both units and the root unsharded (112), every unsharded gradient (90) less the steady
    # shards (45), beside the forward's 300 B at the loss.
    assert got["forward"] == {"bytes": 300 + 112 + 45, "by_category": {"activations": 300, "unsharded": 112,
                                                                       "comm": 90, "gradients": -45}}
    # The loss's backward before any post-backward hook: every unit and gradient held, autograd adding in place.
    assert got["backward"] == {"bytes": 292 + 50 + 112 + 45, "by_category": {
        "activations": 292, "temporaries": 50, "unsharded": 112, "comm": 90, "gradients": -45}}
    # FULL_SHARD: the root alone gathered at the loss (no prefetch); BACKWARD_PRE's root hook gathers b there too
    got = peaks(True)
    assert got["forward"] == {"bytes": 300 + 16 + 45, "by_category": {"activations": 300, "unsharded": 16,
                                                                      "comm": 90, "gradients": -45}}
    assert got["backward"] == {"bytes": 292 + 50 + 16 + 45, "by_category": {
        "activations": 292, "temporaries": 50, "unsharded": 16, "comm": 90, "gradients": -45}}
    assert peaks(True, "pre")["backward"]["by_category"]["unsharded"] == 16 + 48


def test_checkpointing_from_the_per_unit_figures():
    units = {"b0": 700, "b1": 900, "root": 300}
    assert recompute_bytes(units) == 900  # the largest checkpointed unit; the root is not checkpointed
    assert checkpointed_forward_bytes(2000, units, {"b0": 100, "b1": 100}) == 2000 - 1600 + 200
    assert recompute_bytes({"root": 5}) == 0


def test_what_the_peak_model_covers():
    assert uncovered("ddp", "fp32", "none", activation_checkpointing="full", micro_batches=4) == []
    assert uncovered("zero2", "fp32", "none", micro_batches=2) == []
    assert uncovered("fsdp2_full", "fp32", "none", activation_checkpointing="full") == []
    assert uncovered("fsdp_grad_op", "fp32", "none", micro_batches=2) == []  # SHARD_GRAD_OP under no_sync
    for row in ("fsdp_full", "fsdp_grad_op", "fsdp_HYBRID_SHARD", "fsdp__HYBRID_SHARD_ZERO2"):  # FSDP1's no_sync
        for ac in ("none", "full", "selective_layer", "selective_op"):
            assert uncovered(row, "bf16", "none", ac, 2, param_dtype="bfloat16") == [], (row, ac)
    for row in ("fsdp_full", "fsdp_grad_op"):  # reducing every micro-batch, any checkpointing and precision
        assert uncovered(row, "bf16", "none", "selective_op", 2, sync_each_microbatch=True,
                         param_dtype="bfloat16") == []
    assert uncovered("fsdp_HYBRID_SHARD", "fp32", "none", micro_batches=2, sync_each_microbatch=True) == []
    for each in (True, False):  # HSDP's all-reduce buffers held to backward's end (tests/test_hybrid_accum.py)
        assert uncovered("fsdp2_hybrid", "bf16", "none", "full", 2, sync_each_microbatch=each,
                         param_dtype="bfloat16") == []


def test_the_memory_probe_keeps_each_phase_highest_over_micro_batches():
    from zeroexp.rank.microbatches import OptimizerSteps
    from zeroexp.probes.memory import _keep_higher

    phases: dict = {}
    for got in ((10, {"activations": 10}), (30, {"activations": 30}), (20, {"activations": 20})):
        _keep_higher(phases, "forward", got)
    assert phases == {"forward": (30, {"activations": 30})}

    class Seen:
        def __init__(self):
            self.calls = []

        def on_train_batch_start(self, trainer, pl_module, batch, step):
            self.calls.append(("start", step))

        def on_micro_batch_start(self, trainer, pl_module, batch, step, micro):
            self.calls.append(("micro", step, micro))

    seen = Seen()
    steps = OptimizerSteps([seen], 3)
    for i in range(6):
        steps.on_train_batch_start(None, None, None, i)
    assert seen.calls == [("start", 0), ("micro", 0, 1), ("micro", 0, 2), ("start", 1), ("micro", 1, 1),
                          ("micro", 1, 2)]


def test_planner_rows_under_checkpointing_and_accumulation():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.errors import ConfigError
    from zeroexp.cli.plan import register, run

    register()
    base = ["model=gpt", "model.n_layer=3", "world_size=2", "batch_size=8", "strategies=[ddp,zero2,fsdp_full]",
            "device_memory=5000000", "headroom=0", "device=cpu"]  # fits on the whole 5 MB
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        plain, ac, ga = (hydra_compose(config_name="plan", overrides=[*base, *extra]) for extra in
                         ((), ("activation_checkpointing=full",), ("grad_accum=4", "network=h100_ib")))
        bad = hydra_compose(config_name="plan", overrides=[*base, "grad_accum=0"])
    rows = {name: {r["strategy"]: r for r in run(cfg)[0]} for name, cfg in (("plain", plain), ("ac", ac), ("ga", ga))}
    # Checkpointed: forward keeps each block's input (3 x 65536 B) instead of its activations (3 x 1056768 B).
    assert rows["ac"]["ddp"]["activation_bytes"] == rows["plain"]["ddp"]["activation_bytes"] - 3 * (1056768 - 65536)
    assert rows["ac"]["ddp"]["recompute_bytes"] == 1056768 and rows["plain"]["ddp"]["recompute_bytes"] is None
    for name in ("ddp", "zero2", "fsdp_full"):
        assert rows["ac"][name]["peak_bytes"] < rows["plain"][name]["peak_bytes"], name
        assert rows["ac"][name]["fits"] and not rows["plain"][name]["fits"], name  # 5 MB: only checkpointed
    # Accumulation: DDP's later micro-batches hold the whole gradient from their start; four micro-batches' reduce-
    # scatters for zero2, one all_reduce for ddp; FULL_SHARD's no_sync holds every unit's unsharded gradient.
    assert rows["ga"]["ddp"]["accum_grad_bytes"] == rows["ga"]["ddp"]["grad_bytes"]
    assert rows["ga"]["ddp"]["phase_bytes"]["backward"] > rows["plain"]["ddp"]["phase_bytes"]["backward"]
    assert rows["ga"]["zero2"]["counts"]["reduce_scatter"] == 4 * rows["plain"]["zero2"]["counts"]["reduce_scatter"]
    assert rows["ga"]["ddp"]["counts"] == rows["plain"]["ddp"]["counts"]
    assert rows["ga"]["fsdp_full"]["peak_bytes"] and not rows["ga"]["fsdp_full"].get("peak_note")
    assert rows["ga"]["fsdp_full"]["phase_bytes"]["backward"] > rows["plain"]["fsdp_full"]["phase_bytes"]["backward"]
    assert all(r["grad_accum"] == 4 and r["step_ms"] > 0 for r in rows["ga"].values())
    with pytest.raises(ConfigError) as e:
        run(bad)
    assert e.value.key == "grad_accum"


def _gpt_cfg(n_layer: int = 3):
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": "gpt", "_target_": "zeroexp.models.gpt.GPT", "vocab_size": 256, "seq_len": 32,
                             "n_layer": n_layer, "n_head": 4, "n_embd": 64, "bias": True, "tie_weights": True,
                             "input_shape": [32], "dtype": "long", "low": 0, "high": 256, "loss": "next_token"})


def test_the_checkpointed_trace_keeps_what_the_per_unit_figures_say():
    from zeroexp.models.gpt import Block
    from zeroexp.plan.activations import trace_activations
    from zeroexp.plan.steptrace import trace_step

    cfg, batch = _gpt_cfg(), 8
    bare, ckpt = (trace_step(cfg, batch, [Block], checkpointing=c) for c in (False, True))
    per_unit = trace_activations(cfg, batch, [Block])
    at_loss = [next(s for s in t.segments if s.unit == "loss").end_by_category["activations"] for t in (bare, ckpt)]
    # Checkpointed, forward keeps what it keeps without, less each block's saved activations, plus each block's input
    # (3 x 8 x 32 x 64 fp32): 585932 B where the bare forward keeps 3559628 B (traced).
    assert per_unit.unit_input_bytes == {f"h.{k}": 8 * 32 * 64 * 4 for k in range(3)}
    assert at_loss[1] == checkpointed_forward_bytes(at_loss[0], per_unit.unit_bytes, per_unit.unit_input_bytes)
    assert at_loss == [3559628, 585932]
    # The recompute holds one block's activations at a time: the step's peak well below the bare step's.
    assert recompute_bytes(per_unit.unit_bytes) == per_unit.unit_bytes["h.0"]
    assert max(s.peak_bytes for s in ckpt.segments) < max(s.peak_bytes for s in bare.segments) / 2
    # The segments are those of the bare step: every block's forward and backward, once.
    assert [(s.phase, s.at) for s in ckpt.segments] == [(s.phase, s.at) for s in bare.segments]


def test_recompute_and_micro_batches_in_the_step_time():
    shape = ModelShape(params=((64, 64),) * 4 + ((8,),), units=((0,), (1,), (2,), (3,), (4,)),
                       root=(False,) * 4 + (True,))
    assert checkpointed_numel(shape.units, shape.root, shape.numels) == 4 * 64 * 64
    assert recompute_seconds(2.0, 3, 4) == 1.5 and recompute_seconds(2.0, 0, 0) == 0.0
    slots = [Slot("all_gather", 1, 0.0, 1.0), Slot("reduce_scatter", 1, 2.0, 3.0), Slot("all_reduce", 1, 2.5, 3.0)]
    laid = micro_batch_slots(slots, {"reduce_scatter": 3.0}, 3, 3.0)
    # Sent each micro-batch: three copies 3 s apart; sent once: an all_gather in the first, the rest in the last.
    assert [(s.op, s.issue_s, s.need_s) for s in laid] == [
        ("all_gather", 0.0, 1.0), ("reduce_scatter", 2.0, 3.0), ("reduce_scatter", 5.0, 6.0),
        ("reduce_scatter", 8.0, 9.0), ("all_reduce", 8.5, 9.0)]
    rate = ComputeRate(1e-9, 2e-9, 1e-8)
    mlp = ModelShape(params=((256, 256),) * 4, units=tuple((i,) for i in range(4)), root=(False,) * 4)
    for name, want in (("ddp", {"all_reduce": 1.0}), ("zero2", {"reduce_scatter": 4.0, "all_gather": 1.0}),
                       ("fsdp_full", {"all_gather": 4.0, "reduce_scatter": 1.0})):
        knobs = PlanKnobs(bucket_cap_bytes=2**20, micro_batches=4)
        groups = derive_groups(name, LAYOUTS[name], mlp, 2, 4, knobs)
        assert accumulation_repeats(LAYOUTS[name], groups, 4, knobs) == want
        t = predict_step(LAYOUTS[name], groups, step_collectives(LAYOUTS[name], groups, 4, knobs), rate, 8,
                         lambda op, s, calls: 1e-3 * calls, False, checkpointed=mlp.numel, micro_batches=4,
                         repeats=want)
        f = 1e-9 * mlp.numel * 8
        assert t.forward_s == pytest.approx(4 * f) and t.recompute_s == pytest.approx(4 * f)  # every unit again
        assert t.backward_s == pytest.approx(4 * 2 * f) and t.micro_batches == 4
        calls = sum(e["count"] for e in step_collectives(LAYOUTS[name], groups, 4, knobs).values())
        assert t.step_s == pytest.approx(4 * f + 4 * f + 8 * f + t.optimizer_s + 1e-3 * calls)


def _predicted_forward(cfg) -> int:
    """The peak model's forward prediction for a composed cell, without running it (``plan.memory``'s dry form)."""
    from zeroexp.cell.resolved import layout_of
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.plan.check.memory import memory_section
    from zeroexp.plan.shape import model_shape

    name, _ = layout_of(cfg)
    cell = Cell.of(cfg)
    section = memory_section(cell, {}, name, cell_groups(cell), 4, [import_class(p) for p in wrap_paths(cfg)],
                             model_shape(cfg.model, wrap_paths(cfg)))
    return section["phases"]["forward"]["predicted_bytes"]


#: case -> overrides on the 3-block GPT at N=2; each runs once (the `cell` cache) and plan.memory must PASS.
CELLS = {
    **{f"{s}-ac": (f"strategy={s}", "activation_checkpointing=full")
       for s in ("ddp", "fsdp_full", "fsdp2_full", "zero2")},
    **{f"{s}-ga2": (f"strategy={s}", "grad_accum=2") for s in ("ddp", "fsdp_grad_op", "zero2")},
    "fsdp_full-ga2-each": ("strategy=fsdp_full", "grad_accum=2", "strategy.sync_each_microbatch=true"),
}


def test_checkpointed_and_accumulating_cells_read_plan_memory_pass(cell, compose):
    """One grid of real cells (gpt, 3 blocks, N=2): under activation_checkpointing=full the forward peak is cut to
    what the checkpointed blocks leave, as the peak model predicts (every phase PASS, within 2 % and never above the
    measurement); under grad_accum=2 the memory probe measures every micro-batch and the model predicts it."""
    for case, overrides in CELLS.items():
        r = cell(*overrides, *GPT, base=GPT_BASE)
        assert r.status == "ok", (case, r.error)
        memory = r.summary["plan"]["memory"]
        assert memory["check"] == "PASS", (case, memory.get("reasons"))
        assert set(memory["phases"]) == {"steady", "forward", "backward", "optimizer"}, case
        for probe in ("state", "collectives", "equivalence"):
            assert r.summary[probe]["check"] == "PASS", (case, probe, r.summary[probe].get("reasons"))
        if case.endswith("-ac"):
            fwd = memory["phases"]["forward"]
            bare = _predicted_forward(compose(*overrides[:1], *GPT, base=GPT_BASE))
            assert fwd["predicted_bytes"] <= fwd["measured_bytes"] < bare, case
        else:
            assert memory["trace"]["micro_batches"] == 2


def test_plan_time_of_a_cell_counts_its_recompute_and_micro_batches(compose, tmp_path):
    import json

    from test_time import calibration_data
    from zeroexp.plan.check.step_time import time_section

    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_data(numel=8 * 64 * 64)))
    summary = {"timing": {"step_ms": [10.0] * 40}, "collectives": {"exposed_comm_ms": 1.5}}
    plain, ac, ga = (time_section(Cell.of(compose("strategy=ddp", "world_size=2", f"calibration={path}", *extra)),
                                  summary) for extra in ((), ("activation_checkpointing=full",), ("grad_accum=2",)))
    one, ckpt, two = (t["predicted_by_phase"] for t in (plain, ac, ga))
    # Every Linear of the mlp is a checkpointed unit (the root has no parameters): the whole forward again.
    assert ckpt["recompute"] == pytest.approx(one["forward"]) and one["recompute"] == 0
    assert ckpt["backward"] == pytest.approx(one["backward"]) and ckpt["comm"] == pytest.approx(one["comm"])
    assert ac["predicted_step_ms"] == pytest.approx(plain["predicted_step_ms"] + one["forward"])  # no overlap here
    # Two micro-batches: twice the forward and backward, one optimizer step, DDP's one all_reduce of the step.
    assert two["forward"] == pytest.approx(2 * one["forward"]) and two["backward"] == pytest.approx(2 * one["backward"])
    assert two["optimizer"] == pytest.approx(one["optimizer"]) and two["comm"] == pytest.approx(one["comm"])
    assert ga["throughput"]["samples_per_s"] == pytest.approx(2 * plain["throughput"]["samples_per_s"])
