"""Sweep reports: files, self-contained HTML, numbers equal to the cells' summaries, failures, W&B runs.

One real sweep (ddp, zro, fsdp_grad_op, fsdp_full x pre/post/none at N=2, logger=wandb offline) runs once per
session through the CLI's entry point (conftest.ladder_sweep); a second, two-cell sweep has one cell failing
on purpose (conftest.failed_sweep, shared with tests/test_report_browser.py). The robustness tests edit copies of
finished cells, so they cost no run.
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from zeroexp.report import build_report, write_report
from zeroexp.report.__main__ import main as report_main
from zeroexp.results.format import NA
from zeroexp.results.files import load_sweep, read_json
from zeroexp.results.wandb_offline import iter_records, read_run

LADDER_LABELS = ["ddp", "zro", "fsdp_grad_op", "fsdp_full-pre", "fsdp_full-post", "fsdp_full-none"]
PLOTS = ["report_state_bytes.png", "report_memory.png", "report_peak_model.png", "report_step_times.png",
         "report_collectives.png"]


@pytest.fixture(scope="module")
def sweep(ladder_sweep) -> Path:
    """The session's ladder sweep (conftest.LADDER_SWEEP), which other modules assert on too."""
    sweep_dir, proc = ladder_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(sweep_dir)
    return sweep_dir


def cell_dirs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/manifest.json"))


def run_file(run_parent: Path) -> Path:
    (path,) = run_parent.glob("wandb/offline-run-*/run-*.wandb")
    return path


