"""``format=html`` of plan and recommend (zeroexp.report.plan_picture): every drawn number read back from the page's
data attributes equals the record's field it names (or the difference of the two it names); a row's memory
segments add up to ``fits_bytes``, its step's to ``step_ms``; a CPU row draws no NCCL or CUDA context; a format
neither table, json nor html is refused naming the key. No browser (tests/test_report_browser.py opens the page)."""

from __future__ import annotations

import html
import re

import pytest

from zeroexp.cli.plan import register, run
from zeroexp.errors import ConfigError
from zeroexp.report.plan_picture import answer_page, plan_page

TINY = ["model=gpt", "model.n_layer=2", "model.n_embd=128", "model.seq_len=64", "model.vocab_size=512"]
GPU_PLAN = [*TINY, "world_size=8", "batch_size=2", "network=h100_ib"]
_SECTION = re.compile(r'<section class="row" id="[^"]*" data-key="([^"]*)" data-fits-on="([^"]*)" '
                      r'data-fits-bytes="([^"]*)">(.*?)</section>', re.S)
_SEG = re.compile(r'<rect class="seg" data-bar="(\w+)" data-name="([^"]*)" data-field="([^"]*)" '
                  r'data-(?:bytes|ms)="([^"]*)"')
_LINE = re.compile(r'<line class="limit" data-field="([^"]*)" data-bytes="([^"]*)"')


def _compose(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def _rows(page: str) -> dict[str, dict]:
    """Each row of the page by its key: fits_on, fits_bytes, its segments (bar, name, field, value), its lines."""
    out = {}
    for key, on, judged, body in _SECTION.findall(page):
        segs = [(bar, html.unescape(name), html.unescape(field), float(value))
                for bar, name, field, value in _SEG.findall(body)]
        out[html.unescape(key)] = {"fits_on": on, "fits_bytes": int(judged), "segments": segs,
                                   "lines": {f: float(v) for f, v in _LINE.findall(body)},
                                   "tokens": re.findall(r'data-tokens-per-s="([^"]*)"', body)}
    return out


def _field(record: dict, expr: str) -> float:
    """The field ``expr`` names, or ``a - b - ...`` of the fields it names, on ``record``."""
    first, *rest = expr.split(" - ")
    value = record[first]
    for name in rest:
        value -= record[name]
    return value


def _check_row(record: dict, row: dict) -> None:
    memory = [s for s in row["segments"] if s[0] == "memory"]
    step = [s for s in row["segments"] if s[0] == "step"]
    assert row["fits_on"] == record["fits_on"] and row["fits_bytes"] == record["fits_bytes"]
    for _, name, field, value in row["segments"]:
        assert value == _field(record, field) and value > 0, (name, field, value)
    assert sum(v for *_, v in memory) == record["fits_bytes"], (record["fits_on"], memory)
    for field in ("usable_memory_bytes", "device_memory_bytes"):
        assert row["lines"].get(field) == (None if record[field] is None else float(record[field]))
    if record.get("step_ms") is not None:
        assert sum(v for *_, v in step) == pytest.approx(record["step_ms"], rel=1e-12)
        assert [s[1] for s in step if s[1] != "recompute"] == ["compute", "exposed communication"]
        assert [float(t) for t in row["tokens"]] == [t for t in [record.get("tokens_per_s")] if t is not None]
    else:
        assert step == []


def test_each_gpu_row_draws_its_fields_and_adds_up_to_what_fits_is_judged_on():
    records, notes = run(_compose("plan", *GPU_PLAN))
    rows = _rows(plan_page(records, notes))
    assert len(rows) == len(records) == 16
    for r in records:
        row = rows[f"{r['strategy']}@{r['world_size']}"]
        _check_row(r, row)
        fields = [s[2] for s in row["segments"]]
        assert "nccl_bytes" in fields and "context_bytes" in fields  # a GPU row: both beside the allocator's
        if r["fits_on"] == "device":
            assert "reserved_peak_bytes - peak_bytes" in fields and r["device_total_bytes"] == r["fits_bytes"]
    # the paper's rows have no peak model: state + activations, and the page says why
    assert {r["fits_on"] for r in records} == {"device", "state+activations"}
    page = plan_page(records, notes)
    assert page.count("no peak model: ") == sum(r["peak_bytes"] is None for r in records) == 4
    assert "src=" not in page and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")  # self-contained: nothing fetched, no script


def test_a_cpu_row_draws_no_nccl_or_context():
    records, notes = run(_compose("plan", *TINY, "world_size=4", "batch_size=2", "strategies=[ddp,fsdp_full]",
                                  "device_memory=1GB", "device=cpu"))
    rows = _rows(plan_page(records, notes))
    for r in records:
        row = rows[f"{r['strategy']}@{r['world_size']}"]
        _check_row(r, row)
        assert r["fits_on"] == "peak"
        fields = {s[2] for s in row["segments"]}
        assert not fields & {"nccl_bytes", "context_bytes", "reserved_peak_bytes - peak_bytes"}, fields


def test_the_recommendations_draw_their_fields():
    from zeroexp.cli.recommend import register as register_recommend, run as recommend

    register_recommend()
    answer = recommend(_compose("recommend", *TINY, "world_size=8", "network=h100_ib", "precisions=[fp32]",
                                "recommend.strategies=[ddp,fsdp_full]", "recommend.activation_checkpointing=[none]",
                                "recommend.top_k=2", "recommend.bucket_cap_mb=[25]", "recommend.prefetch=[pre]"))
    rows = _rows(answer_page(answer))
    assert len(answer["recommendations"]) == 2
    for i, rec in enumerate(answer["recommendations"], 1):
        _check_row(rec, rows[f"rec{i}"])
        assert rec["fits_on"] == "device"


def test_the_nearest_changes_draw_their_fields_when_nothing_fits():
    from zeroexp.cli.recommend import register as register_recommend, run as recommend

    register_recommend()
    answer = recommend(_compose("recommend", "params=70B", "world_size=8", "network=h100_ib", "device_memory=80GB"))
    rows = _rows(answer_page(answer))
    assert answer["recommendations"] == [] and len(answer["nearest_changes"]) == len(rows) >= 2
    for i, change in enumerate(answer["nearest_changes"], 1):
        _check_row(change, rows[f"change{i}"])
        assert change["fits_on"] == "state"  # a parameter count: its state, the gather floor and workspace


@pytest.mark.parametrize("name", ["plan", "recommend"])
def test_a_format_not_drawn_is_refused_naming_the_key(name):
    from zeroexp.cli.recommend import register as register_recommend, run as recommend

    register_recommend()
    cfg = _compose(name, *TINY, "world_size=8", "network=h100_ib", "format=svg")
    with pytest.raises(ConfigError) as e:
        (run if name == "plan" else recommend)(cfg)
    assert (e.value.key, e.value.value, e.value.accepted) == ("format", "svg", "table, json, html")
