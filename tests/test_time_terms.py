"""The step-time model's framework terms (zeroexp.formulas.time.framework) and the calibration's one-call method,
through
their structure: exact results on given calibrations, never timing asserts."""

from __future__ import annotations

import json

import pytest

from zeroexp.cell.resolved import Cell
from zeroexp.results.calibration import Calibration
from zeroexp.results.verdict import Code
from zeroexp.formulas import (LAYOUTS, ComputeRate, FrameworkCost, ModelShape, PlanKnobs, derive_groups,
                              framework_time, predict_step, step_collectives)

MLP = ModelShape(params=((768, 768),) * 8, units=tuple((i,) for i in range(8)), root=(False,) * 8)
PSI = 8 * 768 * 768
CPU = __import__("torch").device("cpu")
COST = FrameworkCost(loop_s=1e-3, ddp_bucket_s=2e-4, zro_broadcast_s=3e-4, fsdp1_call_s=5e-4, copy_s_per_byte=1e-10)
KNOBS = PlanKnobs()  # the default 25 MiB bucket cap: the 18 MiB mlp is one bucket


def _groups(row: str, n: int = 2):
    layout = LAYOUTS[row]
    return layout, derive_groups(row, layout, MLP, n, 4, KNOBS)


def test_every_row_pays_the_loop_after_the_optimizer():
    for row in ("ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp_full", "fsdp2_full", "deepspeed_stage2"):
        t = framework_time(*_groups(row), 4, COST)
        assert t.terms["loop"] == 1e-3 and t.optimizer_s >= 1e-3
        assert t.total_s == pytest.approx(sum(t.terms.values()))


def test_ddp_and_zro_pay_per_bucket_and_per_broadcast():
    ddp = framework_time(*_groups("ddp"), 4, COST)
    assert ddp.terms == {"loop": 1e-3, "ddp_bucket_calls": 2e-4}  # one bucket: 18 MiB under the 25 MiB cap
    assert (ddp.forward_s, ddp.backward_s, ddp.optimizer_s) == (0.0, 2e-4, 1e-3)
    zro = framework_time(*_groups("zro"), 4, COST)
    assert zro.terms["zro_broadcast_calls"] == pytest.approx(8 * 3e-4)  # one broadcast per parameter, from its owner
    assert zro.optimizer_s == pytest.approx(1e-3 + 8 * 3e-4) and zro.backward_s == 2e-4


@pytest.mark.parametrize("row, backward_gathers", [("fsdp_full", 8), ("fsdp_grad_op", 0)])
def test_fsdp1_pays_per_call_and_copies_each_unit_gradient_twice(row, backward_gathers):
    t = framework_time(*_groups(row), 4, COST)
    unit_bytes = 768 * 768 * 4  # a Linear's FlatParameter, already a multiple of N = 2
    assert t.terms["fsdp1_forward_calls"] == pytest.approx(8 * 5e-4)
    assert t.terms["fsdp1_backward_calls"] == pytest.approx((backward_gathers + 8) * 5e-4)  # gathers + reduce_scatters
    assert t.terms["fsdp1_gradient_copies"] == pytest.approx(2 * 8 * unit_bytes * 1e-10)
    assert t.forward_s == pytest.approx(8 * 5e-4)
    calls = 8 + backward_gathers + 8
    assert t.total_s == pytest.approx(1e-3 + calls * 5e-4 + 16 * unit_bytes * 1e-10)


def test_fsdp1_with_its_original_parameters_pays_that_paths_cost_or_says_it_was_not_calibrated():
    """``use_orig_params=True``: FSDP1's calls at ``fsdp1_orig_call_s`` where calibrated; a calibration without it
    times them at the flat parameters' cost and a note says so. Flat FSDP1 and FSDP2 never read it."""
    from dataclasses import replace

    layout, groups = _groups("fsdp_full")
    orig = replace(COST, fsdp1_orig_call_s=9e-4, fsdp1_orig_call_s_per_byte=0.0)
    flat, kept = framework_time(layout, groups, 4, orig), framework_time(layout, groups, 4, orig, orig_params=True)
    assert flat.terms["fsdp1_forward_calls"] == pytest.approx(8 * 5e-4) and not flat.notes
    assert kept.terms["fsdp1_forward_calls"] == pytest.approx(8 * 9e-4) and not kept.notes
    old = framework_time(layout, groups, 4, COST, orig_params=True)  # not calibrated: the flat cost, said
    assert old.terms["fsdp1_forward_calls"] == pytest.approx(8 * 5e-4) and "fsdp1_orig_call_s" in old.notes[0]
    assert framework_time(*_groups("fsdp2_full"), 4, orig, orig_params=True).terms == \
        framework_time(*_groups("fsdp2_full"), 4, orig).terms