def test_sweep_writes_every_report_file(sweep):
    for name in ["report.md", "report.html", "report.csv", "report.parquet", *PLOTS]:
        assert (sweep / name).stat().st_size > 0, name
    for name in PLOTS:
        assert (sweep / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(cell_dirs(sweep)) == 6
    assert not (sweep / "report.error.txt").exists()


def test_html_is_self_contained_and_holds_every_cell(sweep):
    text = (sweep / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"url\(\s*['\"]?\s*(https?:)?//|@import|<script|<link", text, re.I)
    assert text.count('src="data:image/png;base64,') == len(PLOTS)
    for cell in cell_dirs(sweep):
        assert cell.name in text


def test_cells_in_ladder_order_and_loaded_back(sweep):
    frame = load_sweep(sweep)
    assert len(frame) == 6 and set(frame.status) == {"ok"}
    report = build_report(sweep)
    assert list(report.cells.label) == LADDER_LABELS
    assert list(report.table("state").raw.label) == LADDER_LABELS
    csv = pd.read_csv(sweep / "report.csv")
    assert list(csv.label) == LADDER_LABELS
    assert list(pd.read_parquet(sweep / "report.parquet").cell_name) == list(csv.cell_name)


def test_table_numbers_equal_the_cells_summaries(sweep):
    report = build_report(sweep)
    csv = pd.read_csv(sweep / "report.csv").set_index("cell_name")
    tables = {t.key: t.raw.set_index("cell_name") for t in report.tables}
    ops = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
    for cell in cell_dirs(sweep):
        s = read_json(cell / "summary.json")
        for kind in ("param", "grad", "optim"):
            assert tables["state"].at[cell.name, f"state.factors.{kind}"] == s["state"]["factors"][kind]
            assert tables["state"].at[cell.name, f"state.max_rank_bytes.{kind}"] == s["state"]["max_rank_bytes"][kind]
            assert tables["state"].at[cell.name, f"state.expected.{kind}"] == s["state"]["expected"][kind]
        for key in ("steady_bytes_max", "peak_bytes_max", "peak_minus_steady_max"):
            assert tables["memory"].at[cell.name, f"memory.{key}"] == s["memory"][key]
        c = s["collectives"]
        for op in ops:
            assert tables["collectives"].at[cell.name, f"collectives.counts.{op}"] == c["counts"].get(op, 0)
            assert (tables["collectives"].at[cell.name, f"collectives.payload_bytes.{op}"]
                    == c["payload_bytes"].get(op, 0))
        for key in ("median_ms", "p95_ms", "cv", "unstable"):
            assert tables["timing"].at[cell.name, f"timing.{key}"] == s["timing"][key]
        assert tables["equivalence"].at[cell.name, "equivalence.max_abs_err"] == s["equivalence"]["max_abs_err"]
        for kind, planned in s.get("plan", {}).get("predicted_bytes", {}).items():  # once the planner is there
            assert tables["plan"].at[cell.name, f"plan.predicted_bytes.{kind}"] == planned
            assert tables["plan"].at[cell.name, f"plan.measured_bytes.{kind}"] == s["plan"]["measured_bytes"][kind]
        for section in ("state", "collectives", "equivalence"):
            assert tables[section].at[cell.name, f"{section}.check"] == s[section]["check"]
        # the joined rows for pandas users carry the same numbers
        assert csv.at[cell.name, "state.factors.optim"] == pytest.approx(s["state"]["factors"]["optim"], rel=1e-15)
        assert csv.at[cell.name, "timing.median_ms"] == pytest.approx(s["timing"]["median_ms"], rel=1e-15)
        assert csv.at[cell.name, "memory.peak_bytes_max"] == s["memory"]["peak_bytes_max"]
        assert json.loads(csv.at[cell.name, "timing.step_ms"]) == s["timing"]["step_ms"]


def test_markdown_html_and_verdicts_show_the_same_table_strings(sweep):
    report = build_report(sweep)
    md = (sweep / "report.md").read_text(encoding="utf-8")
    html_text = (sweep / "report.html").read_text(encoding="utf-8")
    for table in report.tables:
        shown = table.display()
        for row in shown.itertuples(index=False):
            assert "| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" in md, (table.key, row)
            assert all(html.escape(v) in html_text for v in row if v and v != NA), (table.key, row)
    summaries = [read_json(c / "summary.json") for c in cell_dirs(sweep)]
    for section in ("state", "collectives", "equivalence"):
        passed = sum(s[section]["check"] == "PASS" for s in summaries)
        assert f"{section}: {passed} of 6 finished cells PASS" in md
    unstable = sum(s["timing"]["unstable"] for s in summaries)
    if unstable:  # unstable timings are trends: a ratio only between two stable cells (the report's note)
        assert "trends, not ratios" in md
        timing = report.table("timing").display()
        stable = dict(zip(timing.iloc[:, -1], timing["stability"] == "stable"))
        for ratio, ok in zip(timing.iloc[:, -1], timing["stability"] == "stable"):
            words = ("≈ (within noise)", "slower (trend)", "faster (trend)")
            assert (ratio.endswith("×") and ok and stable["baseline"]) or ratio == "baseline" or ratio in words, timing
            assert ok or ratio in ("baseline", *words), timing  # an unstable cell: never a ratio


def test_cell_runs_carry_summary_and_per_rank_tables(sweep):
    for cell in cell_dirs(sweep):
        summary = read_json(cell / "summary.json")
        run = read_run(run_file(cell))
        assert run["run"]["job_type"] == "cell" and run["run"]["group"] == sweep.name
        assert run["summary"]["state/factors/param"] == summary["state"]["factors"]["param"]
        assert run["summary"]["collectives/check"] == summary["collectives"]["check"]
        for name in ("rank_state", "collectives"):
            assert run["summary"][f"tables/{name}/_type"] == "table-file"
            table = json.loads((run_file(cell).parent / "files" / run["summary"][f"tables/{name}/path"]).read_text())
            expected = pd.read_csv(cell / f"{name}.csv")
            assert table["columns"] == list(expected.columns)
            assert len(table["data"]) == len(expected)
            assert [row[:2] for row in table["data"]] == expected.iloc[:, :2].values.tolist()


def test_sweep_run_holds_report_tables_plots_and_html_artifact(sweep):
    path = run_file(sweep)
    run = read_run(path)
    assert run["run"]["job_type"] == "report" and run["run"]["group"] == sweep.name
    assert run["summary"]["all_passed"] in (True, False)
    report = build_report(sweep)
    for table in report.tables:
        if not len(table.raw):
            continue
        logged = json.loads((path.parent / "files" / run["summary"][f"report/{table.key}/path"]).read_text())
        shown = table.display()
        assert logged["columns"] == list(shown.columns)
        assert logged["data"] == shown.values.tolist()
    for name in PLOTS:
        assert run["summary"][f"plots/{name.removeprefix('report_').removesuffix('.png')}/_type"] == "image-file"
    artifacts = {rec.artifact.type: rec.artifact for rec in iter_records(path)
                 if rec.WhichOneof("record_type") == "artifact"}
    contents = {c.path: c.local_path for c in artifacts["report"].manifest.contents}
    assert {"report.html", "report.md", "report.csv"} <= set(contents)
    # a sweep directory holds everything wandb sync needs: no staged file outside it
    for p in [path, *(run_file(c) for c in cell_dirs(sweep))]:
        for rec in iter_records(p):
            if rec.WhichOneof("record_type") == "artifact":
                for c in rec.artifact.manifest.contents:
                    assert Path(c.local_path).resolve().is_relative_to(sweep.resolve()), c.local_path


def test_failed_cell_is_reported(failed_sweep):
    sweep_dir, proc = failed_sweep
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(sweep_dir)
    md = (sweep_dir / "report.md").read_text(encoding="utf-8")
    assert "zro: cell failed: rank 0 (exception)" in md and "injected fault" in md
    assert "Cells: 2, 1 finished, 1 failed." in md
    report = build_report(sweep_dir)
    assert list(report.table("failures").raw.label) == ["zro"]
    assert list(report.table("state").raw.label) == ["ddp"]
    assert "injected fault" in (sweep_dir / "report.html").read_text(encoding="utf-8")
    assert not (sweep_dir / "wandb").exists()  # logger=none: no sweep run


def _edit_summary(cell: Path, edit) -> None:
    path = cell / "summary.json"
    summary = read_json(path)
    edit(summary)
    path.write_text(json.dumps(summary))


def test_missing_sections_unknown_strategy_and_plan(sweep, tmp_path):
    """A future strategy without some probe sections, and a plan section, still report (n/a, never a crash)."""
    fake = tmp_path / "sweep"
    fake.mkdir()
    cells = cell_dirs(sweep)
    for cell in cells[:2]:
        shutil.copytree(cell, fake / cell.name, ignore=shutil.ignore_patterns("wandb"))
    newcomer = fake / "zero9_mlp_fp32_n2_00000000"
    shutil.copytree(cells[0], newcomer, ignore=shutil.ignore_patterns("wandb"))
    manifest = read_json(newcomer / "manifest.json")
    manifest["cell"]["strategy"], manifest["cell_id"], manifest["cell_name"] = "zero9", "00000000", newcomer.name
    (newcomer / "manifest.json").write_text(json.dumps(manifest))
    (newcomer / "rank_state.csv").unlink()

    def strip(s):
        for section in ("state", "equivalence", "collectives"):
            s.pop(section)
        s["plan"] = {"predicted_bytes": {"param": 131072}, "measured_bytes": {"param": 131088},
                     "difference_bytes": {"param": 16}, "check": "FAIL", "reasons": ["rank 0 param: 16 B more"]}

    _edit_summary(newcomer, strip)
    assert report_main([str(fake), "--wandb", "none"]) == 0
    report = build_report(fake)
    assert report.cells.label.iloc[-1] == "zero9"  # after the ladder
    state = report.table("state").display().set_index("cell")
    assert state.loc["zero9", "check"] == NA and state.loc["zero9", "param ×P"] == NA
    assert report.table("collectives").display().set_index("cell").loc["zero9", "check"] == NA
    plan = report.table("plan").display().set_index("cell")
    assert plan.loc["zero9", "param P / M MiB"] == "0.1250 / 0.1250 (Δ +16 B)"
    md = (fake / "report.md").read_text(encoding="utf-8")
    assert "n/a (no state section)" in md and "zero9: plan FAIL: rank 0 param: 16 B more" in md
    assert not (fake / "wandb").exists()


def test_empty_and_all_failed_sweeps_report(tmp_path, sweep):
    cell = cell_dirs(sweep)[0]
    shutil.copytree(cell, tmp_path / "s" / cell.name, ignore=shutil.ignore_patterns("wandb"))
    manifest = read_json(tmp_path / "s" / cell.name / "manifest.json")
    manifest.update(status="failed",
                    error={"rank": None, "cause": "timeout", "message": "cell ran past 1 s", "log": None})
    (tmp_path / "s" / cell.name / "manifest.json").write_text(json.dumps(manifest))
    report = write_report(tmp_path / "s", wandb_mode="none")
    assert report.plots == [] and "ddp: cell failed: (timeout) cell ran past 1 s" in report.verdicts.failures
    assert (tmp_path / "s" / "report.html").exists()


def test_labels_name_an_integer_axis_as_an_integer():
    """A sweep mixing DeepSpeed stages with FSDP cells: pandas makes the stage column float (NaN for FSDP)."""
    import pandas as pd

    from zeroexp.results.cells import order_cells

    frame = pd.DataFrame({"cell.strategy": ["deepspeed", "fsdp_full", "deepspeed"],
                          "cell.prefetch": [None, "pre", None],
                          "cell.stage": [3, None, 2], "cell_id": ["a", "b", "c"], "cell_name": ["x", "y", "z"]})
    assert list(order_cells(frame).label) == ["fsdp_full-pre", "deepspeed stage=2", "deepspeed stage=3"]


def test_a_sweep_of_dry_runs_says_so(tmp_path, sweep):
    """Dry runs beside a trained cell: the cells table names each cell's mode, the verdicts say why memory,
    timing and equivalence are absent instead of counting them as missing sections."""
    from conftest import BASE
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR, register
    from zeroexp.launch.runner import run_cell

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copytree(cell_dirs(sweep)[0], mixed / cell_dirs(sweep)[0].name, ignore=shutil.ignore_patterns("wandb"))
    register()
    for strategy in ("ddp", "fsdp2_full"):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config",
                          overrides=[*BASE, f"strategy={strategy}", "world_size=8", "dry_run=true"])
        assert run_cell(cfg, mixed / f"{strategy}_dry").status == "ok"
    report = build_report(mixed)
    cells = report.table("cells").display().set_index("cell")
    assert (cells.loc["ddp N=8", "mode"] == "dry run, derived"
            and cells.loc["fsdp2_full N=8", "mode"] == "dry run, traced")
    assert cells.loc["ddp N=2", "mode"] == "trained"
    lines = report.verdicts.lines
    assert "2 of them dry runs" in lines[0]
    eq = next(line for line in lines if line.startswith("equivalence:"))
    assert eq.startswith("equivalence: 1 of 3 finished cells PASS") and "2 n/a (dry run: not measured)" in eq
    assert "no equivalence section" not in eq
    assert any(line.startswith("memory: steady and peak measured in 1 of 3") and "2 dry runs" in line
               and "1 simulated" in line for line in lines)  # the traced dry run's memory is a simulation


