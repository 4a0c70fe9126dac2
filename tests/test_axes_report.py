"""The sweep report shows the optional axes (zeroexp/results/axes.py, groups.py): hybrid sharding's mesh, activation
checkpointing, grad_accum, sync_each_microbatch and clip_grad_norm as columns of the cells table where a cell sets them
(n/a where an axis does not apply), and a hybrid cell's collectives by process group (table, plot, W&B panels);
Markdown, HTML, the sweep's W&B run and its W&B Report show the same strings.

Two real cells in one sweep directory: fsdp_hybrid (N=4, shard_size=2, clipped) and fsdp2_full (N=2, grad_accum=2,
sync_each_microbatch, activation_checkpointing=full).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import pytest

from zeroexp.cell.identity import cell_name
from zeroexp.report import build_report, write_report
from zeroexp.results.axes import AXES, axis_values, set_axes, varies
from zeroexp.results.format import NA
from zeroexp.launch.runner import run_cell
from zeroexp.results.wandb_offline import read_run

P = 8 * 64 * 64 * 4  # conftest.BASE's mlp: 8 Linear(64, 64), fp32
HYBRID = ("strategy=fsdp_hybrid", "world_size=4", "strategy.shard_size=2", "strategy.clip_grad_norm=0.05")
ACCUM = ("strategy=fsdp2_full", "world_size=2", "grad_accum=2", "strategy.sync_each_microbatch=true",
         "activation_checkpointing=full")
AXIS_HEADERS = ["mesh (replicas x shard)", "act. ckpt", "grad accum", "sync each micro-batch", "clip grad norm"]


@pytest.fixture(scope="module")
def sweep(compose, tmp_path_factory) -> Path:
    """Both cells in one directory, and its report with the sweep's W&B run (offline)."""
    root = tmp_path_factory.mktemp("axes_report") / "sweep"
    for overrides in (HYBRID, ACCUM):
        cfg = compose(*overrides)
        result = run_cell(cfg, root / cell_name(cfg))  # as a sweep names its cells' directories
        assert result.status == "ok", result.error
    write_report(root, wandb_mode="offline")
    return root


def _summaries(sweep: Path) -> dict[str, dict]:
    """``hybrid`` and ``accum``: the two cells' summary.json."""
    found = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}
    return {"hybrid": next(s for n, s in found.items() if n.startswith("fsdp_hybrid")),
            "accum": next(s for n, s in found.items() if n.startswith("fsdp2_full"))}


def test_cells_table_has_a_column_per_axis_a_cell_sets(sweep):
    report = build_report(sweep)
    shown = report.table("cells").display()
    assert list(shown.columns) == ["cell", "status", "model", "N", *AXIS_HEADERS, "final loss", "wall s", "directory"]
    rows = shown.set_index("directory")
    hybrid, accum = (rows.loc[next(d for d in rows.index if d.startswith(s))] for s in ("fsdp_hybrid", "fsdp2_full"))
    # fsdp_hybrid: a (2 replicas, 2 shards) mesh, clipped at 0.05; FSDP1 has sync_each_microbatch, left false
    assert [hybrid[h] for h in AXIS_HEADERS] == ["2 x 2", "none", "1", "no", "0.05"]
    # fsdp2_full: no mesh (the axis does not apply), checkpointed, 2 micro-batches reduce-scattered each, not clipped
    assert [accum[h] for h in AXIS_HEADERS] == [NA, "full", "2", "yes", "none"]
    # the values are the cells' own: manifest.json cell and config
    cells = report.cells.set_index("cell_name")
    assert (cells.loc[accum.name, "cell.grad_accum"] == 2
            and cells.loc[accum.name, "cell.activation_checkpointing"] == "full")
    assert (cells.loc[hybrid.name, "cell.shard_size"] == 2
            and cells.loc[hybrid.name, "config.strategy.clip_grad_norm"] == 0.05)
    # labels name the axes that tell the cells apart, clipping and sync_each_microbatch included
    assert "clip=0.05" in hybrid["cell"] and "shard_size=2" in hybrid["cell"]
    assert all(s in accum["cell"] for s in ("grad_accum=2", "activation_checkpointing=full", "sync_each_microbatch"))
    assert "clip=" not in accum["cell"]


