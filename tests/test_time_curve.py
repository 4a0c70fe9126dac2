"""The step-time model's measured curves through their structure: a collective from the calibration's
measured sizes, the wake curve of a call after compute, the channel with waking, the framework's per-call cost with
the waking taken out, the host allocator every rank pins. Exact results on given numbers, never timing asserts."""

from __future__ import annotations

import math

import pytest

from zeroexp.calibrate.framework import per_call
from zeroexp.formulas import (LinkFit, WakeCurve, bus_factor, channel_step, collective_seconds, isotonic,
                              measured_call_seconds, simulate_step)

TABLE = [(1000, 1.0e-3), (2000, 3.0e-3), (4000, 2.0e-3), (8000, 6.0e-3)]  # 2000 and 4000 out of order
LINK = LinkFit(2e-4, 1e6)


def test_isotonic_is_the_least_squares_monotone_fit():
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert isotonic([1.0, 3.0, 2.0, 4.0, 0.5, 6.0]) == [1.0, 2.375, 2.375, 2.375, 2.375, 6.0]
    assert isotonic([2.0, 1.0]) == [1.5, 1.5] and isotonic([]) == []


def test_a_call_from_the_measured_curve():
    # the table made monotone: 1.0, 2.5, 2.5, 6.0 ms
    at = lambda s, n=2: measured_call_seconds("all_reduce", s, n, TABLE, 2, LINK)  # noqa: E731
    assert at(1000) == pytest.approx(1.0e-3) and at(500) == pytest.approx(1.0e-3)  # below: the first size's
    assert at(1500) == pytest.approx(1.75e-3)  # linear between 1000 (1.0) and 2000 (2.5)
    assert at(3000) == pytest.approx(2.5e-3) and at(6000) == pytest.approx(4.25e-3)
    assert at(10000) == pytest.approx(6.0e-3 + 2000 * bus_factor("all_reduce", 2) / 1e6)  # beyond: the fit's busbw
    # at N=4 the bandwidth part scales with the ring's bus factor, the latency stays
    scale = bus_factor("all_reduce", 4) / bus_factor("all_reduce", 2)
    assert at(8000, 4) == pytest.approx(2e-4 + (6.0e-3 - 2e-4) * scale)
    assert at(8000, 1) == 0.0
    # no measured sizes (a given calibration): the fit
    assert measured_call_seconds("all_gather", 5000, 4, [], 2, LINK) == collective_seconds("all_gather", 5000, 4, LINK)


def test_a_calibration_times_calls_of_their_own_size():
    from zeroexp.results.calibration import Calibration
    from tests.test_time import calibration_data

    data = calibration_data()
    data["collectives"]["all_gather"]["sizes"] = [{"bytes": b, "seconds": 1.0, "mean_s": t} for b, t in TABLE]
    seconds = Calibration("given", data).seconds_at(2)
    assert seconds("all_gather", 3000, 2) == pytest.approx(2 * 1.75e-3)  # two calls of 1500 B
    assert seconds("all_gather", 3000, 1) == pytest.approx(2.5e-3)  # one call of 3000 B
    assert seconds("all_gather", 3000, 0) == 0.0


def test_the_wake_curve():
    w = WakeCurve((0.0, 1e-3, 4e-3, 16e-3), (0.0, 1e-3, 3e-3, 2e-3))  # 4 and 16 ms pooled to 2.5 ms
    assert w(0.0) == 0.0 and w(-1.0) == 0.0
    assert w(0.5e-3) == pytest.approx(0.5e-3) and w(1e-3) == pytest.approx(1e-3)
    assert w(2.5e-3) == pytest.approx(1.75e-3) and w(4e-3) == pytest.approx(2.5e-3) and w(1.0) == pytest.approx(2.5e-3)
    assert WakeCurve((0.0, 1e-3), (0.0, -1e-4))(1e-3) == 0.0  # noise below zero is no waking
    # a gap-0 baseline measured high is pooled with the gaps beside it (-0.38, -0.45 ms: a calibration's): every
    # waking is read from the pooled baseline, (0 - 0.38 - 0.45) / 3 ms, not from the one high point
    high = WakeCurve((0.0, 0.25e-3, 0.5e-3, 1e-3), (0.0, -0.38e-3, -0.45e-3, 0.23e-3))
    assert high(0.5e-3) == 0.0 and high(1e-3) == pytest.approx(0.23e-3 + 0.83e-3 / 3)
    assert WakeCurve((), ())(1.0) == 0.0