def test_terminal_digest_shows_the_summary_numbers(sweep):
    from zeroexp.report.checks import worst
    from zeroexp.report.digest import digest

    summary = read_json(cell_dirs(sweep)[0] / "summary.json")
    rows = {probe: (found, check) for probe, found, check in digest(summary)}
    assert list(rows) == ["state", "collectives", "memory", "timing", "equivalence", "grad_norm", "plan", "plan.state",
                          "plan.collectives", "plan.groups", "plan.memory", "plan.time"]
    for probe in ("state", "collectives", "equivalence"):
        assert rows[probe][1] == summary[probe]["check"]
    for part in ("groups", "memory", "time"):
        assert rows[f"plan.{part}"][1] == summary["plan"][part]["check"]
    assert rows["plan"][1] == worst(check for probe, (_, check) in rows.items() if probe.startswith("plan."))
    assert rows["memory"][1] == rows["timing"][1] == "-"  # reported, not checked
    f = summary["state"]["factors"]
    assert rows["state"][0].startswith(f"P/G/O x P (sum over ranks) {f['param']:g} / {f['grad']:g} / {f['optim']:g}")
    assert f"in {summary['memory']['peak_phase_of_max_rank']}" in rows["memory"][0]
    assert "CV" in rows["timing"][0] and ("unstable" in rows["timing"][0]) == summary["timing"]["unstable"]
    assert digest({"status": "ok"}) == []


