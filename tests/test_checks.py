"""No verdict hides a failure: every check of a cell, the plan's parts included, reaches the digest's line of its
name, the line above its parts, the sweep's verdicts, its failures and the exit code (zeroexp.report.checks).

Hand-made summaries, no run: a plan whose peak model raised, a plan whose groups differ, a plan that raised
before its parts; sweeps of such cells written as files and read back as the report reads them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from zeroexp.report.checks import cell_checks, failed_checks, plan_checks, worst
from zeroexp.results.verdict import Code

ROWS = [{"op": "all_gather", "predicted_count": 2, "measured_count": 2, "predicted_bytes": 64, "measured_bytes": 64}]
#: A plan whose own parts pass: the shape zeroexp.plan.check.cell.plan_section writes.
PLAN = {"layout": "FSDP2 reshard_after_forward=True", "row": "fsdp2_full", "ranks": [], "collectives": ROWS,
        "groups": {"check": "PASS", "reasons": []}, "payload_check": "PASS", "payload_reasons": [],
        "check": "PASS", "reasons": [],
        "memory": {"check": "PASS", "max_rel_err": 0.01, "reasons": []},
        "time": {"check": "n/a", "predicted_step_ms": None, "reasons": ["no calibration of this machine"],
                 "reason_codes": ["time.no_calibration"]}}
SUMMARY = {"status": "ok", "final_loss": 0.5, "state": {"check": "PASS", "reasons": []},
           "collectives": {"check": "PASS", "reasons": []}, "memory": {"steady_bytes_max": 1},
           "equivalence": {"check": "PASS", "max_abs_err": 0.0, "effective_threshold": 1e-5}, "plan": PLAN}


def summary(**plan: object) -> dict:
    """:data:`SUMMARY` with its plan's fields replaced by ``plan``."""
    s = copy.deepcopy(SUMMARY)
    s["plan"].update(copy.deepcopy(plan))
    return s


MEMORY_ERROR = summary(memory={"check": "ERROR", "reasons": ["KeyError: 'backward'"], "reason_codes": ["probe.raised"]})


def test_worst_orders_error_fail_pass_then_the_rest():
    assert worst(["PASS", "n/a", "FAIL", "ERROR"]) == "ERROR"
    assert worst(["n/a", "FAIL", "PASS"]) == "FAIL"
    assert worst(["n/a", "PASS"]) == "PASS"
    assert worst(["n/a"]) == "n/a" and worst([]) == "n/a"


def test_every_part_of_the_plan_is_a_check_and_n_a_carries_its_reason():
    parts = {c.name: c for c in plan_checks(SUMMARY["plan"])}
    assert list(parts) == ["plan.state", "plan.collectives", "plan.groups", "plan.memory", "plan.time"]
    assert {n: c.verdict for n, c in parts.items() if n != "plan.time"} == dict.fromkeys(list(parts)[:4], "PASS")
    assert parts["plan.time"].check.codes == [Code.TIME_NO_CALIBRATION]
    assert failed_checks(SUMMARY) == []
    bare = summary(time={"check": "n/a", "reasons": []})
    assert next(c for c in cell_checks(bare) if c.name == "plan.time").check.codes == [Code.UNRECORDED]
    old = summary(time={"check": "n/a", "reasons": ["no calibration of this machine"]})  # before reason codes
    assert next(c for c in cell_checks(old) if c.name == "plan.time").check.codes == [Code.UNCODED]