def test_the_channel_wakes_calls_after_their_gaps():
    w = WakeCurve((0.0, 1.0, 10.0), (0.0, 0.1, 1.0))  # linear 0.1 per second of gap up to 10
    # no overlap: gaps between issue points, the first one wrapping around the step (10 - 8 + 2 = 4)
    calls = [(2.0, 2.0, 0, 1.0), (8.0, 8.0, 0, 1.0)]
    step, woken = channel_step(10.0, calls, overlap=False, wake=w)
    assert woken == pytest.approx(w(4.0) + w(6.0)) and step == pytest.approx(12.0 + woken)
    assert simulate_step(10.0, calls, overlap=False) == 12.0  # no curve: no waking
    # two calls issued together: the second one finds the channel busy (gap 0: no waking)
    step, woken = channel_step(10.0, [(2.0, 10.0, 0, 1.0), (2.0, 10.0, 1, 1.0)], overlap=False, wake=w)
    assert woken == pytest.approx(w(10.0))
    # overlap: the channel's idle wall time, from the previous step's end of the call (3 + its waking) to 10 + 2:
    # the fixed point e = w(9 - e) = 0.1 (9 - e), e = 9 / 11
    step, woken = channel_step(10.0, [(2.0, 10.0, 0, 1.0)], overlap=True, wake=w)
    assert step == 10.0 and woken == pytest.approx(9 / 11) and woken == pytest.approx(w(9.0 - woken))
    # a steep curve (slope 4 below 0.25 s), the channel busy most of the step: e = w(0.1 - e) = 4 (0.1 - e) = 0.08
    steep = WakeCurve((0.0, 0.25, 16.0), (0.0, 1.0, 1.0))
    step, woken = channel_step(1.0, [(0.0, 1.0, 0, 0.9)], overlap=True, wake=steep)
    assert woken == pytest.approx(0.08) and step == pytest.approx(1.0)


def test_the_framework_per_call_cost_without_the_waking():
    flat = WakeCurve((0.0, 1e-6), (0.0, 2e-4))  # 0.2 ms for any gap over 1 us
    assert per_call(1e-3, 2, 1e-3, None) == pytest.approx(5e-4)
    assert per_call(1e-3, 2, 1e-3, flat) == pytest.approx(3e-4, abs=1e-12)
    assert per_call(3e-4, 2, 1e-3, flat) == 0.0  # the waking alone accounts for more than the extra
    assert per_call(-1e-3, 2, 1e-3, None) == 0.0
    ramp = WakeCurve((0.0, 1e-3), (0.0, 1e-3))  # wake = gap up to 1 ms: 2 x (x + 0.25 ms + x) = 1.5 ms
    x = per_call(1.5e-3, 2, 0.5e-3, ramp)
    assert math.isclose(x, 0.25e-3, rel_tol=1e-9)
    # back to back (ZeroRedundancyOptimizer's broadcasts): only the first waits on the step's compute;
    # 3 x + wake(1 ms + x) + 2 wake(x) = 3 x + 1 ms + 2 x = 2 ms: x = 0.2 ms
    assert math.isclose(per_call(2e-3, 3, 1e-3, ramp, back_to_back=True), 0.2e-3, rel_tol=1e-9)


def test_every_rank_pins_the_host_allocator():
    import platform

    from zeroexp.devices import HOST_ALLOCATOR, pin_host_allocator

    got = pin_host_allocator()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert got == HOST_ALLOCATOR
    else:
        assert got is None