def test_zero2_zeroes_and_accumulates_its_buckets_zero1_does_not():
    layout, groups = _groups("zero2")
    t = framework_time(layout, groups, 4, COST)
    padded = sum(sh.numel for sh in groups.shards)
    assert padded >= PSI and t.terms["bucket_copies"] == pytest.approx(2 * padded * 4 * 1e-10)
    one = framework_time(*_groups("zero1"), 4, COST)
    assert "bucket_copies" not in one.terms and one.total_s == 1e-3
    assert any("no per-call cost" in n for n in t.notes + one.notes)


def test_a_wrappers_call_costs_per_byte_of_its_payload():
    """``<path>_s + S x <path>_s_per_byte`` per call, S the call's payload: DDP's bucket, each broadcast, each unit."""
    wide = FrameworkCost(ddp_bucket_s=2e-4, zro_broadcast_s=3e-4, fsdp1_call_s=5e-4, ddp_bucket_s_per_byte=6e-10,
                         zro_broadcast_s_per_byte=1e-11, fsdp1_call_s_per_byte=2e-10)
    bucket = PSI * 4  # one bucket: the whole 18 MiB mlp
    assert framework_time(*_groups("ddp"), 4, wide).terms["ddp_bucket_calls"] == pytest.approx(2e-4 + bucket * 6e-10)
    zro = framework_time(*_groups("zro"), 4, wide)
    assert zro.terms["zro_broadcast_calls"] == pytest.approx(8 * (3e-4 + 768 * 768 * 4 * 1e-11))
    unit = 768 * 768 * 4
    full = framework_time(*_groups("fsdp_full"), 4, wide)
    assert full.terms["fsdp1_forward_calls"] == pytest.approx(8 * (5e-4 + unit * 2e-10))
    assert full.terms["fsdp1_backward_calls"] == pytest.approx(16 * (5e-4 + unit * 2e-10))  # a gather and a reduce
    grad_op = framework_time(*_groups("fsdp_grad_op"), 4, wide)  # SHARD_GRAD_OP: no gather in backward
    assert grad_op.terms["fsdp1_backward_calls"] == pytest.approx(8 * (5e-4 + unit * 2e-10))
    half = framework_time(*_groups("fsdp_full"), 2, wide)  # bf16 payloads: half the bytes
    assert half.terms["fsdp1_forward_calls"] == pytest.approx(8 * (5e-4 + unit / 2 * 2e-10))
    assert wide.call_s("fsdp1_call", 1000) == pytest.approx(5e-4 + 2e-7)


def test_the_per_byte_fit_is_the_line_through_the_tiny_and_the_wide_model():
    from zeroexp.calibrate.framework import per_byte_fit

    tiny = {"a_s": 1e-3, "b_s": 2e-3, "c_s": 1e-4, "bytes": {"a_s": 1000, "b_s": 1000, "c_s": 1000}}
    wide = {"a_s": 2e-3, "b_s": 1e-3, "c_s": 1.1e-3, "bytes": {"a_s": 1001000, "b_s": 1001000, "c_s": 2000}}
    fit = per_byte_fit(tiny, wide)
    assert fit["a_s_per_byte"] == pytest.approx(1e-9) and fit["a_s"] == pytest.approx(1e-3 - 1e-6)
    assert fit["b_s_per_byte"] == 0.0 and fit["b_s"] == 2e-3  # cheaper when wider: noise, no negative slope
    assert fit["c_s_per_byte"] == pytest.approx(1e-6) and fit["c_s"] == 0.0  # the line's value at 0 bytes held at 0