def test_the_plans_own_fail_is_split_into_its_parts():
    """``plan.check`` covers state bytes, calls and groups; its reasons list them in that order: each part gets its
    own verdict and reasons."""
    groups = summary(check="FAIL", reasons=["groups owners: live [0, 1], planned [1, 0]"],
                     groups={"check": "FAIL", "reasons": ["owners: live [0, 1], planned [1, 0]"]})
    assert [(c.name, c.verdict) for c in failed_checks(groups)] == [("plan.groups", "FAIL")]
    calls = summary(check="FAIL", reasons=["rank 1 param: measured 8 B", "all_gather: measured 3 calls"],
                    reason_codes=["plan.state_differs", "plan.calls_differ"],
                    collectives=[{**ROWS[0], "measured_count": 3}])
    assert [(c.name, c.verdict, c.check.codes) for c in failed_checks(calls)] == [
        ("plan.state", "FAIL", [Code.PLAN_STATE_DIFFERS]), ("plan.collectives", "FAIL", [Code.PLAN_CALLS_DIFFER])]
    unmodelled = summary(collectives=None, payload_check="n/a", payload_reasons=["offload: not modelled"],
                         payload_reason_codes=["plan.payload_not_modelled"])
    part = next(c for c in cell_checks(unmodelled) if c.name == "plan.collectives")
    assert (part.verdict, part.check.codes) == ("n/a", [Code.PLAN_PAYLOAD_NOT_MODELLED])


def test_a_plan_that_raised_before_its_parts_is_one_error():
    raised = copy.deepcopy(SUMMARY)
    raised["plan"] = {"check": "ERROR", "reasons": ["ValueError: no shape"], "time": PLAN["time"]}
    assert [(c.name, c.verdict) for c in cell_checks(raised) if c.name.startswith("plan")] == [
        ("plan", "ERROR"), ("plan.time", "n/a")]
    assert [c.name for c in failed_checks(raised)] == ["plan"]


def test_every_section_check_counts_and_an_equivalence_fail_says_its_numbers():
    s = copy.deepcopy(SUMMARY)
    s["equivalence"].update(check="FAIL", max_abs_err=2.4e-3, threshold_basis="precision",
                            reason_codes=["equivalence.above_bound"])
    s["checkpoint"] = {"check": "FAIL", "reasons": ["continuation differs"],
                       "reason_codes": ["checkpoint.continuation_differs"]}
    s["timing"] = {"check": "n/a", "reason": "too few steps: 2", "reasons": ["too few steps: 2"],
                   "reason_codes": ["schedule.too_few_steps"]}  # a probe not measured: not a failure
    failed = {c.name: c for c in failed_checks(s)}
    assert list(failed) == ["equivalence", "checkpoint"]
    assert failed["checkpoint"].check.codes == [Code.CHECKPOINT_CONTINUATION_DIFFERS]
    assert failed["equivalence"].check.codes == [Code.EQUIVALENCE_ABOVE_BOUND]
    # what a user reads: the report's sentence from the numbers (the probe writes no ``why`` for it), also for a
    # file written before reason codes
    assert failed["equivalence"].texts[0].startswith("max abs err 2.40e-03 > bound 1.00e-05 (precision)")
    del s["equivalence"]["reason_codes"]
    assert failed_checks(s)[0].texts == failed["equivalence"].texts
    assert failed_checks({"status": "ok"}) == failed_checks(None) == []


def test_the_digest_gives_each_plan_part_its_line_and_the_plan_line_the_worst():
    from zeroexp.report.digest import digest

    rows = {name: (found, check) for name, found, check in digest(MEMORY_ERROR)}
    assert list(rows)[-6:] == ["plan", "plan.state", "plan.collectives", "plan.groups", "plan.memory", "plan.time"]
    assert rows["plan.memory"] == ("KeyError: 'backward'", "ERROR")
    assert rows["plan"][1] == "ERROR" and "plan.memory ERROR" in rows["plan"][0]
    assert rows["plan.state"][1] == rows["plan.collectives"][1] == rows["plan.groups"][1] == "PASS"
    assert rows["plan.time"][1] == "n/a" and "no calibration" in rows["plan.time"][0]
    assert {n: c for n, _, c in digest(SUMMARY)}["plan"] == "PASS"  # its parts PASS, its time n/a
    for name, _, check in digest(MEMORY_ERROR):  # each line's check: its own, or the worst of its parts
        parts = [c.verdict for c in cell_checks(MEMORY_ERROR) if c.name == name or c.name.startswith(name + ".")]
        assert check == (worst(parts) if parts else "-"), name


