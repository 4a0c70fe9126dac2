"""``summary.json["plan"]["time"]``: the predicted step time of a cell that ran, beside its measured median.

The prediction is the one model's (:func:`zeroexp.formulas.predict_step`) over the groups the cell's row derives
from its shapes, with a calibration of this machine, backend and world size (:mod:`zeroexp.results.calibration`: the
newest
in ``outputs/calibration/``, or ``calibration=PATH``); nothing is fitted to the cell. The measurement is the timing
probe's timed steps (their median and a bootstrap 95 % CI of it) and the collectives probe's exposed communication.

Check: ``n/a`` without a calibration or without timed steps; ``PASS`` when predicted / measured is within
:data:`RATIO_LIMIT` either way; ``FAIL`` otherwise. A median whose CI is wider than +-:data:`MEDIAN_CI_LIMIT` (a
2-core host's steps wander) is judged by its interval: ``PASS`` where a time in it lies within the bound, ``FAIL``
where none does, with the timed steps that would narrow it (:func:`time_check`).
"""

from __future__ import annotations

from typing import Any, Sequence

from zeroexp.cell.resolved import Cell
from zeroexp.results.calibration import Calibration, calibration_directory, find_calibration, load_calibration
from zeroexp.formulas import steps_to_narrow
from zeroexp.results.verdict import Check, Code, Reason, Verdict

__all__ = ["time_section", "median_ci95", "time_check", "RATIO_LIMIT", "MEDIAN_CI_LIMIT", "BOOTSTRAP"]

#: A prediction passes within this factor of the measured median, either way.
RATIO_LIMIT = 1.25
#: The median is known when its bootstrap 95 % CI lies within +-10 % of it.
MEDIAN_CI_LIMIT = 0.10
#: Bootstrap resamples and seed: the same steps give the same interval.
BOOTSTRAP = (2000, 0)