def test_an_async_burst_is_timed_by_the_bursts_per_call_cost():
    """ZeroRedundancyOptimizer's parameter broadcasts (and zeroexp's ZeRO all_gathers of several buckets) are issued
    together: their slots say so, and a calibration's ``burst_mean_s`` times them; every other call, and a schema 3
    calibration's bursts, keep the lone call's time."""
    from tests.test_time import calibration_data
    from zeroexp.results.calibration import Calibration
    from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, collective_slots, derive_groups, predict_step, \
        step_collectives

    shape = ModelShape(params=((768, 768),) * 8, units=tuple((i,) for i in range(8)), root=(False,) * 8)
    size = 768 * 768 * 4
    data = calibration_data()
    for op in data["collectives"]:  # one measured size around a parameter's: a lone call 1 ms, in a burst 1.5 ms
        data["collectives"][op]["sizes"] = [{"bytes": size, "seconds": 1e-3, "mean_s": 1e-3, "burst_mean_s": 1.5e-3}]
    cal = Calibration("given", data)
    assert cal.seconds_at(2, burst=True)("broadcast", size, 1) == pytest.approx(1.5e-3)
    assert cal.seconds_at(2)("broadcast", size, 1) == pytest.approx(1e-3)
    knobs = PlanKnobs(bucket_cap_bytes=100 * 2**20)  # one DDP bucket
    times = {}
    for row in ("ddp", "zro"):
        layout = LAYOUTS[row]
        groups = derive_groups(row, layout, shape, 2, 4, knobs)
        coll = step_collectives(layout, groups, 4, knobs)
        slots, _ = collective_slots(layout, groups, "pre", 1.0, 2.0, 1.0)
        assert [s.burst for s in slots if s.op == "broadcast"] == [True] * (8 if row == "zro" else 0)
        assert not any(s.burst for s in slots if s.op != "broadcast")
        run = lambda **kw: predict_step(layout, groups, coll, cal.rate, 8, cal.seconds_at(2), False, **kw)  # noqa
        times[row] = run().comm_s, run(burst_seconds=cal.seconds_at(2, burst=True)).comm_s
    for cap, several in ((100 * 2**20, False), (4 * 2**20, True)):  # zeroexp's ZeRO: its buckets' all_gathers
        groups = derive_groups("zero2", LAYOUTS["zero2"], shape, 2, 4, PlanKnobs(bucket_cap_bytes=cap))
        gathers = [s for s in collective_slots(LAYOUTS["zero2"], groups, "pre", 1.0, 2.0, 1.0)[0]
                   if s.op == "all_gather"]
        assert len(gathers) == len(groups.shards) and all(s.burst == several for s in gathers)
    assert times["ddp"][0] == times["ddp"][1]  # no burst in DDP's step
    assert times["zro"][1] - times["zro"][0] == pytest.approx(8 * 0.5e-3)  # each broadcast 0.5 ms more
    del data["collectives"]["broadcast"]["sizes"][0]["burst_mean_s"]  # schema 3: no bursts measured
    assert Calibration("given", data).seconds_at(2, burst=True)("broadcast", size, 1) == pytest.approx(1e-3)