def test_the_digest_names_a_phase_within_a_late_freed_tensor():
    from zeroexp.report.digest import digest

    memory = {"check": "PASS", "max_rel_err": 0.149, "max_rel_err_modelled": 0.0012, "phases": {
        "forward": {"check": "PASS", "rel_err": 0.0},
        "backward": {"check": "PASS", "rel_err": 0.149, "measured_bytes": 934685, "predicted_bytes": 795417,
                     "late_free": "139268 B above the prediction, ..."}}}
    line = dict((n, f) for n, f, _ in digest(summary(memory=memory)))["plan.memory"]
    assert line == ("peak model: largest error 0.12 % (backward 139,268 B above the prediction: within a "
                    "late-freed tensor, plan.memory says which)")
    del memory["max_rel_err_modelled"]  # a summary written before the field: its one figure
    line = dict((n, f) for n, f, _ in digest(summary(memory=memory)))["plan.memory"]
    assert line.startswith("peak model: largest error 14.90 % (backward 139,268 B above")


#: The manifest ``error`` of a cell that did not finish, by its status (docs/results.md).
NOT_FINISHED = {"failed": {"rank": 1, "cause": "exception", "message": "boom"},
                "refused": {"rank": None, "cause": "invalid_config", "key": "strategy.use_orig_params", "value": False,
                            "accepted": "true", "message": "invalid config: ..."},
                "skipped": {"rank": None, "cause": "not_applicable", "key": "offload", "value": "full",
                            "accepted": "none (on this machine)", "message": "not applicable here: ..."}}


def _write_sweep(root: Path, cells: dict[str, dict | str | None]) -> Path:
    """A sweep directory of finished cells (their summaries), failed ones (None) and others by their status."""
    for i, (strategy, s) in enumerate(cells.items()):
        cell = root / f"{strategy}_mlp_fp32_n2_{i:08x}"
        cell.mkdir(parents=True)
        status = "ok" if isinstance(s, dict) else s or "failed"
        manifest = {"schema_version": 2, "status": status, "cell_id": f"{i:08x}",
                    "cell": {"strategy": strategy, "model": "mlp", "world_size": 2}, "cell_name": cell.name,
                    "error": NOT_FINISHED.get(status)}
        (cell / "manifest.json").write_text(json.dumps(manifest))
        if isinstance(s, dict):
            (cell / "summary.json").write_text(json.dumps({"schema_version": 2, **s}))
    return root


def _verdicts(root: Path):
    from zeroexp.results.cells import order_cells
    from zeroexp.report.verdicts import verdicts
    from zeroexp.results.files import load_sweep

    return verdicts(order_cells(load_sweep(root)))


def test_the_sweep_verdicts_count_each_plan_part_and_failures_name_it(tmp_path):
    v = _verdicts(_write_sweep(tmp_path, {"ddp": SUMMARY, "fsdp2_full": MEMORY_ERROR}))
    lines = {line.split(":", 1)[0]: line for line in v.lines}
    assert lines["plan.memory"].startswith("plan.memory: 1 of 2 finished cells PASS") and ", 1 ERROR" in lines[
        "plan.memory"]
    assert lines["plan.state"].startswith("plan.state: 2 of 2 finished cells PASS")
    assert lines["plan.time"].startswith("plan.time: 0 of 2 finished cells PASS") and ", 2 n/a" in lines["plan.time"]
    (failure,) = v.failures  # then the command that explains the cell, every check
    assert failure.startswith("fsdp2_full: plan.memory ERROR: KeyError: 'backward' (every check: `python -m "
                              "zeroexp.explain ") and "fsdp2_full_" in failure and not v.ok


def test_a_plan_that_raised_counts_in_each_of_its_parts_and_is_one_failure(tmp_path):
    raised = copy.deepcopy(SUMMARY)
    raised["plan"] = {"check": "ERROR", "reasons": ["ValueError: no shape"], "time": PLAN["time"]}
    v = _verdicts(_write_sweep(tmp_path, {"ddp": SUMMARY, "zro": raised}))
    for part in ("plan.state", "plan.collectives", "plan.groups", "plan.memory"):
        assert next(line for line in v.lines if line.startswith(f"{part}:")).endswith("1 ERROR."), part
    (failure,) = v.failures
    assert failure.startswith("zro: plan ERROR: ValueError: no shape (every check: `python -m zeroexp.explain ")