def median_ci95(step_ms: Sequence[float], resamples: int = BOOTSTRAP[0], seed: int = BOOTSTRAP[1]
                ) -> tuple[float, float, float]:
    """The median of ``step_ms`` and the percentile bootstrap 95 % CI of it (Efron & Tibshirani, "An Introduction to
    the Bootstrap", 1993, ch. 13): ``resamples`` resamples with replacement, seeded."""
    import numpy as np

    a = np.asarray(step_ms, dtype=float)
    if a.size == 0:
        raise ValueError("no step times")
    medians = np.median(np.random.default_rng(seed).choice(a, size=(resamples, a.size), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(np.median(a)), float(low), float(high)


def time_check(predicted_ms: float, median_ms: float, ci: tuple[float, float], timed_steps: int
               ) -> tuple[Verdict, list[Reason]]:
    """``(check, reasons)`` for a prediction against a measured median with its 95 % CI (see the module): a median
    known to within +-:data:`MEDIAN_CI_LIMIT` is judged itself; a wider one by its interval, so that noise alone does
    not FAIL a prediction and a wrong one still does: ``PASS`` where some time in the CI lies within
    :data:`RATIO_LIMIT` of the prediction, ``FAIL`` where none does, each with the interval's width noted."""
    half = max(median_ms - ci[0], ci[1] - median_ms) / median_ms
    ratio = predicted_ms / median_ms
    if half <= MEDIAN_CI_LIMIT:
        if 1 / RATIO_LIMIT <= ratio <= RATIO_LIMIT:
            return Verdict.PASS, []
        return Verdict.FAIL, [Reason(Code.TIME_RATIO_OUT_OF_BOUND, f"predicted {predicted_ms:.3f} ms is {ratio:.2f}x "
                                     f"the measured median {median_ms:.3f} ms (outside 1/{RATIO_LIMIT} .. "
                                     f"{RATIO_LIMIT})")]
    more = steps_to_narrow(timed_steps, half, MEDIAN_CI_LIMIT)
    wide = Reason(Code.TIME_MEDIAN_UNSTABLE, f"median not known to +-{100 * MEDIAN_CI_LIMIT:.0f} %: its 95 % CI "
                  f"[{ci[0]:.3f}, {ci[1]:.3f}] ms is +-{100 * half:.1f} % of {median_ms:.3f} ms over {timed_steps} "
                  f"timed steps (about {more} would narrow it: a CI shrinks as 1/sqrt(steps)); judged against the "
                  "interval")
    if ci[0] / RATIO_LIMIT <= predicted_ms <= ci[1] * RATIO_LIMIT:
        return Verdict.PASS, [wide]
    return Verdict.FAIL, [Reason(Code.TIME_RATIO_OUT_OF_BOUND, f"predicted {predicted_ms:.3f} ms is "
                                 f"{predicted_ms / (ci[1] if predicted_ms > ci[1] else ci[0]):.2f}x the nearest end of "
                                 f"the measured median's 95 % CI [{ci[0]:.3f}, {ci[1]:.3f}] ms (outside "
                                 f"1/{RATIO_LIMIT} .. {RATIO_LIMIT} of every time in it)"), wide]


#: Cores' worth of other processes' work during a calibration, or during a cell's timed steps, above which a cell says
#: it ran beside other work (measured: a quiet 2-core host 0.0-0.05; a short pytest beside a calibration moved
#: fsdp_full's prediction from 40.4 to 33.4 ms, 0.87 -> 0.71 of the measured median).
BUSY_HOST_CORES = 0.25


def _calibration(cell: Cell) -> tuple[Calibration | None, str | None]:
    if cell.calibration:
        return load_calibration(cell.calibration), None
    backend, n = cell.backend, cell.world_size
    found = find_calibration(backend, n)
    if found is None:
        return None, (f"no calibration of this machine, backend {backend} and world_size={n} in "
                      f"{calibration_directory()}/: run `python -m zeroexp.calibrate world_size={n}` (or give "
                      "calibration=PATH)")
    return found, None


def time_section(cell: Cell, summary: dict[str, Any]) -> dict[str, Any]:
    """``plan.time`` of a cell (fields: docs/results.md), over the groups the cell's row derives from its shapes.
    Never raises: a failure becomes ``check: ERROR``."""
    try:
        return _section(cell, summary)
    except Exception as e:  # noqa: BLE001 - the plan must never fail a cell that ran
        return Check.raised(e).fields()


def _section(cell: Cell, summary: dict[str, Any]) -> dict[str, Any]:
    from zeroexp.formulas import checkpointed_numel, derive_groups
    from zeroexp.plan.shape import cell_shape

    name, layout, n, batch = cell.row_name, cell.row, cell.world_size, cell.batch_size
    itemsize, knobs, shape = cell.itemsize, cell.knobs, cell_shape(cell)
    groups = derive_groups(name, layout, shape, n, itemsize, knobs)
    share = 1.0
    if cell.checkpointed.policy:  # selective_op: the part of the units' forward its recompute reruns, counted
        from zeroexp.models import import_class
        from zeroexp.plan.flops import recompute_share

        share = recompute_share(cell.model, batch, tuple(import_class(p) for p in cell.wrap), cell.checkpointed)
    checkpointed = checkpointed_numel(shape.units, shape.root, shape.numels, cell.checkpointed, share)
    coll = summary.get("collectives") or {}
    out: dict[str, Any] = {"predicted_step_ms": None, "measured_median_ms": None, "median_ci95_ms": None,
                           "ratio": None, "exposed_comm_ms": None,
                           "measured_exposed_comm_ms": coll.get("exposed_comm_ms"), "predicted_by_phase": None,
                           "throughput": None, "framework": None,
                           "calibration": None, "overlap_rule": None, "check": Verdict.NA, "reasons": []}
    notes: list[Reason] = []  # why not checked, or what a check notes: written by Check.fields at each return
    timing = summary.get("timing") or {}
    steps = timing.get("step_ms") or []
    if steps:
        from zeroexp.plan.network import tokens_per_sample

        median, low, high = median_ci95(steps)
        samples = batch * cell.grad_accum * n / (median / 1e3)
        out.update(measured_median_ms=median, median_ci95_ms=[low, high], throughput={
            "samples_per_s": samples, "tokens_per_s": samples * tokens_per_sample(cell.model), "mfu": None,
            "why": "measured median; MFU needs the device's peak FLOP/s, which zeroexp knows for no CPU"})
    cal, why = _calibration(cell)
    if cal is None:
        return {**out, **Check(Verdict.NA, (Reason(Code.TIME_NO_CALIBRATION, why),)).fields()}
    out["calibration"] = cal.summary()
    from zeroexp.plan.network import calibrated_network, compute_rate, model_ops, predict_on

    network = calibrated_network(cal)
    ops = model_ops(network, cell.model, batch)
    t = predict_on(network, layout, groups, itemsize, knobs, batch, n, cell.policy.prefetch, checkpointed, ops=ops,
                   rate=compute_rate(network, cell.model, batch, groups.numel))
    out.update(predicted_step_ms=1e3 * t.step_s, exposed_comm_ms=1e3 * t.exposed_comm_s,
               predicted_by_phase=t.by_phase_ms(), overlap_rule=t.rule,
               framework={"terms_ms": {k: 1e3 * v for k, v in t.framework_terms},
                          "not_modelled": list(t.framework_notes)})
    unmodelled = []
    if cell.precision != "fp32" or cell.offload != "none":
        unmodelled.append(f"the calibration times fp32 compute on the device; precision={cell.precision} "
                          f"offload={cell.offload} is not modelled")
    c = cal.data["compute"]
    if int(cal.world_size) != n or cal.data["backend"] != cell.backend:
        notes.append(Reason(Code.TIME_CALIBRATION_CARRIED, f"calibrated with {cal.data['backend']} at "
                            f"N={cal.world_size}, this cell {cell.backend} at N={n}: busbw carried "
                            "over as the ring model says"))
    missing = cal.missing_terms() if layout.family.dtensor_params else None
    if missing:
        notes.append(Reason(Code.TIME_CALIBRATION_LACKS_TERMS, missing))
    from zeroexp.hostload import busy_beyond

    busy = busy_beyond(cal.data.get("host_activity"), BUSY_HOST_CORES)
    if busy is not None:
        notes.append(Reason(Code.TIME_CALIBRATION_BUSY, f"the calibration ran beside other work ({busy:.2f} cores "
                            "busy with other processes on average): its times are not this host's quiet ones; "
                            "recalibrate on a quiet host"))
    busy = busy_beyond(timing.get("host_activity"), BUSY_HOST_CORES)
    if busy is not None:
        notes.append(Reason(Code.TIME_CELL_BUSY, f"this cell's timed steps ran beside other work ({busy:.2f} cores "
                            "busy with other processes on average, timing.host_activity): its median is not this "
                            "host's quiet one"))
    if network.kernels is not None:
        notes.append(Reason(Code.TIME_COMPUTE_BY_OPERATION, (
            f"compute costed operation by operation ({ops[0]} forward, {ops[1]} backward operators dispatched; each "
            "matmul and memory-bound operation of the traced step at this machine's microbenchmarked times)")))
    elif c["model"] != str(cell.model["name"]) or int(c["numel"]) != groups.numel or int(c["batch_size"]) != batch:
        notes.append(Reason(Code.TIME_COMPUTE_CARRIED, (
            f"compute calibrated on {c['model']} ({c['numel']} parameters, batch {c['batch_size']}), "
            f"this cell {cell.model['name']} ({groups.numel}, batch {batch}): rates per "
            "parameter x sample carried over" + (
                f", each call's cost per operator ({ops[0]} forward, {ops[1]} backward) and per "
                "parameter" if network.rate.counts_ops else
                ", each call's own cost as the calibration's model's (schema 8: not carried)"
                if cal.rate.forward_call_s or cal.rate.backward_call_s else ""))))
    if unmodelled or not steps:
        notes += ([Reason(Code.TIME_PRECISION_NOT_MODELLED, n) for n in unmodelled] if unmodelled else
                  [Reason(Code.TIME_NO_TIMED_STEPS, "no timed steps: the timing probe did not run")])
        return {**out, **Check(Verdict.NA, tuple(notes)).fields()}
    out["ratio"] = out["predicted_step_ms"] / out["measured_median_ms"]
    check, reasons = time_check(out["predicted_step_ms"], out["measured_median_ms"], tuple(out["median_ci95_ms"]),
                                len(steps))
    return {**out, **Check(check, (*reasons, *notes)).fields()}

