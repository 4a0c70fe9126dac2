"""The step-time model through its structure: exact results on given calibrations, never timing asserts.

zeroexp.formulas.time.rates (fit, collective time, two-level ring), zeroexp.formulas.time.overlap (slots, the channel),
zeroexp.plan.check.step_time (the check on given numbers, plan.time of a composed cell), zeroexp.probes.exposed
(interval
arithmetic), zeroexp.results.calibration (which file a cell uses), and one tiny real calibration at N=2 with a cell
using it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from zeroexp.cell.resolved import Cell
from zeroexp.results.calibration import SCHEMA, find_calibration, load_calibration, machine
from zeroexp.formulas import (LAYOUTS, LinkFit, ModelShape, PlanKnobs, bus_factor, collective_seconds,
                              derive_groups, fit_link, overlap_possible, predict_step, simulate_step, step_collectives,
                              two_level_seconds)
from zeroexp.plan.check.step_time import MEDIAN_CI_LIMIT, median_ci95, time_check, time_section
from zeroexp.results.verdict import Code
from zeroexp.probes.exposed import measure, merge, subtract

MLP = ModelShape(params=((768, 768),) * 8, units=tuple((i,) for i in range(8)), root=(False,) * 8)
LINKS = {"all_reduce": (1e-4, 1e9), "reduce_scatter": (2e-4, 5e8), "all_gather": (3e-4, 4e8), "broadcast": (5e-5, 2e9)}
RATE = {"forward_s_per_param_sample": 1e-10, "backward_s_per_param_sample": 2e-10, "adamw_s_per_element": 2e-9}


def calibration_data(world_size: int = 2, overlap: bool = False, machine_id: str = "m", created: str = "2026-01-01",
                     backend: str = "gloo", model: str = "mlp", numel: int = 8 * 768 * 768) -> dict:
    return {"schema": SCHEMA, "created": created, "machine": {"id": machine_id}, "backend": backend,
            "world_size": world_size, "overlap": {"possible": overlap, "why": "given"},
            "collectives": {op: {"sizes": [], "fit": {"alpha_s": a, "busbw_Bps": bw}} for op, (a, bw) in LINKS.items()},
            "compute": {"model": model, "numel": numel, "batch_size": 8, **RATE},
            "framework": {"loop_s": 0.0, "copy_s_per_byte": 0.0, "ddp_bucket_s": 0.0, "zro_broadcast_s": 0.0,
                          "fsdp1_call_s": 0.0}}


def test_fit_recovers_latency_and_bandwidth_exactly():
    sizes = [2 ** k for k in range(12, 25)]
    for op, n in (("all_reduce", 2), ("all_gather", 4), ("broadcast", 3)):
        times = [3e-5 + s * bus_factor(op, n) / 2.5e9 for s in sizes]
        fit = fit_link(op, n, sizes, times)
        assert math.isclose(fit.alpha_s, 3e-5, rel_tol=1e-9) and math.isclose(fit.busbw_Bps, 2.5e9, rel_tol=1e-9)
    # a negative intercept is held at 0: the line through the origin, each residual relative to its time
    xs, ts = [1000, 2000], [0.5e-6, 1.5e-6]
    fit = fit_link("all_reduce", 2, xs, ts)  # bus factor 1 at N=2
    slope = sum(x * t / t ** 2 for x, t in zip(xs, ts)) / sum(x * x / t ** 2 for x, t in zip(xs, ts))
    assert fit.alpha_s == 0.0 and math.isclose(fit.busbw_Bps, 1 / slope)
    with pytest.raises(ValueError):
        fit_link("all_reduce", 2, [1], [1.0])


def test_collective_and_two_level_seconds():
    link = LinkFit(1e-5, 1e9)
    assert collective_seconds("all_reduce", 1e6, 4, link, calls=3) == pytest.approx(3e-5 + 1e6 * 1.5 / 1e9)
    assert collective_seconds("all_reduce", 1e6, 1, link) == 0.0
    intra, inter = LinkFit(1e-6, 4e11), LinkFit(1e-5, 5e10)
    s = 8e8
    assert two_level_seconds("all_gather", s, 8, 1, intra, inter) == collective_seconds("all_gather", s, 8, intra)
    want = (collective_seconds("reduce_scatter", s, 8, intra) + collective_seconds("all_reduce", s / 8, 4, inter)
            + collective_seconds("all_gather", s, 8, intra))
    assert two_level_seconds("all_reduce", s, 8, 4, intra, inter) == pytest.approx(want)
    assert two_level_seconds("all_gather", s, 8, 4, intra, inter) == pytest.approx(
        collective_seconds("all_gather", s, 8, intra) + collective_seconds("all_gather", s / 8, 4, inter))


def test_overlap_rule_of_the_device():
    assert overlap_possible("cuda", 2, 8, 1)
    assert not overlap_possible("cpu", 2, 2, 1)  # every core computes: gloo time-slices
    assert overlap_possible("cpu", 16, 2, 4)


def test_channel_simulation():
    calls = [(2.0, 10.0, 0, 3.0)]
    assert simulate_step(10.0, calls, overlap=True) == 10.0  # hidden behind compute
    assert simulate_step(10.0, [(2.0, 10.0, 0, 9.0)], overlap=True) == 11.0  # 1 s exposed
    assert simulate_step(10.0, [(2.0, 10.0, 0, 9.0)], overlap=False) == 19.0
    # one channel: the second call queues behind the first; compute stalls at 4 until it ends at 1 + 2 + 2 = 5
    assert simulate_step(10.0, [(1.0, 10.0, 0, 2.0), (1.0, 4.0, 1, 2.0)], overlap=True) == 11.0


def _predict(strategy: str, cal: dict, prefetch: str = "pre", n: int = 2):
    layout = LAYOUTS[strategy]
    groups = derive_groups(strategy, layout, MLP, n, 4, PlanKnobs(bucket_cap_bytes=4 * 2 ** 20))
    coll = step_collectives(layout, groups, 4, PlanKnobs(bucket_cap_bytes=4 * 2 ** 20))
    from zeroexp.results.calibration import Calibration

    c = Calibration("given", cal)
    return predict_step(layout, groups, coll, c.rate, 8, c.seconds_at(n), cal["overlap"]["possible"], prefetch), coll


@pytest.mark.parametrize("strategy", ["ddp", "zro", "zero1", "zero2", "fsdp_grad_op", "fsdp_full"])
def test_without_overlap_every_collective_adds_to_the_step(strategy):
    t, coll = _predict(strategy, calibration_data())
    psi = 8 * 768 * 768
    opt = psi // 2 if strategy != "ddp" else psi
    compute = 1e-10 * psi * 8 + 2e-10 * psi * 8 + 2e-9 * opt
    comm = sum(e["count"] * LINKS[op][0] + e["payload_bytes"] * bus_factor(op, 2) / LINKS[op][1]
               for op, e in coll.items())
    assert t.comm_s == pytest.approx(comm) and t.exposed_comm_s == pytest.approx(comm)
    assert t.step_s == pytest.approx(compute + comm)
    assert t.by_phase_ms()["optimizer"] == pytest.approx(2e-6 * opt)


def test_overlap_rules_order_the_strategies():
    cal = calibration_data(overlap=True)
    ddp, _ = _predict("ddp", cal)
    # DDP at a 4 MiB cap: one bucket per 2.25 MiB Linear pair; only the last bucket's all_reduce is exposed at most
    assert ddp.exposed_comm_s < ddp.comm_s
    full = {p: _predict("fsdp_full", cal, p)[0] for p in ("pre", "post", "none")}
    assert full["pre"].comm_s == full["post"].comm_s == full["none"].comm_s  # same calls, different overlap
    assert full["pre"].step_s <= full["post"].step_s <= full["none"].step_s
    no = _predict("fsdp_full", calibration_data(overlap=False), "pre")[0]
    assert no.step_s == pytest.approx(no.forward_s + no.backward_s + no.optimizer_s + no.comm_s)


def test_fsdp2_explicit_prefetch_issues_all_gathers_earlier_and_sends_the_same():
    """FSDP2's explicit prefetch (k units ahead) moves each all_gather's issue k units earlier in forward and
    backward, never its need or its bytes; 1 ahead is the default rule; with overlap the step is no longer."""
    from zeroexp.formulas import collective_slots
    from zeroexp.results.calibration import Calibration

    layout = LAYOUTS["fsdp2_full"]
    groups = derive_groups("fsdp2_full", layout, MLP, 2, 4, PlanKnobs())
    ahead = {a: PlanKnobs(forward_prefetch=a[0], backward_prefetch=a[1]) for a in ((0, 0), (1, 1), (3, 2))}
    slots = {a: collective_slots(layout, groups, "pre", 1.0, 2.0, 1.0, k)[0] for a, k in ahead.items()}
    assert slots[(0, 0)] == slots[(1, 1)]
    same = [(s.op, s.weight, s.need_s) for s in slots[(0, 0)]]
    assert [(s.op, s.weight, s.need_s) for s in slots[(3, 2)]] == same
    issues = [(a.issue_s, b.issue_s) for a, b in zip(slots[(0, 0)], slots[(3, 2)]) if a.op == "all_gather"]
    assert all(b <= a for a, b in issues) and any(b < a for a, b in issues[1:8])  # forward: 3 units ahead
    assert any(b < a for a, b in issues[8:])  # backward: 2 units ahead
    cal = Calibration("given", calibration_data(overlap=True))
    coll = step_collectives(layout, groups, 4, PlanKnobs())
    t = {a: predict_step(layout, groups, coll, cal.rate, 8, cal.seconds_at(2), True, knobs=ahead[a])
         for a in ((0, 0), (3, 2))}
    assert t[(3, 2)].comm_s == t[(0, 0)].comm_s and t[(3, 2)].step_s <= t[(0, 0)].step_s


def test_time_check_on_given_numbers():
    assert time_check(100.0, 100.0, (98.0, 103.0), 40) == ("PASS", [])
    assert time_check(124.0, 100.0, (95.0, 105.0), 40)[0] == "PASS"
    assert time_check(80.5, 100.0, (95.0, 105.0), 40)[0] == "PASS"  # 1/1.25 = 0.8
    check, reasons = time_check(130.0, 100.0, (95.0, 105.0), 40)
    assert check == "FAIL" and [r.code for r in reasons] == [Code.TIME_RATIO_OUT_OF_BOUND]
    # a median known to no better than +-15 %: judged by its interval, noise alone does not FAIL it
    check, reasons = time_check(100.0, 100.0, (85.0, 104.0), 40)
    assert check == "PASS" and [r.code for r in reasons] == [Code.TIME_MEDIAN_UNSTABLE]
    # the steps that would narrow it: a number said only in the sentence
    assert f"about {math.ceil(40 * (0.15 / MEDIAN_CI_LIMIT) ** 2)} would narrow" in reasons[0].text
    assert time_check(128.0, 100.0, (85.0, 104.0), 40)[0] == "PASS"  # 1.25 x 104 = 130: a time in the CI within
    assert time_check(69.0, 100.0, (85.0, 104.0), 40)[0] == "PASS"  # 85 / 1.25 = 68
    for wrong in (66.0, 131.0):  # a wrong model still FAILs: no time in the CI within the bound
        check, reasons = time_check(wrong, 100.0, (85.0, 104.0), 40)
        assert check == "FAIL"
        assert [r.code for r in reasons] == [Code.TIME_RATIO_OUT_OF_BOUND, Code.TIME_MEDIAN_UNSTABLE]
    median, low, high = median_ci95([5.0] * 30)
    assert (median, low, high) == (5.0, 5.0, 5.0)
    assert median_ci95([1.0, 2.0, 3.0, 4.0, 100.0]) == median_ci95([1.0, 2.0, 3.0, 4.0, 100.0])  # seeded


def test_interval_arithmetic():
    assert merge([(5, 7), (1, 3), (2, 4), (8, 8)]) == [(1, 4), (5, 7)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert subtract([(0, 2), (4, 6)], [(1, 5)]) == [(0, 1), (5, 6)]
    assert measure([(0, 2), (3, 5)], 1, 4) == 2


def test_the_newest_calibration_of_this_machine_backend_and_n(tmp_path):
    me = machine()["id"]
    files = {"a": calibration_data(machine_id=me, created="2026-01-01T00:00:00"),
             "b": calibration_data(machine_id=me, created="2026-02-01T00:00:00"),
             "c": calibration_data(machine_id=me, created="2026-03-01T00:00:00", world_size=4),
             "d": calibration_data(machine_id="elsewhere", created="2026-04-01T00:00:00"),
             "e": calibration_data(machine_id=me, created="2026-05-01T00:00:00", backend="nccl")}
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "junk.json").write_text("{}")
    assert Path(find_calibration("gloo", 2, tmp_path).path).name == "b.json"
    assert Path(find_calibration("gloo", 4, tmp_path).path).name == "c.json"
    assert find_calibration("gloo", 3, tmp_path) is None
    with pytest.raises(ValueError, match="no zeroexp calibration"):
        load_calibration(tmp_path / "junk.json")


def test_calibrations_are_looked_for_where_the_variable_says_read_at_each_call(tmp_path, monkeypatch):
    """A user's outputs/calibration/ never reaches the suite (conftest points ZEROEXP_CALIBRATION_DIR at an empty
    directory); unset, the default directory of the working directory is read; set, its directory, at each call."""
    from zeroexp.results.calibration import DEFAULT_DIR, ENV, calibration_directory

    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_DIR).mkdir(parents=True)
    (tmp_path / DEFAULT_DIR / "user.json").write_text(json.dumps(calibration_data(machine_id=machine()["id"])))
    assert find_calibration("gloo", 2) is None  # the suite's own, empty directory
    assert find_calibration("gloo", None) is None
    monkeypatch.delenv(ENV)
    assert calibration_directory() == DEFAULT_DIR
    assert Path(find_calibration("gloo", 2).path).name == "user.json"
    monkeypatch.setenv(ENV, "")
    assert calibration_directory() == DEFAULT_DIR  # empty: unset
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv(ENV, str(elsewhere))
    assert find_calibration("gloo", 2) is None
    (elsewhere / "moved.json").write_text(json.dumps(calibration_data(machine_id=machine()["id"], world_size=3)))
    assert Path(find_calibration("gloo", 3).path).name == "moved.json"


def _summary(step_ms: list[float]) -> dict:
    return {"timing": {"step_ms": step_ms}, "collectives": {"exposed_comm_ms": 1.5}}


def test_plan_time_of_a_composed_cell(compose, tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_data(numel=8 * 64 * 64)))
    cfg = compose("strategy=fsdp_full", "world_size=2", "prefetch=none", f"calibration={path}")
    t0, _ = _predict("fsdp_full", calibration_data(), "none")
    section = time_section(Cell.of(cfg), _summary([10.0] * 40))
    assert set(section) >= {"predicted_step_ms", "measured_median_ms", "median_ci95_ms", "ratio", "exposed_comm_ms",
                            "measured_exposed_comm_ms", "predicted_by_phase", "calibration", "check", "reasons"}
    assert section["measured_median_ms"] == 10.0 and section["median_ci95_ms"] == [10.0, 10.0]
    assert section["measured_exposed_comm_ms"] == 1.5
    assert section["ratio"] == pytest.approx(section["predicted_step_ms"] / 10.0)
    assert section["check"] == ("PASS" if 0.8 <= section["ratio"] <= 1.25 else "FAIL")
    assert section["calibration"]["path"] == str(path)
    pred = section["predicted_step_ms"]
    assert time_section(Cell.of(cfg), _summary([pred] * 40))["check"] == "PASS"
    assert time_section(Cell.of(cfg), _summary([pred * 1.3] * 40))["check"] == "FAIL"
    wide = time_section(Cell.of(cfg), _summary([pred * (0.5 + (i % 2)) for i in range(41)]))
    assert wide["check"] == "PASS" and wide["reason_codes"][0] == Code.TIME_MEDIAN_UNSTABLE
    wrong = time_section(Cell.of(cfg), _summary([pred * (2.5 + (i % 2)) for i in range(41)]))  # CI 2.5x .. 3.5x
    assert wrong["check"] == "FAIL" and wrong["reason_codes"][:2] == [Code.TIME_RATIO_OUT_OF_BOUND,
                                                                      Code.TIME_MEDIAN_UNSTABLE]
    none = time_section(Cell.of(compose("world_size=3")), _summary([10.0] * 40))  # no calibration at N=3 here
    assert none["check"] == "n/a" and none["reason_codes"] == [Code.TIME_NO_CALIBRATION]
    assert none["predicted_step_ms"] is None
    assert t0.step_s > 0


def test_a_bad_calibration_path_is_refused_before_any_rank(compose, tmp_path):
    from zeroexp.config.schemas import validate
    from zeroexp.errors import ConfigError

    with pytest.raises(ConfigError, match="calibration"):
        validate(compose(f"calibration={tmp_path / 'absent.json'}"))


@pytest.mark.slow
def test_a_tiny_calibration_and_a_cell_that_uses_it(compose, cell, tmp_path):
    """N=3 (uneven: FSDP's calls move units padded to a multiple of N), 4 KiB .. 16 KiB: the file's fields, the fit
    of every op, the PNG; then a cell's plan.time from it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from zeroexp.cli.calibrate import register, run
    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="calibrate", overrides=[
            "world_size=3", "model.width=64", "calibrate.max_bytes=16384", "calibrate.target_s=0.001",
            "calibrate.repeats=1", "calibrate.compute_steps=2", "calibrate.wake_gaps_ms=[0,1]",
            "calibrate.wake_calls=3", f"output_dir={tmp_path}"])
    path = run(cfg)
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and data["world_size"] == 3 and data["backend"] == "gloo"
    assert data["machine"]["id"] == machine()["id"] and data["versions"]["torch"]
    assert set(data["collectives"]) == {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}
    for e in data["collectives"].values():
        assert [r["bytes"] for r in e["sizes"]] == [4092, 8184, 16380]  # whole fp32 elements a rank, N=3
        assert all(r["iters"] >= 2 and r["mean_s"] > 0 for r in e["sizes"])  # min_iters 2, one round
        assert all(r["burst_iters"] >= 1 and r["burst_mean_s"] > 0 for r in e["sizes"])  # 8 async calls at once
        assert all(r["stream_iters"] >= 1 and r["stream_mean_s"] > 0 for r in e["sizes"])  # 8 sync, one by one
        assert e["fit"]["busbw_Bps"] > 0 and e["fit"]["alpha_s"] >= 0 and e["cold_bytes"] >= 2 * 2**20
    w = data["wake"]
    assert w["gaps_s"] == [0.0, 0.001] and w["calls"] == 3 and len(w["mean_s"]) == 2
    assert w["extra_s"] == [m - w["mean_s"][0] for m in w["mean_s"]]
    assert len(w["matmuls"]) == 2 and w["matmuls"][0] == 0  # a fixed count of matmuls per gap, the same on each rank
    import platform

    from zeroexp.devices import HOST_ALLOCATOR
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert data["host_allocator"] == (HOST_ALLOCATOR if on_glibc else None)
    host = data["host_activity"]  # what else ran while the ranks measured: the host's busy CPU less the ranks'
    if Path("/proc/stat").exists():
        assert host["busy_cpu_s"] >= 0 and host["ranks_cpu_s"] > 0 and host["wall_s"] > 0
        assert host["other_cpu_s"] == max(0.0, host["busy_cpu_s"] - host["ranks_cpu_s"])
        assert host["other_cores"] == host["other_cpu_s"] / host["wall_s"]
    else:
        assert host is None
    assert data["compute"]["numel"] == 8 * 64 * 64 and data["compute"]["batch_size"] == 8
    c = data["compute"]  # timed at micro-batches 2 and 8: each call's cost + per sample, through both points exactly
    assert [p["batch_size"] for p in c["points"]] == [2, 8] and c["points"][1]["forward_s"] == c["forward_s"]
    for phase in ("forward", "backward"):
        call, rate = c[f"{phase}_call_s"], c[f"{phase}_s_per_param_sample"] * c["numel"]
        fitted = not c["fit"][phase].startswith("no call cost")
        assert call >= 0 and rate > 0 and (call > 0 or not fitted or c["points"][0][f"{phase}_s"] * 4 ==
                                           pytest.approx(c["points"][1][f"{phase}_s"]))
        for p in c["points"] if fitted else c["points"][1:]:
            assert call + rate * p["batch_size"] == pytest.approx(p[f"{phase}_s"], rel=1e-9), (phase, c["fit"])
        # the call split (schema 9): fixed + per operator (the stacks at 16 and 64 layers, counted) + per parameter
        stacks = {s["depth"]: s for s in c["ops_stacks"]}
        assert sorted(stacks) == [16, 64] and c["ops"] == {"forward": 18, "backward": 60}  # 8 x (t, mm) + loss
        assert {d: (s["ops"]["forward"], s["ops"]["backward"]) for d, s in stacks.items()} == {16: (34, 116),
                                                                                             64: (130, 452)}
        per_op, fixed, per_param = (c[f"{phase}{k}"] for k in ("_s_per_op", "_call_fixed_s", "_call_s_per_param"))
        assert min(per_op, fixed, per_param) >= 0
        if fitted:
            deep, shallow = stacks[64][f"{phase}_s"], stacks[16][f"{phase}_s"]
            assert per_op == pytest.approx(max(0.0, deep - shallow) / (452 - 116 if phase == "backward" else 130 - 34))
            assert fixed == pytest.approx(max(0.0, shallow - per_op * stacks[16]["ops"][phase]))
            if per_param > 0:  # the model's fitted call, whole again
                assert fixed + per_op * c["ops"][phase] + per_param * c["numel"] == pytest.approx(call, rel=1e-9)
    # AdamW: fixed + per tensor (the stacks' 16 and 64) + per element, in the cache and beyond it, the model's step
    # whole again
    assert c["tensors"] == 8 and c["adamw_beyond"]["tensors"] == 8 and c["adamw_beyond"]["elements"] > 0
    assert min(c[k] for k in ("adamw_step_s", "adamw_s_per_tensor", "adamw_s_per_element",
                              "adamw_s_per_element_beyond")) >= 0
    from zeroexp.results.calibration import load_calibration

    rate = load_calibration(path).rate
    assert rate.optimizer_seconds(8, c["numel"]) == pytest.approx(c["optimizer_s"], rel=1e-9) or \
        c["fit"]["optimizer"].startswith("per element alone")
    assert {"loop_s", "copy_s_per_byte", "ddp_bucket_s", "zro_broadcast_s", "fsdp1_call_s"} <= set(data["framework"])
    assert all(data["framework"][k] >= 0 for k in ("loop_s", "ddp_bucket_s", "zro_broadcast_s", "fsdp1_call_s",
                                                   "fsdp1_orig_call_s"))
    from zeroexp.calibrate.framework import stream_floor
    raw = data["framework"]["raw"]  # the floors the per-call costs were taken net of, read off the streams measured
    assert raw["zro_broadcast_s_floor"] == 0.0
    assert raw["ddp_bucket_s_floor"] == stream_floor(data["collectives"], "all_reduce", 8 * 16 * 16 * 4, 3)
    assert data["framework"]["copy_s_per_byte"] > 0 and "barrier" in data["method"]
    from zeroexp.calibrate.framework import TINY_UNITS, TINY_WIDTH, WIDE_WIDTH
    assert (raw["tiny_width"], raw["wide_width"]) == (TINY_WIDTH, WIDE_WIDTH)
    def padded(width: int) -> int:  # one unit's bytes as FSDP's calls move it: padded to a multiple of N=3
        return 4 * -(-width ** 2 // 3) * 3

    assert (padded(TINY_WIDTH), padded(WIDE_WIDTH)) == (4 * 258, 4 * 262146)
    for key, tiny_bytes, wide_bytes in (("ddp_bucket_s", 4 * TINY_UNITS * TINY_WIDTH ** 2,
                                         4 * TINY_UNITS * WIDE_WIDTH ** 2),  # one bucket: the whole model
                                        ("fsdp1_call_s", padded(TINY_WIDTH), padded(WIDE_WIDTH)),  # one unit
                                        ("fsdp1_orig_call_s", padded(TINY_WIDTH), padded(WIDE_WIDTH))):
        # the line through the per-call costs on the tiny and the wide model, as they were measured
        slope = max(0.0, (raw[f"{key}_wide"] - raw[f"{key}_tiny"]) / (wide_bytes - tiny_bytes))
        assert data["framework"][f"{key}_per_byte"] == pytest.approx(slope, rel=1e-12, abs=1e-30)
        assert data["framework"][key] == pytest.approx(max(0.0, raw[f"{key}_tiny"] - slope * tiny_bytes), abs=1e-15)
    assert all(raw[f"wide_{w}_{part}"] > 0 for w in ("ddp", "fsdp1") for part in ("step_s", "base_step_s"))
    # ZeroRedundancyOptimizer is not measured wide (its broadcasts make no pass of their own over the bytes)
    assert "zro_broadcast_s_per_byte" not in data["framework"] and "wide_zro_step_s" not in raw
    assert data["framework"]["zro_broadcast_s"] == raw["zro_broadcast_s_tiny"]
    raw = data["framework"]["raw"]  # each wrapper's step, the step it is compared with and its calls, side by side
    assert all(raw[f"{w}_{part}"] > 0 for w in ("ddp", "zro", "fsdp1") for part in ("step_s", "base_step_s", "calls_s"))
    assert find_calibration("gloo", 3, tmp_path).path == str(path)
    result = cell("strategy=zero2", "world_size=3", f"calibration={path}")
    summary = json.loads((Path(result.cell_dir) / "summary.json").read_text())
    t = summary["plan"]["time"]
    assert t["calibration"]["path"] == str(path) and t["predicted_step_ms"] > 0
    assert t["check"] in ("PASS", "FAIL", "n/a") and t["measured_median_ms"] > 0
    assert summary["collectives"]["exposed_comm_ms"] >= 0 and summary["collectives"]["in_flight_ms"] > 0


def _plan(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.cli.plan import register, run

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return run(hydra_compose(config_name="plan", overrides=list(overrides)))


def test_planner_step_time_on_network_presets():
    common = ("model=mlp", "model.width=768", "world_size=[8,64]", "batch_size=8",
              "strategies=[ddp,zro,zero2,fsdp_grad_op,fsdp_full]")
    h100, _ = _plan(*common, "network=h100_ib")
    a100, _ = _plan(*common, "network=a100_ib")
    assert len(h100) == len(a100) == 10
    for h, a in zip(h100, a100):
        assert {"step_ms", "exposed_comm_ms", "tokens_per_s", "fastest"} <= set(h)
        assert 0 <= h["exposed_comm_ms"] <= h["comm_ms"] + 1e-9
        assert h["step_ms"] < a["step_ms"]  # every link and the peak are slower on a100_ib
        assert h["tokens_per_s"] == pytest.approx(8 * h["world_size"] / (h["step_ms"] / 1e3))  # mlp: 1 token a sample
        assert h["fits"] is True  # 80GB from the preset
    for n in (8, 64):
        rows = [r for r in h100 if r["world_size"] == n]
        assert [r["fastest"] for r in rows].count(True) == 1
        assert min(rows, key=lambda r: r["step_ms"])["fastest"]
    # efficiency given overrides the op-level compute: 6 x parameters x tokens at that fraction of the peak
    assert all("each kernel of the traced step" in h["network_source"] for h in h100)
    slower, _ = _plan(*common, "network=h100_ib", "network.efficiency=0.2")
    faster, _ = _plan(*common, "network=h100_ib", "network.efficiency=0.4")
    assert all(s["step_ms"] > f["step_ms"] and "x 0.2" in s["network_source"] for s, f in zip(slower, faster))


def test_planner_network_refuses_bad_input():
    from zeroexp.errors import ConfigError

    with pytest.raises(ConfigError, match="batch_size"):
        _plan("model=mlp", "network=h100_ib")
    with pytest.raises(ConfigError, match="network.efficiency"):
        _plan("model=mlp", "batch_size=8", "network=h100_ib", "network.efficiency=2")
    with pytest.raises(ConfigError, match="network.inter.busbw_Bps"):
        _plan("model=mlp", "batch_size=8", "network=a100_ib", "network.inter.busbw_Bps=0")


def test_plan_time_says_its_calibration_ran_beside_other_work(compose, tmp_path):
    from zeroexp.plan.check.step_time import BUSY_HOST_CORES

    said = {}
    for busy in (0.0, BUSY_HOST_CORES + 0.01, None):
        data = calibration_data(numel=8 * 64 * 64)
        data["host_activity"] = None if busy is None else {"other_cores": busy}
        path = tmp_path / f"cal{busy}.json"
        path.write_text(json.dumps(data))
        t = time_section(Cell.of(compose("world_size=2", f"calibration={path}")), _summary([10.0] * 40))
        said[busy] = [r for r, c in zip(t["reasons"], t["reason_codes"]) if c == Code.TIME_CALIBRATION_BUSY]
        assert t["check"] == ("PASS" if 0.8 <= t["ratio"] <= 1.25 else "FAIL")  # a reason, not a verdict
    assert said[0.0] == [] and said[None] == [] and "0.26 cores" in said[BUSY_HOST_CORES + 0.01][0]


def test_plan_time_says_its_cell_ran_beside_other_work(compose, tmp_path):
    """timing.host_activity above BUSY_HOST_CORES by more than its resolution: a reason, not a verdict."""
    from zeroexp.plan.check.step_time import BUSY_HOST_CORES

    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_data(numel=8 * 64 * 64)))
    cfg = compose("world_size=2", f"calibration={path}")
    over = BUSY_HOST_CORES + 0.05
    for host, said in ((None, False), ({"other_cores": over, "resolution_cores": 0.01}, True),
                       ({"other_cores": over, "resolution_cores": 0.06}, False),  # within the counters' resolution
                       ({"other_cores": 0.0, "resolution_cores": 0.0}, False), ({"other_cores": over}, True)):
        summary = _summary([10.0] * 40)
        summary["timing"]["host_activity"] = host
        t = time_section(Cell.of(cfg), summary)
        reasons = [r for r, c in zip(t["reasons"], t["reason_codes"]) if c == Code.TIME_CELL_BUSY]
        assert bool(reasons) == said, (host, t["reasons"])
        assert not reasons or f"{over:.2f} cores" in reasons[0]
        assert t["check"] == ("PASS" if 0.8 <= t["ratio"] <= 1.25 else "FAIL")