def test_a_row_without_calibrated_paths_says_so():
    t = framework_time(*_groups("zero_stage3"), 4, COST)  # the paper's row: no runtime of its own
    assert t.terms == {"loop": 1e-3} and "only the loop" in t.notes[0]
    for row in ("deepspeed_stage3", "deepspeed_stage2"):  # stage 3's engine never, stage 2's not in this cost
        t = framework_time(*_groups(row), 4, COST)
        assert t.terms == {"loop": 1e-3} and "engine: its own cost not calibrated" in t.notes[0], row


@pytest.mark.parametrize("row", ["deepspeed_stage1", "deepspeed_stage2"])
def test_deepspeeds_engine_costs_a_step_and_a_pass_over_the_models_bytes(row):
    """Stages 1 and 2 (DeepSpeedZeroOptimizer): ``deepspeed_step_s`` + the model's fp32 parameter bytes x
    ``deepspeed_step_s_per_byte``, after backward, whatever the precision's itemsize (calibrated in fp32)."""
    from dataclasses import replace

    cost = replace(COST, deepspeed_step_s=3e-4, deepspeed_step_s_per_byte=4e-10)
    for itemsize in (4, 2):
        t = framework_time(*_groups(row), itemsize, cost)
        assert t.terms["deepspeed_engine"] == pytest.approx(3e-4 + 4 * PSI * 4e-10)
        assert t.optimizer_s == pytest.approx(1e-3 + t.terms["deepspeed_engine"]) and not t.notes
        assert t.forward_s == t.backward_s == 0.0
    assert "deepspeed_engine" not in framework_time(*_groups("deepspeed_stage3"), 4, cost).terms


def test_deepspeeds_recorded_collectives_replay_at_their_sizes_or_not_at_all():
    """The engine's collectives, recorded on a warm step, become calls of the same ops and sizes; an op the replay
    does not know leaves the term unmeasured (None), never timed without it."""
    from zeroexp.calibrate.deepspeed_engine import replay

    calls = replay([("allreduce_", [2048]), ("allreduce_", [1]), ("_allgather_base_", [2048, 1024]),
                    ("_reduce_scatter_base_", [512, 1024]), ("broadcast_", [16]), ("reduce_", [8])], CPU)
    assert calls is not None and len(calls) == 6 and all(callable(c) for c in calls)
    assert replay([("alltoall_base_", [64, 64])], CPU) is None
    assert replay([("_allgather_base_", [64])], CPU) is None  # not the (output, input) it takes


FSDP2_COST = FrameworkCost(loop_s=1e-3, fsdp2_call_s=4e-4, fsdp2_call_s_per_byte=1e-10, dtensor_param_step_s=5e-5)


@pytest.mark.parametrize("row, backward_gathers", [("fsdp2_full", 8), ("fsdp2_grad_op", 0)])
def test_fsdp2_pays_per_call_per_byte_and_per_dtensor_parameter(row, backward_gathers):
    t = framework_time(*_groups(row), 4, FSDP2_COST)
    one = 4e-4 + 768 * 768 * 4 * 1e-10  # a Linear's unit, dim 0 already a multiple of N = 2
    assert t.terms["fsdp2_forward_calls"] == pytest.approx(8 * one) == t.forward_s
    assert t.terms["fsdp2_backward_calls"] == pytest.approx((backward_gathers + 8) * one) == t.backward_s
    assert t.terms["dtensor_optimizer_step"] == pytest.approx(8 * 5e-5)  # one DTensor per trained parameter
    assert t.optimizer_s == pytest.approx(1e-3 + 8 * 5e-5) and not t.notes
    assert framework_time(*_groups(row), 4, COST).total_s == 1e-3  # FSDP1's terms are not FSDP2's


