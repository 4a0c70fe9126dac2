"""``recommend.verify`` end to end: a tiny GPT at N=2 on a given calibration of this machine, the top 2 and the DDP
baseline run as cells (fresh interpreters), planned beside measured, the order, the sweep report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_time import calibration_data
from zeroexp.results.calibration import machine

ROOT = Path(__file__).resolve().parents[1]


def test_verify_runs_the_top_two_and_a_ddp_baseline_and_orders_them(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(calibration_data(machine_id=machine()["id"], numel=8 * 64 * 64)))
    out = tmp_path / "verify"
    # ``python -m zeroexp.recommend`` through its entry point in this process (conftest.run_cli: an interpreter's
    # imports spared); the cells it verifies are fresh interpreters still (zeroexp.cli.verify), and a fresh
    # ``python -m zeroexp.recommend`` is run by tests/test_recommend.py
    args = ["model=gpt", "model.n_layer=2", "world_size=2",
            "network=this_machine", f"network.calibration={cal}", "device=cpu", "device_memory=8GB",
            "precisions=[fp32]", "global_batch=4", "recommend.strategies=[zero2,fsdp_full]",
            "recommend.activation_checkpointing=[none]", "recommend.micro_batches=[2]", "recommend.verify=2",
            "recommend.verify_steps=10", "recommend.verify_rounds=1", f"recommend.verify_dir={out}", "format=json"]
    done = run_cli(*args, app="zeroexp.cli.recommend", cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout)
    v, recs = answer["verify"], answer["recommendations"]
    assert f"into {out}" in done.stderr and "python -m zeroexp strategy=" in done.stderr  # said before it ran
    assert [c["cell"] for c in v["cells"]] == [f"#1 {recs[0]['config']}", f"#2 {recs[1]['config']}", "baseline ddp"]
    assert v["calibration"] == str(cal) and v["world_size"] == 2 and v["report"] == str(out / "report.md")
    assert v["rounds"] == 1 and all(len(c["rounds"]) == 1 for c in v["cells"])  # rounds: tests/test_recommend_verify
    assert (out / "report.md").is_file() and len(list(out.glob("*/manifest.json"))) == 3
    for c, rec in zip(v["cells"], recs[:2] + [None]):
        assert c["status"] == "ok" and "world_size=2" in c["overrides"] and f"calibration={cal}" in c["overrides"]
        assert c["predicted_step_ms"] > 0 and c["predicted_peak_bytes"] > 0 and c["measured_peak_bytes"] > 0
        summary = json.loads((Path(c["dir"]) / "summary.json").read_text())
        assert c["measured_peak_bytes"] == summary["memory"]["peak_bytes_max"]
        assert c["measured_median_ms"] == summary["plan"]["time"]["measured_median_ms"]
        if rec is not None:  # the same calibration, the same N and model: the recommender's step is the cell's
            assert c["recommended_step_ms"] == rec["step_ms"]
            assert c["predicted_step_ms"] == pytest.approx(rec["step_ms"], rel=1e-9)
    assert set(v["pairs_flipped"]) | set(v["pairs_tied"]) <= set(v["pairs_separable"])
    assert (v["kendall_tau"] is None) == (not v["pairs_separable"]) and v["pairs_compared"] <= 3