def test_host_activity_is_the_hosts_busy_cpu_less_the_ranks_own():
    import os

    from zeroexp.hostload import activity, busy_beyond, resolution_cores

    a = activity(10.0, 25.0, 19.0)
    assert a == {"wall_s": 10.0, "busy_cpu_s": 25.0, "ranks_cpu_s": 19.0, "other_cpu_s": 6.0, "other_cores": 0.6,
                 "resolution_cores": 2 * os.cpu_count() / os.sysconf("SC_CLK_TCK") / 10.0}
    assert resolution_cores(1.0) == 10 * resolution_cores(10.0)
    assert activity(10.0, 18.0, 19.0)["other_cpu_s"] == 0.0  # the counters' ticks: never below 0
    assert activity(10.0, None, 19.0) is None and activity(0.0, 1.0, 1.0) is None
    assert busy_beyond(a, 0.25) == 0.6 and busy_beyond(a, 0.6) is None and busy_beyond(None, 0.0) is None
    # a cell's: rank 0's window and host counter, less the own CPU of the ranks on rank 0's host (not node b's)
    from zeroexp.probes.timing import _host
    ranks = [{"hostname": "a", "host": [0.0, 100.0, 1.0, 10.0, 125.0, 11.0]},  # (wall, busy, own) first, last
             {"hostname": "a", "host": [0.1, 100.0, 2.0, 10.1, 125.1, 11.0]},
             {"hostname": "b", "host": [0.0, 50.0, 1.0, 10.0, 70.0, 11.0]}]
    assert _host(ranks) == activity(10.0, 25.0, 19.0)
    assert _host(ranks[:1] + [{"hostname": "a", "host": None}]) is None  # a rank without timed steps


