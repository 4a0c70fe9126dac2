"""``recommend.verify``: the mapping of a recommendation to a cell here, the DDP baseline, the order over the pairs
whose measured medians are separated beyond their CIs (exact, on given data), the table, and the refusals of its
keys before any work. The run itself: tests/test_recommend_verify_run.py."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from zeroexp.cli.verify import plan_cells, render, settings
from zeroexp.errors import ConfigError
from zeroexp.recommend.verify import MappingRefused, baseline, cell_record, map_overrides, pair_order
from test_recommend import _compose

REC = ["strategy=fsdp", "strategy.sharding_strategy=FULL_SHARD", "model=gpt", "model.n_layer=32", "world_size=64",
       "precision=bf16", "offload=optimizer", "activation_checkpointing=full", "batch_size=4", "grad_accum=2",
       "prefetch=post"]


def _cell(name, predicted, median, ci):
    return {"cell": name, "predicted_step_ms": predicted, "measured_median_ms": median, "median_ci95_ms": ci}


def test_the_order_over_separable_pairs_exactly():
    cells = [_cell("a", 10.0, 10.0, [9.0, 11.0]),    # a < c, a < d separable; a ~ b overlap
             _cell("b", 12.0, 11.5, [10.5, 12.5]),   # b < d separable; b ~ c overlap
             _cell("c", 30.0, 13.0, [12.0, 14.0]),   # c < d and c < e separable, predicted the other way: flipped
             _cell("d", 20.0, 20.0, [19.0, 21.0]),
             _cell("e", 20.0, 40.0, [39.0, 41.0]),   # predicted equal to d: d < e separable, a tie orders neither
             _cell("f", None, 5.0, [4.0, 6.0])]      # no prediction: not compared
    got = pair_order(cells)
    assert got["pairs_compared"] == 10
    assert got["pairs_separable"] == sorted(["a < c", "a < d", "a < e", "b < d", "b < e", "c < d", "c < e", "d < e"])
    assert got["pairs_flipped"] == ["c < d", "c < e"] and got["pairs_tied"] == ["d < e"]
    # 5 concordant, 2 discordant (c < d, c < e), 1 predicted tie (d < e) over 8 separable pairs
    assert got["kendall_tau"] == (5 - 2) / 8
    # within 25 %: g (11) ties a (10) and b (12), d ties e; g is measured slower than a, b, c, d and faster than e
    loose = pair_order(cells + [_cell("g", 11.0, 30.0, [29.0, 31.0])], tie=0.25)
    assert len(loose["pairs_separable"]) == 13
    assert loose["pairs_tied"] == ["a < g", "b < g", "d < e"]
    assert loose["pairs_flipped"] == ["c < d", "c < e", "c < g", "d < g"]
    assert loose["kendall_tau"] == (6 - 4) / 13  # concordant: a < c, a < d, a < e, b < d, b < e, g < e
    assert pair_order(cells[:2]) == {"pairs_compared": 1, "pairs_separable": [], "pairs_tied": [],
                                     "pairs_flipped": [], "tie_tolerance": 0.0, "kendall_tau": None}
    agree = pair_order([_cell("x", 1.0, 1.0, [0.9, 1.1]), _cell("y", 2.0, 3.0, [2.9, 3.1])])
    assert agree["pairs_separable"] == ["x < y"] and agree["pairs_flipped"] == [] and agree["kendall_tau"] == 1.0


def test_a_recommendation_mapped_to_this_machine_and_its_baseline():
    assert map_overrides(REC, 2) == [o if o != "world_size=64" else "world_size=2" for o in REC]
    small = map_overrides(REC, 3, ["model=gpt", "model.n_layer=2"], batch_size=1)
    assert small == ["strategy=fsdp", "strategy.sharding_strategy=FULL_SHARD", "model=gpt", "model.n_layer=2",
                     "world_size=3", "precision=bf16", "offload=optimizer", "activation_checkpointing=full",
                     "batch_size=1", "grad_accum=2", "prefetch=post"]
    hybrid = ["strategy=fsdp", "world_size=64", "strategy.shard_size=8"]
    assert map_overrides(hybrid, 16) == ["strategy=fsdp", "world_size=16", "strategy.shard_size=8"]
    for n in (2, 8, 12):
        with pytest.raises(MappingRefused, match="shard_size=8"):
            map_overrides(hybrid, n)
    zero2 = ["strategy=zero2", "world_size=2", "strategy.bucket_cap_mb=100", "strategy.reduce=allreduce"]
    assert baseline(zero2) == ["strategy=ddp", "world_size=2", "strategy.bucket_cap_mb=100"]  # a key DDP has: kept
    ds = ["strategy=deepspeed", "strategy.stage=0", "world_size=2", "strategy.bucket_cap_mb=25"]
    assert baseline(ds) == ["strategy=ddp", "world_size=2", "strategy.bucket_cap_mb=25"]
    assert baseline(REC) == ["strategy=ddp", "model=gpt", "model.n_layer=32", "world_size=64", "precision=bf16",
                             "offload=none", "activation_checkpointing=full", "batch_size=4", "grad_accum=2"]


def test_the_cells_planned_a_refused_one_kept_with_why_and_a_baseline_once(tmp_path):
    from zeroexp.cli.verify import Settings

    s = Settings(3, 2, None, 20, None, tmp_path)
    recs = [{"config": "fsdp", "overrides": REC}, {"config": "hsdp", "overrides": REC + ["strategy.shard_size=4"]},
            {"config": "ddp", "overrides": map_overrides(baseline(REC), 64)}]
    cells = plan_cells(recs, s)
    assert [c["label"] for c in cells] == ["#1 fsdp", "#2 hsdp", "#3 ddp"]  # #3 is the baseline: not run twice
    assert cells[1]["overrides"] is None and "shard_size=4" in cells[1]["why"]
    ddp = ["strategy=ddp", "world_size=64", "batch_size=4", "strategy.bucket_cap_mb=25"]
    assert [c["label"] for c in plan_cells([{"config": "ddp", "overrides": ddp}], s)] == ["#1 ddp"]
    cells = plan_cells(recs[:1], s)
    assert [c["label"] for c in cells] == ["#1 fsdp", "baseline ddp"]
    assert cells[1]["overrides"] == map_overrides(baseline(REC), 2)


def test_a_cell_record_reads_the_summary_and_the_table_shows_planned_beside_measured(tmp_path):
    summary = {"plan": {"time": {"predicted_step_ms": 21.0, "measured_median_ms": 20.0, "median_ci95_ms": [19, 22],
                                 "check": "PASS"},
                        "memory": {"check": "PASS", "phases": {
                            "steady": {"measured_bytes": 100},
                            "forward": {"predicted_peak_bytes": 300, "measured_peak_bytes": 310},
                            "backward": {"predicted_peak_bytes": 500, "measured_peak_bytes": 520}}}},
               "memory": {"peak_bytes_max": 520}}
    rec = cell_record("#1 x", {"step_ms": 2.5, "peak_bytes": 10}, ["a=b"], tmp_path, summary, "ok")
    assert (rec["recommended_step_ms"], rec["predicted_step_ms"], rec["measured_median_ms"]) == (2.5, 21.0, 20.0)
    assert (rec["predicted_peak_bytes"], rec["measured_peak_bytes"], rec["peak_check"]) == (500, 520, "PASS")
    off = cell_record("#2 y", None, [], None, None, "not run", "no mesh")
    assert off["predicted_step_ms"] is None and off["why"] == "no mesh"
    other = dict(rec, cell="#3 z", predicted_step_ms=10.0, measured_median_ms=40.0, median_ci95_ms=[39, 41],
                 recommended_step_ms=0.0244)  # a small model's step on a GPU preset: shown, not rounded to 0.0
    v = {"world_size": 2, "calibration": "cal.json", "cells": [rec, off, other], "report": "r/report.md",
         "why": None, **pair_order([rec, other], 0.08)}
    out = io.StringIO()
    render(v, Console(file=out, width=100, highlight=False))
    text = " ".join(out.getvalue().split())  # the lines as read, wrapped at 100 columns
    assert "20.0 [19.0, 22.0]" in text and "21.0" in text and "not run: no mesh" in text
    assert "0.024 │ 10.000" in text  # #3 z: its recommended and predicted steps
    assert "1 of 1 pairs separable" in text and "0 ordered as predicted, 0 predicted to tie (within 8 %), 1 flipped" \
        in text and "flipped: #1 x < #3 z" in text and "tau over them -1.00" in text


@pytest.mark.parametrize("override, key", [
    ("recommend.verify=-1", "recommend.verify"), ("recommend.verify=two", "recommend.verify"),
    ("recommend.verify_world_size=1", "recommend.verify_world_size"),
    ("recommend.verify_model=nosuchmodel", "recommend.verify_model"),
    ("recommend.verify_model=['model.n_layer=2']", "recommend.verify_model"),
    ("recommend.verify_steps=3", "recommend.verify_steps"),
    ("recommend.verify_batch_size=0", "recommend.verify_batch_size")])
def test_bad_verify_keys_are_refused_naming_the_key(override, key):
    cfg = _compose("recommend", "model=gpt", "world_size=2", "network=a100_ib", "recommend.verify=2", override)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        settings(cfg)


def test_verify_settings(tmp_path):
    assert settings(_compose("recommend", "model=gpt", "world_size=2", "network=a100_ib")) is None
    s = settings(_compose("recommend", "model=gpt", "world_size=2", "network=a100_ib", "recommend.verify=3",
                          "recommend.verify_model=['model=gpt','model.n_layer=2']", f"recommend.verify_dir={tmp_path}"))
    assert (s.k, s.world_size, s.model, s.steps, s.out_dir) == (3, 2, ["model=gpt", "model.n_layer=2"], 20, tmp_path)


def test_the_cells_calibration_is_one_of_their_model_or_made_on_it(tmp_path, monkeypatch):
    """Reused only when its compute was timed on the cells' model (``compute.model_config``); else made on that
    model and micro-batch."""
    import json
    import subprocess
    from types import SimpleNamespace

    from test_time import calibration_data
    from zeroexp.cli import verify as v
    from zeroexp.results.calibration import machine

    cell = ["strategy=ddp", "model=gpt", "model.n_embd=128", "model.seq_len=64", "world_size=2", "batch_size=4"]
    items, config = v._model_of(cell)
    assert items == ["model=gpt", "model.n_embd=128", "model.seq_len=64", "batch_size=4"]
    assert (config["name"], config["n_embd"], config["seq_len"], config["input_shape"]) == ("gpt", 128, 64, [64])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZEROEXP_CALIBRATION_DIR")  # the default directory (the suite points it elsewhere)
    (tmp_path / "outputs" / "calibration").mkdir(parents=True)
    mlp = calibration_data(machine_id=machine()["id"], created="2026-01-02")
    mlp["compute"]["model_config"] = {"name": "mlp", "width": 768}
    (tmp_path / "outputs" / "calibration" / "mlp.json").write_text(json.dumps(mlp))
    ran = []

    def fake_run(args, **kw):
        ran.append(args)
        return SimpleNamespace(returncode=0, stdout=f"...\n{tmp_path / 'made.json'}\n")
    monkeypatch.setattr(subprocess, "run", fake_run)
    s = v.Settings(2, 2, None, 20, None, tmp_path / "verify")
    cfg = _compose("recommend", "model=gpt", "world_size=2", "network=a100_ib")
    assert v.calibration_for(cfg, s, [cell], lambda _: None) == str(tmp_path / "made.json")  # the MLP's: not reused
    assert ran[0][1:] == ["-m", "zeroexp.calibrate", "world_size=2", *items, f"output_dir={s.out_dir / 'calibration'}"]
    gpt = calibration_data(machine_id=machine()["id"], created="2026-01-01", model="gpt")
    gpt["compute"]["model_config"] = {**config, "n_layer": 4}  # every key of the cells' model equal, and more
    (tmp_path / "outputs" / "calibration" / "gpt.json").write_text(json.dumps(gpt))  # timed at batch 8
    assert v.calibration_for(cfg, s, [cell], lambda _: None) == str(tmp_path / "made.json")  # the cells' is 4
    assert len(ran) == 2
    gpt["compute"]["batch_size"] = 4
    (tmp_path / "outputs" / "calibration" / "gpt.json").write_text(json.dumps(gpt))
    assert v.calibration_for(cfg, s, [cell], lambda _: None) == str(tmp_path / "outputs" / "calibration" / "gpt.json")
    assert len(ran) == 2
    two = [cell, [*cell[:-1], "batch_size=8"]]  # cells at micro-batches 4 and 8: timed at one size, it times neither
    assert v.calibration_for(cfg, s, two, lambda _: None) == str(tmp_path / "made.json")
    assert ran[-1][-2] == "batch_size=8" and len(ran) == 3  # made at the largest, fitted down to a quarter of it
    gpt["compute"]["fit"] = {p: "a call's cost + per sample, over micro-batches 1 and 4" for p in ("forward",
                                                                                                  "backward")}
    (tmp_path / "outputs" / "calibration" / "gpt.json").write_text(json.dumps(gpt))  # fitted: any micro-batch
    assert v.calibration_for(cfg, s, two, lambda _: None) == str(tmp_path / "outputs" / "calibration" / "gpt.json")
    gpt["compute"]["fit"]["backward"] = "no call cost (micro-batches 1 and 4 fit none: timing noise above it)"
    (tmp_path / "outputs" / "calibration" / "gpt.json").write_text(json.dumps(gpt))
    assert v.calibration_for(cfg, s, two, lambda _: None) == str(tmp_path / "made.json")
    del gpt["compute"]["fit"]
    ran[2:] = []
    named = _compose("recommend", "model=gpt", "world_size=2", "network=this_machine",
                     f"network.calibration={tmp_path / 'outputs' / 'calibration' / 'mlp.json'}")
    assert v.calibration_for(named, s, [cell], lambda _: None) == str(tmp_path / "outputs" / "calibration" / "mlp.json")
    assert len(ran) == 2  # a calibration named is the user's choice, of whatever model
    (tmp_path / "outputs" / "calibration" / "gpt.json").unlink()
    (s.out_dir / "calibration").mkdir(parents=True)  # the verify resumed: the one it made is reused, not made again
    (s.out_dir / "calibration" / "made.json").write_text(json.dumps(gpt))
    assert v.calibration_for(cfg, s, [cell], lambda _: None) == str(s.out_dir / "calibration" / "made.json")
    assert len(ran) == 2


def test_a_cells_rounds_are_one_record_judged_on_the_hull_of_their_cis(tmp_path):
    """Run twice, a cell is measured at the median of its runs' medians and separated from another only where the
    hulls of their runs' 95 % CIs are apart: on this host a second run of a cell lands outside the first's CI (DDP
    48.9 [46.8, 50.6] ms, then 38.5 [37.3, 40.0] minutes later)."""
    from zeroexp.recommend.verify import combine_rounds

    def run(name, pred, median, ci, status="ok"):
        summary = {"plan": {"time": {"predicted_step_ms": pred, "measured_median_ms": median, "median_ci95_ms": ci}}}
        return cell_record(name, None, ["a=b"], tmp_path / name, summary, status, None if status == "ok" else "x")

    ddp = combine_rounds([run("ddp", 31.5, 48.9, [46.8, 50.6]), run("ddp", 31.5, 38.5, [37.3, 40.0])])
    assert ddp["measured_median_ms"] == pytest.approx((48.9 + 38.5) / 2) and ddp["median_ci95_ms"] == [37.3, 50.6]
    assert [r["measured_median_ms"] for r in ddp["rounds"]] == [48.9, 38.5] and ddp["dir"] == str(tmp_path / "ddp")
    ds = combine_rounds([run("ds", 32.8, 51.1, [42.0, 54.8]), run("ds", 32.8, 41.0, [40.1, 42.0])])
    slow = combine_rounds([run("slow", 60.0, 70.0, [68.0, 72.0]), run("slow", 60.0, 66.0, [64.0, 69.0])])
    order = pair_order([ddp, ds, slow], tie=0.08)
    assert order["pairs_separable"] == ["ddp < slow", "ds < slow"]  # ddp and ds overlap once their runs are joined
    assert order["pairs_flipped"] == [] and order["kendall_tau"] == 1.0
    one = combine_rounds([run("one", 10.0, 20.0, [19.0, 21.0])])  # one round: its own record
    assert (one["measured_median_ms"], one["median_ci95_ms"], len(one["rounds"])) == (20.0, [19.0, 21.0], 1)
    failed = combine_rounds([run("f", 10.0, 20.0, [19.0, 21.0]), run("f", 10.0, None, None, "failed")])
    assert failed["status"] == "failed" and failed["why"] == "x"
    assert pair_order([failed, slow])["pairs_compared"] == 1  # a failed round: the cell is out of the order


def test_verify_rounds_is_an_integer_of_at_least_one(tmp_path):
    base = ("recommend", "model=gpt", "world_size=2", "network=a100_ib", "recommend.verify=2",
            f"recommend.verify_dir={tmp_path}")
    assert settings(_compose(*base)).rounds == 2
    assert settings(_compose(*base, "recommend.verify_rounds=1")).rounds == 1
    for bad in ("0", "1.5", "two"):
        with pytest.raises(ConfigError) as e:
            settings(_compose(*base, f"recommend.verify_rounds={bad}"))
        assert e.value.key == "recommend.verify_rounds"


def test_verify_runs_every_cell_once_a_round_into_its_own_directory_and_resumes(tmp_path, monkeypatch):
    import json
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace

    import zeroexp.report
    from zeroexp.cli import verify as v

    ran = []

    def fake_run(args, **kw):  # python -m zeroexp ... hydra.run.dir=D: the cell's files, its median the run's count
        d = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        d.mkdir(parents=True)
        ran.append(d)
        (d / "manifest.json").write_text(json.dumps({"status": "ok"}))
        n = float(len(ran))
        (d / "summary.json").write_text(json.dumps({"plan": {"time": {
            "predicted_step_ms": 1.0, "measured_median_ms": n, "median_ci95_ms": [n - 0.1, n + 0.1]}}}))
        return SimpleNamespace(returncode=0)
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(v, "calibration_for", lambda *a: "cal.json")
    monkeypatch.setattr(zeroexp.report, "write_report", lambda *a, **k: None)
    s = v.Settings(1, 2, None, 20, None, tmp_path, rounds=2)
    answer = {"recommendations": [{"config": "ddp", "overrides": ["strategy=ddp", "world_size=64", "batch_size=4"],
                                   "step_ms": 1.0, "peak_bytes": 1}], "tie_tolerance": 0.08}
    out = v.verify(None, answer, s, lambda _: None)
    assert ran == [tmp_path / "00", tmp_path / "rounds" / "2" / "00"]  # the baseline is #1 itself: one cell
    assert (tmp_path / "logs" / "00.txt").is_file() and (tmp_path / "logs" / "00.r2.txt").is_file()
    (cell,) = out["cells"]
    assert out["rounds"] == 2 and [r["dir"] for r in cell["rounds"]] == [str(d) for d in ran]
    assert cell["measured_median_ms"] == 1.5 and cell["median_ci95_ms"] == [0.9, 2.1]
    again = v.verify(None, answer, s, lambda _: None)  # resumed: every round's cell is ok already
    assert len(ran) == 2 and again["cells"][0]["measured_median_ms"] == 1.5