def test_cells_without_schema_version_report_the_same(sweep, tmp_path):
    """Results stay readable: cells written before ``schema_version`` existed (version 1: no field in
    ``summary.json`` or ``manifest.json``) give the same report as the current version 2; a newer version is
    refused by name, as an unreadable cell."""
    from zeroexp.report.pages import to_markdown
    from zeroexp.results.files import SCHEMA_VERSION

    assert SCHEMA_VERSION == 2
    new, old = tmp_path / "v2", tmp_path / "v1"
    for cell in cell_dirs(sweep)[:3]:
        for target in (new, old):
            shutil.copytree(cell, target / cell.name, ignore=shutil.ignore_patterns("wandb"))
        for name in ("manifest.json", "summary.json"):
            doc = read_json(old / cell.name / name)
            assert doc.pop("schema_version") == SCHEMA_VERSION
            (old / cell.name / name).write_text(json.dumps(doc))
    reports = {d: build_report(d) for d in (new, old)}
    assert list(load_sweep(new).schema_version) == [2, 2, 2] and list(load_sweep(old).schema_version) == [1, 1, 1]
    a, b = reports[new], reports[old]
    assert [t.key for t in a.tables] == [t.key for t in b.tables]
    for ta, tb in zip(a.tables, b.tables):
        pd.testing.assert_frame_equal(ta.display(), tb.display())
        assert ta.note == tb.note and ta.bullets == tb.bullets
    assert a.verdicts.lines == b.verdicts.lines and a.verdicts.failures == b.verdicts.failures
    body = {d: to_markdown(r).split("## Verdicts", 1)[1] for d, r in reports.items()}
    assert body[new] == body[old]

    cell = cell_dirs(new)[0]
    manifest = read_json(cell / "manifest.json")
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (cell / "manifest.json").write_text(json.dumps(manifest))
    row = load_sweep(new).set_index("cell_name").loc[cell.name]
    assert row["status"] == "unreadable" and f"schema_version {SCHEMA_VERSION + 1}" in row["error.message"]