def test_order_agreement_on_given_numbers():
    from zeroexp.report.step_time import order_agreement

    rows = [("ddp", 50.0, (48.0, 52.0), 40.0), ("zro", 60.0, (58.0, 62.0), 45.0),
            ("fsdp", 51.0, (49.0, 53.0), 90.0), ("zero2", 70.0, (69.0, 71.0), 30.0)]
    agree, disagree = order_agreement(rows)
    # ddp / fsdp overlap (unknown order); ddp < zro agrees; the other four separable pairs are ordered otherwise
    assert agree == ["ddp < zro"]
    assert disagree == ["ddp < zero2", "fsdp < zro", "zro < zero2", "fsdp < zero2"]
    # predicted equal (fsdp_full pre and none on a CPU that overlaps nothing): not ordered, whichever is listed first
    for tie in ([("pre", 155.0, (150.0, 160.0), 138.0), ("none", 142.0, (138.0, 146.0), 138.0)],
                [("none", 142.0, (138.0, 146.0), 138.0), ("pre", 155.0, (150.0, 160.0), 138.0)]):
        assert order_agreement(tie) == ([], ["none < pre"])


def test_plan_time_says_what_it_does_not_model(compose, tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration_data(world_size=4, numel=8 * 64 * 64)))
    bf16 = time_section(Cell.of(compose("strategy=zero2", "world_size=2", "precision=bf16", f"calibration={path}")),
                        _summary([10.0] * 40))
    assert bf16["check"] == "n/a" and bf16["predicted_step_ms"] > 0 and bf16["ratio"] is None
    assert Code.TIME_PRECISION_NOT_MODELLED in bf16["reason_codes"]
    assert Code.TIME_CALIBRATION_CARRIED in bf16["reason_codes"]  # a calibration of another N is said, not hidden
    assert len(bf16["reason_codes"]) == len(bf16["reasons"])
    assert bf16["throughput"]["samples_per_s"] == pytest.approx(8 * 2 / 0.010)


def _calibrate_cfg(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from zeroexp.cli.calibrate import register
    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="calibrate", overrides=list(overrides))


@pytest.mark.parametrize("overrides, key", [
    (("calibrate.min_bytes=8192", "calibrate.max_bytes=4096"), "calibrate.max_bytes"),
    (("world_size=0",), "world_size"),
    (("calibrate.ops=[all_reduce,alltoall]",), "calibrate.ops"),
    (("calibrate.target_s=0",), "calibrate.target_s"),
    (("calibrate.wake_gaps_ms=[1,2]",), "calibrate.wake_gaps_ms"),
    (("calibrate.wake_gaps_ms=[0,2,1]",), "calibrate.wake_gaps_ms"),
    (("calibrate.wake_calls=0",), "calibrate.wake_calls"),
    (("device=tpu",), "device"),
])
def test_calibrate_refuses_bad_input_naming_the_key(overrides, key):
    from zeroexp.cli.calibrate import validate
    from zeroexp.errors import ConfigError

    cfg = _calibrate_cfg(*overrides)
    assert cfg.calibrate.max_bytes >= 4096 and cfg.model.name == "mlp"  # the composed defaults
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key