def test_collectives_by_group_table_holds_the_hybrid_cells_measured_groups(sweep):
    report = build_report(sweep)
    table = report.table("collective_groups")
    hybrid = _summaries(sweep)["hybrid"]["collectives"]
    raw = table.raw
    assert set(raw.cell_name) == {n for n in report.cells.cell_name if n.startswith("fsdp_hybrid")}  # it alone
    measured = {(r.op, r.mesh_dim): (r.group_size, r.count, r.payload_bytes) for r in raw.itertuples()}
    assert measured == {(op, dim): (g["size"], g["count"], g["payload_bytes"])
                        for op, gs in hybrid["groups"].items() for dim, g in gs.items()}
    # per step at N=4, shard_size=2, 8 units of P/8: 16 all_gather and 8 reduce_scatter in the shard group, 8
    # all_reduce of the gradient shards across the replicas, and FSDP1 clipping's 4-byte norm in the shard group
    assert measured == {("all_gather", "shard"): (2, 16, 2 * P), ("reduce_scatter", "shard"): (2, 8, P),
                        ("all_reduce", "replicate"): (2, 8, P // 2), ("all_reduce", "shard"): (2, 1, 4)}
    expected = {(r.op, r.mesh_dim): (r.expected_count, r.expected_payload_bytes) for r in raw.itertuples()}
    assert expected == {k: v[1:] for k, v in measured.items()} and set(raw.check) == {"PASS"}
    shown = table.display()
    assert list(shown.columns) == ["cell", "op", "group", "ranks", "calls", "payload B", "bus B", "check"]
    assert "4" in list(shown["payload B"]) and "(exp." not in " ".join(shown["calls"])


def test_collectives_plot_splits_each_op_by_group(sweep):
    from zeroexp.report.plots import _payload_by_group

    report = build_report(sweep)
    ok = report.cells.set_index("cell_name")
    ops = ["all_reduce", "all_gather", "reduce_scatter"]
    summaries = _summaries(sweep)
    for name, row in ok.iterrows():
        summary = summaries["hybrid" if name.startswith("fsdp_hybrid") else "accum"]["collectives"]
        assert _payload_by_group(row, ops) == {(op, dim): float(g["payload_bytes"])
                                               for op, gs in summary["groups"].items() for dim, g in gs.items()}
    assert (sweep / "report_collectives.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_html_and_wandb_show_the_same_axis_columns(sweep, monkeypatch):
    import wandb_workspaces.reports.v2 as wr

    from zeroexp.report.wandb_report import build_wandb_report

    report = build_report(sweep)
    md, page = (sweep / "report.md").read_text(), (sweep / "report.html").read_text()
    for key in ("cells", "collective_groups"):
        shown = report.table(key).display()
        header = "| " + " | ".join(shown.columns) + " |"
        assert header in md, key
        assert all(f"<th>{html.escape(c)}</th>" in page for c in shown.columns), key
        for row in shown.itertuples(index=False):
            assert "| " + " | ".join(str(v).replace("|", "\\|") for v in row) + " |" in md
    # the sweep's W&B run logged the tables as the report shows them
    (run_path,) = sweep.glob("wandb/offline-run-*/run-*.wandb")
    run = read_run(run_path)
    for key in ("cells", "collective_groups"):
        logged = json.loads((run_path.parent / "files" / run["summary"][f"report/{key}/path"]).read_text())
        assert logged["columns"] == list(report.table(key).display().columns)
        assert logged["data"] == report.table(key).display().values.tolist()
    # the W&B Report: the same Markdown tables, and bars of each op's calls and payload by group
    monkeypatch.setattr("wandb.Api", lambda *a, **k: pytest.fail("no W&B API call"))
    built = build_wandb_report(report)
    sections: dict[str, list] = {}
    for block in built.blocks:
        if isinstance(block, wr.H2):
            sections[block.text] = current = []
        elif sections:
            current.append(block)
    assert "| " + " | ".join(report.table("cells").display().columns) + " |" in sections["Cells"][0].text
    grid = next(b for b in sections["Collectives by process group"] if isinstance(b, wr.PanelGrid))
    metrics = {p.title: set(p.metrics) for p in grid.panels}
    groups = _summaries(sweep)["hybrid"]["collectives"]["groups"]
    accum = _summaries(sweep)["accum"]["collectives"]["groups"]
    want = {f"collectives/groups/{op}/{dim}/count" for gs in (groups, accum) for op, g in gs.items() for dim in g}
    assert metrics["Calls per step, per op and process group"] == want


def test_a_sweep_setting_no_axis_shows_no_axis_column():
    """Cells that set none of the optional axes: the cells table has no column for any of them."""
    from zeroexp.report.tables import cells_table

    frame = pd.DataFrame({"cell_name": ["a", "b"], "label": ["ddp", "fsdp_full-pre"], "status": ["ok", "ok"],
                          "cell.model": ["mlp", "mlp"], "cell.world_size": [2, 2], "world_size": [2, 2],
                          "config.strategy.clip_grad_norm": [None, None], "config.grad_accum": [1, 1],
                          "config.strategy.sync_each_microbatch": [None, False]})
    assert set_axes(frame) == []
    table = cells_table(frame)
    assert [c.header for c in table.columns] == ["cell", "status", "model", "N", "final loss", "wall s", "directory"]
    assert table.note == ""
    # one cell sets sync_each_microbatch: the column appears, n/a for the strategy without the key
    frame.loc[1, "config.strategy.sync_each_microbatch"] = True
    assert [a.header for a in set_axes(frame)] == ["sync each micro-batch"]
    assert list(cells_table(frame).display()["sync each micro-batch"]) == [NA, "yes"]
    assert list(axis_values(frame)[AXES[0].key]) == [None, None]  # no shard_size: no mesh


def test_varies_counts_a_missing_value_as_a_value():
    assert varies(pd.Series([2.0, float("nan")])) and varies(pd.Series(["x", None], dtype="str"))
    assert not varies(pd.Series([2, 2])) and not varies(pd.Series([None, float("nan")]))