@pytest.mark.parametrize("cells, code", [
    ({"ddp": SUMMARY}, 0), ({"ddp": SUMMARY, "fsdp2_full": MEMORY_ERROR}, 3),
    ({"ddp": None, "fsdp2_full": MEMORY_ERROR}, 1),
    ({"ddp": SUMMARY, "fsdp_full": "refused"}, 2), ({"ddp": SUMMARY, "fsdp_full": "skipped"}, 0),
    ({"zro": "skipped", "fsdp_full": "refused"}, 2), ({"fsdp2_full": MEMORY_ERROR, "fsdp_full": "refused"}, 3),
    ({"ddp": None, "fsdp_full": "refused"}, 1)])
def test_a_sweeps_exit_code_is_1_for_a_cell_that_failed_else_3_for_a_failed_check_else_2_for_a_refused_job(
        cells, code, tmp_path, monkeypatch, capsys):
    import zeroexp.report as report
    from zeroexp.cli.sweep import end_sweep

    monkeypatch.setattr(report, "report_after_sweep", lambda sweep_dir: True)  # the report has its own tests
    monkeypatch.setenv("COLUMNS", "200")  # rich's table: no cell wrapped
    assert end_sweep(_write_sweep(tmp_path / "sweep", cells)) == code
    out = capsys.readouterr().out
    assert ("plan.memory ERROR" in out) == ("fsdp2_full" in cells)  # the end's table names the failed check
    statuses = [s if isinstance(s, str) else "ok" if s else "failed" for s in cells.values()]
    assert all(f"{statuses.count(s)} {s}" in out for s in statuses)  # its caption counts the cells by status


def test_the_sweep_exit_code_rule():
    from zeroexp.cli.sweep import sweep_exit_code

    assert sweep_exit_code(["ok", "skipped"], checks_failed=False) == 0  # not applicable here: no error
    assert sweep_exit_code(["ok", "refused", "skipped"], checks_failed=False) == 2
    assert sweep_exit_code(["ok", "refused"], checks_failed=True) == 3
    assert sweep_exit_code(["failed", "refused"], checks_failed=True) == 1
    assert sweep_exit_code(["ok"], checks_failed=False, reported=False) == 1
    assert sweep_exit_code(["refused"], checks_failed=False, stopped=True) == 1


def test_the_report_lists_a_refused_cell_with_its_key_and_counts_it(tmp_path):
    from zeroexp.report import build_report

    report = build_report(_write_sweep(tmp_path, {"ddp": SUMMARY, "fsdp_full": "refused", "zro": "skipped"}))
    assert report.verdicts.lines[0] == "Cells: 3, 1 finished, 0 failed, 1 refused, 1 skipped."
    (failures,) = [t for t in report.tables if t.key == "failures"]
    rows = failures.raw.set_index("status")
    assert rows.loc["refused", "error.cause"] == "invalid_config"
    assert rows.loc["refused", "error.key"] == "strategy.use_orig_params"
    assert rows.loc["skipped", "error.cause"] == "not_applicable" and "refused cell" in failures.note
    assert "fsdp_full: cell refused: (invalid_config) invalid config: ..." in report.verdicts.failures


def test_an_exception_at_the_end_of_a_sweep_stops_it_with_its_message(monkeypatch, capsys):
    from omegaconf import OmegaConf

    import zeroexp.cli.sweep as sweep

    def broken(sweep_dir):
        raise KeyError("status")

    monkeypatch.setattr(sweep, "end_sweep", broken)
    with pytest.raises(SystemExit) as e:
        sweep.SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": "nowhere"}}}))
    assert e.value.code == 1 and isinstance(e.value, sweep.AppExit)
    assert "error: zeroexp's end of the sweep raised KeyError: 'status'" in capsys.readouterr().err