def test_a_calibration_before_schema_7_reads_fsdp2_terms_as_0_and_says_so():
    from tests.test_time import calibration_data

    data = calibration_data()
    data["framework"] = {"loop_s": 1e-3, "copy_s_per_byte": 1e-10, "fsdp1_call_s": 5e-4}
    old = Calibration("given", dict(data, schema=6))
    assert (old.framework.fsdp2_call_s, old.framework.dtensor_param_step_s) == (0.0, 0.0)
    assert "fsdp2_call_s, fsdp2_call_s_per_byte, dtensor_param_step_s" in old.missing_terms()
    data["framework"].update(fsdp2_call_s=4e-4, fsdp2_call_s_per_byte=1e-10, dtensor_param_step_s=5e-5)
    new = Calibration("given", dict(data, schema=7))
    assert new.framework == FrameworkCost(loop_s=1e-3, copy_s_per_byte=1e-10, fsdp1_call_s=5e-4, fsdp2_call_s=4e-4,
                                          fsdp2_call_s_per_byte=1e-10, dtensor_param_step_s=5e-5)
    assert new.missing_terms() is None


def test_plan_time_of_fsdp2_names_the_terms_an_old_calibration_lacks(compose, tmp_path):
    from tests.test_time import calibration_data
    from zeroexp.plan.check.step_time import time_section

    data = calibration_data(numel=8 * 64 * 64)
    data["framework"] = {"loop_s": 1e-3, "copy_s_per_byte": 1e-10, "fsdp1_call_s": 5e-4}
    for schema, extra in ((6, {}), (7, {"fsdp2_call_s": 4e-4, "fsdp2_call_s_per_byte": 0.0,
                                        "dtensor_param_step_s": 5e-5})):
        path = tmp_path / f"cal{schema}.json"
        path.write_text(json.dumps({**data, "schema": schema, "framework": {**data["framework"], **extra}}))
        section = time_section(Cell.of(compose("strategy=fsdp2_full", "world_size=2", f"calibration={path}")),
                               {"timing": {"step_ms": [10.0] * 40}, "collectives": {}})
        lacks = [c for c in section["reason_codes"] if c == Code.TIME_CALIBRATION_LACKS_TERMS]
        terms = section["framework"]["terms_ms"]
        assert len(lacks) == (1 if schema == 6 else 0) and "dtensor_optimizer_step" in terms
        if schema == 7:
            assert terms["fsdp2_forward_calls"] > 0.0 and terms["dtensor_optimizer_step"] > 0.0


def test_the_terms_enter_the_step_in_their_phases():
    rate = ComputeRate(1e-10, 2e-10, 2e-9)
    for row in ("ddp", "zro", "zero2", "fsdp_full"):
        layout, groups = _groups(row)
        coll = step_collectives(layout, groups, 4, KNOBS)
        seconds = lambda op, s, calls: calls * 1e-4 + s / 1e9  # noqa: E731 - a given link
        bare = predict_step(layout, groups, coll, rate, 8, seconds, False, "pre")
        with_fw = predict_step(layout, groups, coll, rate, 8, seconds, False, "pre", COST, 4)
        fw = framework_time(layout, groups, 4, COST)
        # without overlap every term adds; compute phases and communication are unchanged
        assert with_fw.step_s == pytest.approx(bare.step_s + fw.total_s)
        assert (with_fw.forward_s, with_fw.backward_s, with_fw.optimizer_s) == (bare.forward_s, bare.backward_s,
                                                                               bare.optimizer_s)
        assert with_fw.comm_s == pytest.approx(bare.comm_s) and with_fw.exposed_comm_s == pytest.approx(bare.comm_s)
        assert with_fw.framework_s == pytest.approx(fw.total_s)
        assert with_fw.by_phase_ms()["framework"] == pytest.approx(1e3 * fw.total_s)
        assert dict(with_fw.framework_terms) == fw.terms
    # with overlap the framework's backward work is compute that DDP's all_reduce can hide behind
    layout, groups = _groups("ddp", 2)
    coll = step_collectives(layout, groups, 4, KNOBS)
    slow = lambda op, s, calls: 1.0  # noqa: E731 - one second a call: nothing hides it all
    t = predict_step(layout, groups, coll, rate, 8, slow, True, "pre", COST, 4)
    assert t.exposed_comm_s == pytest.approx(t.step_s - (t.forward_s + t.backward_s + t.optimizer_s + t.framework_s))