def test_a_call_behind_another_pays_at_least_its_stream_floor():
    """A call's extra beyond its time alone is its waking or its floor (a stream's per-call time less the call's
    alone at its size: the peer's trailing work of the call before, which a barrier hides), the larger; a burst's
    calls and a calibration without streams (schema 4) have no floor."""
    from tests.test_time import calibration_data
    from zeroexp.calibrate.framework import stream_floor
    from zeroexp.results.calibration import Calibration
    from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, derive_groups, predict_step, step_collectives

    w = WakeCurve((0.0, 1.0, 10.0), (0.0, 0.1, 1.0))  # 0.1 per second of gap up to 10
    calls = [(2.0, 2.0, 0, 1.0, 0.5), (8.0, 8.0, 0, 1.0, 0.3)]  # gaps 4 (wraps around) and 6: wake 0.4 and 0.6
    step, woken = channel_step(10.0, calls, overlap=False, wake=w)
    assert woken == pytest.approx(0.5 + 0.6) and step == pytest.approx(12.0 + woken)  # floor 0.5 > 0.4; 0.3 < 0.6
    assert channel_step(10.0, calls, overlap=False)[1] == pytest.approx(0.8)  # no curve: the floors alone
    assert channel_step(10.0, [c[:4] for c in calls], overlap=False, wake=w)[1] == pytest.approx(1.0)  # no floors
    # overlap: the first call's fixed point e = max(w(9 - e), 0.9) = 0.9 (w(8.1) = 0.81)
    step, woken = channel_step(10.0, [(2.0, 10.0, 0, 1.0, 0.9)], overlap=True, wake=w)
    assert woken == pytest.approx(0.9) and step == 10.0

    size = 768 * 768 * 4
    data = calibration_data()
    for op in data["collectives"]:  # one size: alone 1 ms, in a stream 1.4 ms, in a burst 1.5 ms
        data["collectives"][op]["sizes"] = [{"bytes": size, "seconds": 1e-3, "mean_s": 1e-3, "burst_mean_s": 1.5e-3,
                                             "stream_mean_s": 1.4e-3}]
    cal = Calibration("given", data)
    assert cal.seconds_at(2, stream=True)("all_gather", size, 1) == pytest.approx(1.4e-3)
    assert stream_floor(data["collectives"], "all_gather", size, 2) == pytest.approx(0.4e-3)
    assert stream_floor(data["collectives"], "all_gather", size // 2, 2) == pytest.approx(0.4e-3)  # below: the first
    assert stream_floor({}, "all_gather", size, 2) == 0.0
    shape = ModelShape(params=((768, 768),) * 8, units=tuple((i,) for i in range(8)), root=(False,) * 8)
    knobs = PlanKnobs(bucket_cap_bytes=100 * 2**20)
    for row, floored in (("fsdp_full", 8 + 8 + 8), ("zro", 1)):  # FSDP: every call; zro: its all_reduce, not its
        layout = LAYOUTS[row]  # burst of broadcasts
        groups = derive_groups(row, layout, shape, 2, 4, knobs)
        coll = step_collectives(layout, groups, 4, knobs)
        run = lambda **kw: predict_step(layout, groups, coll, cal.rate, 8, cal.seconds_at(2), False,  # noqa: E731
                                        burst_seconds=cal.seconds_at(2, burst=True), **kw)
        plain, streamed = run(), run(stream_seconds=cal.seconds_at(2, stream=True))
        assert plain.wake_s == 0.0 and plain.comm_s == streamed.comm_s  # no curve: the floors are all the extra
        one = cal.seconds_at(2, stream=True)("all_reduce", coll["all_reduce"]["payload_bytes"], 1) - cal.seconds_at(2)(
            "all_reduce", coll["all_reduce"]["payload_bytes"], 1) if row == "zro" else 0.4e-3
        assert streamed.wake_s == pytest.approx(floored * one) and streamed.step_s == pytest.approx(
            plain.step_s + floored * one)
    del data["collectives"]["all_gather"]["sizes"][0]["stream_mean_s"]  # schema 4: no streams, no floor
    assert Calibration("given", data).seconds_at(2, stream=True)("all_gather", size, 1) == pytest.approx(1e-3)


def test_the_framework_per_call_cost_net_of_the_stream_floor():
    flat = WakeCurve((0.0, 1e-6), (0.0, 2e-4))  # 0.2 ms for any gap over 1 us
    assert per_call(1e-3, 2, 1e-3, flat, floor_s=3e-4) == pytest.approx(2e-4, abs=1e-12)  # 2 x + 2 x 0.3 ms = 1 ms
    assert per_call(1e-3, 2, 1e-3, flat, floor_s=1e-4) == pytest.approx(3e-4, abs=1e-12)  # the waking is larger
    assert per_call(1e-3, 2, 1e-3, None, floor_s=5e-4) == 0.0  # the floors account for all of it