# --- the sweep's W&B Report (wandb-workspaces), built offline -------------------------------------------------

@pytest.fixture
def no_wandb_api(monkeypatch):
    """Any W&B API call while building fails the test: a report is built with no network."""
    wr_interface = pytest.importorskip("wandb_workspaces.reports.v2.interface",
                                       reason="wandb-workspaces not installed (pip install -e '.[wandb]')")

    def refuse(*args, **kwargs):
        raise AssertionError("W&B API called while building the report")

    monkeypatch.setattr(wr_interface, "_get_api", refuse)
    monkeypatch.setattr(wr_interface, "execute_graphql", refuse)
    monkeypatch.setattr("wandb.Api", refuse)
    return wr_interface


def _sections(wandb_report) -> dict[str, list]:
    """Section title (H2) -> the blocks under it."""
    import wandb_workspaces.reports.v2 as wr

    out: dict[str, list] = {}
    current = None
    for block in wandb_report.blocks:
        if isinstance(block, wr.H2):
            current = block.text
            out[current] = []
        elif current is not None:
            out[current].append(block)
    return out


def test_wandb_report_sections_panels_and_run_set(sweep, no_wandb_api):
    import wandb_workspaces.reports.v2 as wr

    from zeroexp.report.wandb_report import LOSS_KEY, STEP_KEY, build_wandb_report

    report = build_report(sweep)
    built = build_wandb_report(report)
    assert built.title == f"zeroexp sweep {sweep.name}" and built.project == "zeroexp" and built.entity == ""
    sections = _sections(built)
    assert list(sections) == ["Verdicts", "What won", *(t.title for t in report.tables if t.key != "failures")]
    verdicts = sections["Verdicts"][0].text
    assert all(f"- {line}" in verdicts for line in report.verdicts.lines) and "**Failures:** none." in verdicts

    runs = [read_run(run_file(c)) for c in cell_dirs(sweep)]
    summary_keys = set().union(*(r["summary"] for r in runs))
    history_keys = set().union(*(row for r in runs for row in r["history"]))
    panels: dict[str, list] = {}
    for title, blocks in sections.items():
        grids = [b for b in blocks if isinstance(b, wr.PanelGrid)]
        for grid in grids:
            (runset,) = grid.runsets
            assert runset.filters == f"Metric(\"Group\") == '{sweep.name}' and Metric(\"JobType\") == 'cell'"
            assert runset.project == "zeroexp"
            panels[title] = grid.panels
        if title not in ("Verdicts", "What won"):  # each section shows its table, the same strings as report.md
            table = next(t for t in report.tables if t.title == title)
            assert isinstance(blocks[0], wr.MarkdownBlock)
            assert blocks[0].text.splitlines()[0].startswith("| cell |")
            assert all(str(v) in blocks[0].text for v in table.display().iloc[:, 0])
    # the panels read keys the cells really logged: the summary, or the loss per step in the history
    for grid_panels in panels.values():
        for p in grid_panels:
            keys = p.metrics if isinstance(p, wr.BarPlot) else p.y
            assert keys and set(keys) <= summary_keys, (p.title, set(keys) - summary_keys)
    by_title = {title: {p.title: p for p in ps} for title, ps in panels.items()}
    (loss,) = [p for p in panels["Cells"] if isinstance(p, wr.LinePlot)]
    assert loss.y == [LOSS_KEY] and loss.x == STEP_KEY and {LOSS_KEY, STEP_KEY} <= history_keys
    state = by_title["Model state per rank"]["State bytes per cell, largest rank"]
    assert state.metrics[:3] == [f"state/max_rank_bytes/{k}" for k in ("param", "grad", "optim")]
    phases = by_title["Steady and peak memory"]["Peak bytes per phase, largest rank"].metrics
    assert phases == [f"memory/phase_peak_bytes_max/{p}" for p in ("forward", "backward", "optimizer")]
    calls = by_title["Collectives per step"]["Calls per step, per op"].metrics
    logged_ops = [op for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
                  if f"collectives.counts.{op}" in report.cells.columns]
    assert calls == [f"collectives/counts/{op}" for op in logged_ops] and len(calls) >= 3  # in the ladder's order
    assert "timing/median_ms" in by_title["Step time"]["Step time, ms (median, p95)"].metrics
    # the spec W&B would receive serializes without a server (no entity: no project look-up)
    assert built._to_model().spec.model_dump_json(by_alias=True, exclude_none=True)