def test_a_calibration_reads_its_framework_costs(tmp_path):
    from tests.test_time import calibration_data

    data = calibration_data()
    data["framework"] = {"loop_s": 1e-3, "copy_s_per_byte": 1e-10, "ddp_bucket_s": 2e-4, "zro_broadcast_s": 3e-4,
                         "fsdp1_call_s": 5e-4, "raw": {}}
    assert Calibration("given", data).framework == COST
    one_rank = dict(data, framework={"loop_s": 1e-3, "copy_s_per_byte": 1e-10, "raw": {}})  # N=1: no wrappers
    assert Calibration("given", one_rank).framework == FrameworkCost(loop_s=1e-3, copy_s_per_byte=1e-10)
    wide = dict(data, framework={**data["framework"], "ddp_bucket_s_per_byte": 6e-10, "fsdp1_call_s_per_byte": 2e-10})
    got = Calibration("given", wide).framework  # schema 6; before it, no per-byte figure: 0
    assert (got.ddp_bucket_s_per_byte, got.fsdp1_call_s_per_byte, got.zro_broadcast_s_per_byte) == (6e-10, 2e-10, 0)
    assert COST.ddp_bucket_s_per_byte == 0.0
    assert (got.deepspeed_step_s, got.deepspeed_step_s_per_byte) == (None, None)  # before schema 10: not calibrated
    ds = dict(data, framework={**data["framework"], "deepspeed_step_s": 3e-4, "deepspeed_step_s_per_byte": 4e-10})
    got = Calibration("given", ds).framework
    assert (got.deepspeed_step_s, got.deepspeed_step_s_per_byte) == (3e-4, 4e-10)


def test_schema_1_calibrations_are_not_used(tmp_path):
    """Schema 1 timed collectives in back-to-back loops and had no framework costs: a cell must not use one."""
    from tests.test_time import calibration_data
    from zeroexp.results.calibration import find_calibration, load_calibration, machine

    old = calibration_data(machine_id=machine()["id"])
    old["schema"] = 1
    del old["framework"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert find_calibration("gloo", 2, tmp_path) is None
    with pytest.raises(ValueError, match="schema 2"):
        load_calibration(tmp_path / "old.json")


def test_plan_time_reports_the_framework_terms(compose, tmp_path):
    from tests.test_time import calibration_data
    from zeroexp.plan.check.step_time import time_section

    data = calibration_data(numel=8 * 64 * 64)
    data["framework"] = {"loop_s": 1e-3, "copy_s_per_byte": 1e-10, "ddp_bucket_s": 2e-4, "zro_broadcast_s": 3e-4,
                         "fsdp1_call_s": 5e-4}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(data))
    section = time_section(Cell.of(compose("strategy=fsdp_full", "world_size=2", f"calibration={path}")),
                           {"timing": {"step_ms": [10.0] * 40}, "collectives": {}})
    terms = section["framework"]["terms_ms"]
    assert terms["loop"] == pytest.approx(1.0)
    units = len([k for k in terms if k.startswith("fsdp1")])
    assert units == 3 and section["predicted_by_phase"]["framework"] == pytest.approx(sum(terms.values()))


def test_one_call_timing_takes_the_slowest_rank_of_each_call(monkeypatch):
    """calls.time_calls: a barrier before each call, per call the slowest rank (all_reduce MAX), in call order."""
    import torch

    from zeroexp.calibrate import calls as measure

    calls, reduced = [], []
    monkeypatch.setattr(measure.dist, "barrier", lambda: calls.append("barrier"))

    def all_reduce(t, op=None):
        reduced.append(op)
        t.mul_(2)  # another rank twice as slow
    monkeypatch.setattr(measure.dist, "all_reduce", all_reduce)
    out = measure.time_calls(lambda: calls.append("call"), 3, torch.device("cpu"))
    assert calls == ["barrier", "call"] * 3 and reduced == [measure.dist.ReduceOp.MAX] and len(out) == 3
    assert all(x > 0 for x in out)


def test_a_forward_and_a_backward_call_cost_once_per_micro_batch():
    """A calibration's call costs (``compute.forward_call_s``, ``backward_call_s``) enter each micro-batch once,
    whatever its samples: at K micro-batches a step is K x (both calls) above the same step without them (no
    overlap: every term adds), and a checkpointed model recomputes its forward's call share too."""
    from zeroexp.formulas import accumulation_repeats

    bare, calls = ComputeRate(1e-10, 2e-10, 2e-9), ComputeRate(1e-10, 2e-10, 2e-9, 1e-3, 2e-3)
    seconds = lambda op, s, n: n * 1e-4 + s / 1e9  # noqa: E731 - a given link
    for row in ("ddp", "zero2", "fsdp_full", "fsdp2_full"):
        layout, groups = _groups(row)
        for k in (1, 4):
            knobs = PlanKnobs(micro_batches=k)
            coll, reps = step_collectives(layout, groups, 4, knobs), accumulation_repeats(layout, groups, 4, knobs)
            a, b = (predict_step(layout, groups, coll, rate, 8 // k, seconds, False, "pre", micro_batches=k,
                                 repeats=reps) for rate in (bare, calls))
            assert b.step_s - a.step_s == pytest.approx(k * 3e-3), (row, k)
            assert b.forward_s - a.forward_s == pytest.approx(k * 1e-3)
            assert b.backward_s - a.backward_s == pytest.approx(k * 2e-3)
    layout, groups = _groups("ddp")
    coll = step_collectives(layout, groups, 4, KNOBS)
    a, b = (predict_step(layout, groups, coll, rate, 8, seconds, False, "pre", checkpointed=PSI // 2)
            for rate in (bare, calls))
    assert b.recompute_s - a.recompute_s == pytest.approx(1e-3 / 2)  # half the parameters checkpointed


def test_the_call_cost_is_fitted_over_two_micro_batch_sizes_or_left_out():
    from zeroexp.calibrate.measure import fit_sizes
    from zeroexp.formulas import fit_calls

    assert [fit_sizes(b) for b in (1, 2, 3, 4, 8, 16)] == [(1, 2), (1, 2), (1, 3), (1, 4), (2, 8), (4, 16)]
    call, slope = fit_calls([(1, 3e-3), (4, 9e-3)])  # 1 ms + 2 ms a sample, exactly
    assert call == pytest.approx(1e-3) and slope == pytest.approx(2e-3)
    assert fit_calls([(2, 4e-3), (8, 16e-3)]) == pytest.approx((0.0, 2e-3), abs=1e-15)  # no call cost
    assert fit_calls([(1, 3e-3), (4, 2e-3)]) is None  # slower at 1 than at 4: no cost, noise
    assert fit_calls([(1, 1e-3), (4, 16e-3)]) is None  # a negative call: noise above it
    assert fit_calls([(4, 9e-3), (4, 9.5e-3)]) is None  # one size


def test_a_calibration_before_schema_8_has_no_call_cost(tmp_path):
    """Schema 7: no call cost; 8: its model's call cost, fixed (it carries to no other model); 9: the call's fixed
    part, its cost per operator and per parameter (its model's call, ``*_call_s``, is their sum there)."""
    from test_time import calibration_data

    data = calibration_data()
    split = {"forward_call_s": 1e-3, "backward_call_s": 2e-3, "forward_call_fixed_s": 2e-4,
             "backward_call_fixed_s": 3e-4, "forward_s_per_op": 1e-5, "backward_s_per_op": 5e-6,
             "forward_call_s_per_param": 1e-9, "backward_call_s_per_param": 2e-9}
    for schema, extra, want, ops in ((7, {}, (0.0, 0.0), (0.0, 0.0)),
                                     (8, {"forward_call_s": 1e-3, "backward_call_s": 2e-3}, (1e-3, 2e-3), (0.0, 0.0)),
                                     (9, split, (2e-4, 3e-4), (1e-5, 5e-6))):
        data = {**data, "schema": schema, "compute": {**data["compute"], **extra}}
        path = tmp_path / f"cal{schema}.json"
        path.write_text(json.dumps(data))
        from zeroexp.results.calibration import load_calibration

        rate = load_calibration(path).rate
        assert (rate.forward_call_s, rate.backward_call_s) == want
        assert (rate.forward_s_per_op, rate.backward_s_per_op) == ops and rate.counts_ops == (schema == 9)
        assert rate.forward_s_per_param_sample == data["compute"]["forward_s_per_param_sample"]
        # a model of 18 forward operators over a million parameters: fixed + operators + parameters
        assert rate.call_seconds("forward", 18, 10**6) == pytest.approx(
            want[0] + 18 * ops[0] + (1e-9 * 10**6 if schema == 9 else 0))


def test_a_call_cost_carries_to_a_model_of_other_size_and_operators():
    """The call's parts scale each with its own count: a model 9x the parameters pays 9x the per-parameter part and
    the same per-operator part; twice the operators, twice that; the fixed part once. A call split from a fit whose
    fixed and per-operator parts reach it has no per-parameter part, and says so."""
    from zeroexp.formulas import split_cost

    rate = ComputeRate(1e-10, 2e-10, 2e-9, 2.7e-4, 2.7e-4, 1.15e-5, 5.4e-6, 1e-9, 2e-9)
    one, nine = rate.call_seconds("backward", 60, 524288), rate.call_seconds("backward", 60, 9 * 524288)
    assert nine - one == pytest.approx(8 * 524288 * 2e-9)
    assert rate.call_seconds("backward", 120, 524288) - one == pytest.approx(60 * 5.4e-6)
    assert rate.call_seconds("forward", 0, 0) == 2.7e-4
    per_param, why = split_cost(1e-3, 18, 524288, 2e-4, 1e-5)  # 1 ms = 0.2 + 18 x 0.01 + 524288 x per_param
    assert why is None and per_param == pytest.approx((1e-3 - 2e-4 - 18e-5) / 524288)
    per_param, why = split_cost(3e-4, 18, 524288, 2e-4, 1e-5)  # fixed and operators 0.38 ms > the fitted 0.3
    assert per_param == 0.0 and why
    layout, groups = _groups("ddp")  # in a step: each micro-batch pays its call's parts
    coll = step_collectives(layout, groups, 4, KNOBS)
    seconds = lambda op, s, n: n * 1e-4 + s / 1e9  # noqa: E731 - a given link
    a, b = (predict_step(layout, groups, coll, rate, 8, seconds, False, "pre", ops=ops) for ops in ((0, 0), (18, 60)))
    assert b.forward_s - a.forward_s == pytest.approx(18 * 1.15e-5)
    assert b.backward_s - a.backward_s == pytest.approx(60 * 5.4e-6)


def test_adamw_pays_per_step_per_tensor_and_per_element_in_and_beyond_the_cache():
    """AdamW's step: a fixed cost, one per tensor, and one per element: those in the rank's share of the cache at
    its rate, those beyond at memory's; two steps (the model's and one beyond the cache) solve for both rates."""
    from zeroexp.formulas import split_cache

    rate = ComputeRate(1e-10, 2e-10, 1.5e-9, adamw_step_s=3e-4, adamw_s_per_tensor=1e-4, adamw_cache_elements=1000,
                       adamw_s_per_element_beyond=8e-9)
    assert rate.optimizer_seconds(8, 600) == pytest.approx(3e-4 + 8e-4 + 600 * 1.5e-9)  # all in the cache
    assert rate.optimizer_seconds(8, 5000) == pytest.approx(3e-4 + 8e-4 + 1000 * 1.5e-9 + 4000 * 8e-9)
    assert ComputeRate(1e-10, 2e-10, 2e-9).optimizer_seconds(8, 5000) == pytest.approx(1e-5)  # one rate for all
    # the model (2,000 elements: 1,000 in, 1,000 beyond) and 16,000 (1,000 in, 15,000 beyond), exact
    t = lambda e: min(e, 1000) * 1.5e-9 + max(0, e - 1000) * 8e-9  # noqa: E731
    assert split_cache((2000, t(2000)), (16000, t(16000)), 1000) == pytest.approx((1.5e-9, 8e-9))
    assert split_cache((500, t(500)), (16000, t(16000)), 1000) == pytest.approx((1.5e-9, 8e-9))  # model in cache
    assert split_cache((2000, 1e-5), (16000, 1e-6), 1000) is None  # the larger step faster: noise, no rates
    assert split_cache((2000, 2000 * 8e-9), (16000, 16000 * 7e-9), 1000) is None  # the cache slower than memory


def test_the_optimizer_steps_the_tensors_each_strategy_gives_a_rank():
    """``optimizer_tensors``: the busiest rank's step scalars where the groups fix them (DDP: every trained
    parameter; FSDP1 flat: one FlatParameter a unit, with use_orig_params each view; ZeroRedundancyOptimizer: the
    busiest owner's), else the trained parameters."""
    from zeroexp.formulas import optimizer_tensors

    for row, want in (("ddp", 8), ("fsdp_full", 8), ("fsdp2_full", 8), ("zro", 4)):
        layout, groups = _groups(row)
        assert optimizer_tensors(layout, groups, KNOBS) == want, row


@pytest.mark.parametrize("model", ["mlp", "gpt", "lora_gpt", "hf_llama", "conv_bn"])
def test_a_steps_operators_are_counted_as_the_cpu_dispatches_them(compose, model):
    """``step_ops`` on fake CPU tensors counts the operators a real CPU step dispatches, forward and backward apart
    (the GPT's attention through the CPU's fused kernel, not the meta device's math path): zeroexp's models and
    foreign ones (tests/test_corpus.py's)."""
    from test_corpus import HF, MODELS
    import torch

    from zeroexp._lib.dispatch import dispatch_mode_base
    from zeroexp.models import build_model, loss_of, make_batch
    from zeroexp.plan.flops import step_ops

    if model == "hf_llama" and not HF:
        pytest.skip("transformers is not installed")
    overrides = MODELS[model][0] if model in MODELS else (f"model={model}",)
    model = compose(*overrides, base=("logger=none",)).model

    class Count(dispatch_mode_base()):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func.namespace != "prim"  # prim.device: a tensor's device asked, no operator
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net, batch = build_model(model), make_batch(model, 2, 0, 0, 0)
    with Count() as forward:
        loss = loss_of(model)(net(batch), batch)
    with Count() as backward:
        loss.backward()
    assert step_ops(model, "cpu", 2) == (forward.calls, backward.calls) and forward.calls > 0


def test_a_deep_stacks_operators_are_derived_from_shallow_ones(compose):
    """A GPT deeper than DERIVED_ABOVE: its counts from two, three and four blocks equal the whole count."""
    from zeroexp.plan.flops import step_ops

    model = compose("model=gpt", "model.n_layer=22", "model.n_embd=32", "model.n_head=2", base=("logger=none",)).model
    assert step_ops(model, "cpu") == step_ops(model, "cpu", derive=False)


def test_deepspeeds_engine_is_calibrated_under_a_default_cells_config(compose):
    """The calibration measures the engine a ``strategy=deepspeed`` cell of the defaults runs (stage 2, fp32, batch
    8): its config is the cell's own (``ds_config``), not a copy."""
    from zeroexp.calibrate.deepspeed_engine import engine_config
    from zeroexp.strategies.deepspeed import ds_config

    cell = Cell.of(compose("strategy=deepspeed", "world_size=2", base=("logger=none",)))
    assert cell.batch_size == 8 and cell.grad_accum == 1 and cell.precision == "fp32"
    assert engine_config("cpu") == ds_config(cell.policy, "cpu")
    assert engine_config("cpu")["zero_optimization"]["stage"] == 2


def test_deepspeeds_cpu_accelerator_notice_is_dropped_and_its_other_records_pass():
    """A calibration's ranks print to the console: DeepSpeed's "no GPU found" warning is dropped there, nothing else."""
    import importlib.util
    import logging
    from pathlib import Path

    from zeroexp.calibrate import deepspeed_engine as engine

    source = Path(importlib.util.find_spec("deepspeed").submodule_search_locations[0], "accelerator",
                  "real_accelerator.py").read_text()
    assert engine.CPU_ACCELERATOR_NOTICE in source  # the text this DeepSpeed warns with
    engine.quiet_cpu_accelerator_notice()
    engine.quiet_cpu_accelerator_notice()  # added once
    log = logging.getLogger("DeepSpeed")
    assert sum(getattr(f, "_zeroexp", False) for f in log.filters) == 1

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, text, None, None)
    assert not log.filter(record(f"{engine.CPU_ACCELERATOR_NOTICE}. If you have GPU or other accelerator, ..."))
    assert log.filter(record("Setting ZeRO stage to 2"))