def test_wandb_report_of_a_failed_sweep_has_the_failures(failed_sweep, no_wandb_api):
    from zeroexp.report.wandb_report import build_wandb_report, report_target

    sweep_dir, _ = failed_sweep
    report = build_report(sweep_dir)
    sections = _sections(build_wandb_report(report))
    assert "Failed, refused or skipped cells" in sections and "injected fault" in sections[
        "Failed, refused or skipped cells"][0].text
    assert "**Failures:**" in sections["Verdicts"][0].text and "zro: cell failed" in sections["Verdicts"][0].text
    assert not report_target(report.cells)["logged"]  # logger=none: the CLI says its panels find no runs


def test_wandb_report_cli_offline_describes_online_saves(sweep, tmp_path, monkeypatch, capsys, no_wandb_api):
    import zeroexp.report.wandb_report as wandb_report

    copy = tmp_path / sweep.name  # same group name: the report's run set is the sweep's
    for cell in cell_dirs(sweep)[:2]:
        shutil.copytree(cell, copy / cell.name, ignore=shutil.ignore_patterns("wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_MODE", "offline")  # offline wins over a key: described, not saved
    assert not wandb_report.logged_in()
    assert report_main([str(copy), "--wandb", "none", "--wandb-report"]) == 0
    out = capsys.readouterr().out
    assert "the W&B Report is not saved" in out and f'W&B Report "zeroexp sweep {sweep.name}"' in out
    for text in ("section: Model state per rank", 'bar plot "State bytes per cell, largest rank"',
                 'line plot "Loss per step, rank 0, per cell": train/loss_rank0 per trainer/global_step',
                 f"wandb sync {copy}/*/wandb/offline-run-* {copy}/wandb/offline-run-*",
                 f"python -m zeroexp.report {copy} --wandb-report"):
        assert text in out, text

    monkeypatch.delenv("WANDB_MODE")  # logged in and online: saved (here a stand-in), its URL printed
    assert wandb_report.logged_in()
    saved = []
    monkeypatch.setattr(wandb_report, "save_wandb_report",
                        lambda r: saved.append(r) or "https://wandb.ai/me/zeroexp/reports/x--abc")
    assert report_main([str(copy), "--wandb", "none", "--wandb-report"]) == 0
    assert len(saved) == 1 and saved[0].title == f"zeroexp sweep {sweep.name}"
    assert "W&B Report: https://wandb.ai/me/zeroexp/reports/x--abc" in capsys.readouterr().out
