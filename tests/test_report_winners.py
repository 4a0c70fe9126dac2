"""What won a sweep (zeroexp/report/winners.py): the fastest cell, the lowest peak, the least communication and the
trade-off, from the cells' measured figures; only cells whose checks passed compete, the others are named.

Reads the session's shared sweeps (conftest.ladder_sweep: ddp, zro, fsdp_grad_op, fsdp_full pre/post/none at N=2;
conftest.failed_sweep: ddp ok, zro failing) and edits copies of their cells, so it runs no cell of its own.
"""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import pytest

from zeroexp.report import build_report, write_report
from zeroexp.report.checks import failed_checks
from zeroexp.results.files import read_json

MiB = 2 ** 20


def _cells(sweep: Path) -> dict[str, dict]:
    """label -> summary.json of each finished cell."""
    cells = build_report(sweep).cells
    labels = dict(zip(cells.cell_name, cells.label))
    return {labels[p.parent.name]: read_json(p) for p in sweep.glob("*/summary.json")
            if read_json(p.with_name("manifest.json"))["status"] == "ok"}


def _bus(summary: dict) -> int:
    return sum(v for v in summary["collectives"]["bus_bytes"].values())


def test_what_won_on_each_axis_is_the_summaries_best(ladder_sweep):
    """Each axis names the competing cell with the lowest figure of its summary.json, then every cell tied with it
    (timing: 95 % CIs overlap; bytes: equal), in report.md, report.html and the W&B Report alike."""
    from zeroexp.report.pages import winners_markdown
    from zeroexp.report.wandb_report import build_wandb_report

    sweep, proc = ladder_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = {k: s for k, s in _cells(sweep).items() if not failed_checks(s)}
    report = build_report(sweep)
    fast, peak, comm, trade, competing = report.winners.lines
    ci = {k: s["plan"]["time"]["median_ci95_ms"] for k, s in cells.items()}
    best = min(cells, key=lambda k: cells[k]["timing"]["median_ms"])
    tied = [k for k in ci if k != best and ci[k][0] <= ci[best][1] and ci[best][0] <= ci[k][1]]
    assert fast.startswith(f"Fastest (median step time): {best}, ")
    assert all(f" {k} " in fast.split("; runner-up")[0] for k in tied)
    for line, figure in ((peak, lambda s: s["memory"]["peak_bytes_max"]), (comm, _bus)):
        low = min(figure(s) for s in cells.values())
        winners = [k for k in report.cells.label if k in cells and figure(cells[k]) == low]  # ladder order
        named = line.split(": ", 1)[1].split("; runner-up")[0]
        assert named.split(",")[0] == winners[0] and all(k in named for k in winners[1:]), (line, winners)
        others = sorted((figure(s), k) for k, s in cells.items() if figure(s) != low)
        if others:
            assert f"+{others[0][0] - low:,} B)" in line, (line, others[0])
    # the ladder's bus bytes per step at N=2 are exact: DDP's all_reduce 2(N-1)/N P = P, SHARD_GRAD_OP's
    # all_gather + reduce_scatter (N-1)/N P each = P: a tie, named
    assert comm.startswith("Least communication (bus bytes per step): ddp, 0.1250 MiB, tied with fsdp_grad_op")
    assert trade.startswith("Trade-off: ") and competing == f"Competing: all {len(cells)} cells (every check passed)."
    md = (sweep / "report.md").read_text(encoding="utf-8")
    assert "## What won\n\n" + "\n".join(winners_markdown(report)) in md
    page = (sweep / "report.html").read_text(encoding="utf-8")
    assert all(f"<li>{html.escape(line)}</li>" in page for line in report.winners.lines)
    blocks = build_wandb_report(report).blocks
    at = next(i for i, b in enumerate(blocks) if getattr(b, "text", None) == "What won")
    assert blocks[at + 1].text == "\n".join(winners_markdown(report))


@pytest.fixture()
def edited(ladder_sweep, tmp_path) -> Path:
    """A copy of the ladder sweep with set figures: ddp fails its equivalence check; step times (median, 95 % CI)
    zro 20 [18, 22], fsdp_grad_op 21 [19, 25] (overlapping zro's), fsdp_full pre 30, post 31, none 40 (disjoint);
    peaks zro 4, fsdp_grad_op 3, fsdp_full pre 2, post 2, none 2.5 MiB; each cell's measured bus bytes as run."""
    times = {"zro": (20, 18, 22), "fsdp_grad_op": (21, 19, 25), "fsdp_full-pre": (30, 28, 32),
             "fsdp_full-post": (31, 29, 33), "fsdp_full-none": (40, 38, 42), "ddp": (10, 9, 11)}
    peaks = {"zro": 4 * MiB, "fsdp_grad_op": 3 * MiB, "fsdp_full-pre": 2 * MiB, "fsdp_full-post": 2 * MiB,
             "fsdp_full-none": 5 * MiB // 2, "ddp": MiB}
    sweep, _ = ladder_sweep
    copy = tmp_path / "sweep"
    cells = build_report(sweep).cells
    labels = dict(zip(cells.cell_name, cells.label))
    for cell in sorted(p.parent for p in sweep.glob("*/summary.json")):
        shutil.copytree(cell, copy / cell.name, ignore=shutil.ignore_patterns("wandb"))
        label, path = labels[cell.name], copy / cell.name / "summary.json"
        s = read_json(path)
        median, low, high = times[label]
        s["timing"]["median_ms"], s["plan"]["time"]["median_ci95_ms"] = median, [low, high]
        s["plan"]["time"]["check"] = "n/a"  # as without a calibration, wherever the suite runs
        s["memory"]["peak_bytes_max"] = peaks[label]
        if label == "ddp":
            s["equivalence"]["check"], s["equivalence"]["why"] = "FAIL", "edited to fail"
        path.write_text(json.dumps(s))
    return copy


def test_what_won_ties_within_the_spread_and_excludes_failed_checks(edited):
    report = write_report(edited, wandb_mode="none")
    assert report.winners.lines == [
        "Fastest (median step time): zro, 20.000 ms [18.000, 22.000], tied with fsdp_grad_op 21.000 ms "
        "[19.000, 25.000]; runner-up fsdp_full-pre, 30.000 ms [28.000, 32.000] (+50.0 %, +10.000 ms).",
        "Lowest peak (worst rank): fsdp_full-pre, 2.00 MiB, tied with fsdp_full-post 2.00 MiB; runner-up "
        "fsdp_full-none, 2.50 MiB (+25.0 %, +524,288 B).",
        "Least communication (bus bytes per step): fsdp_grad_op, 0.1250 MiB; runner-up fsdp_full-pre, 0.1875 MiB "
        "(+50.0 %, +65,536 B).",
        "Trade-off: fsdp_full-pre: 50 % less peak than zro for 1.50× the step time and 25 % less bytes; "
        "fsdp_grad_op: 50 % less bytes than zro for the same step time (95 % CIs overlap) and 25 % less peak.",
        "Not competing (only cells whose checks passed do): ddp (equivalence FAIL).",
    ]
    assert all("ddp" not in line for line in report.winners.lines[:4])  # the fastest and smallest, but failed


def test_a_failed_cell_is_named_not_dropped(failed_sweep):
    sweep, _ = failed_sweep
    report = build_report(sweep)
    assert report.winners.lines[3] == ("Trade-off: none: ddp is fastest, lowest in peak and least in communication "
                                       "(or ties each).")
    assert report.winners.lines[-1] == "Not competing (only cells whose checks passed do): zro (cell failed)."
    assert all("(the only competing cell)" in line for line in report.winners.lines[:3])
    md = (sweep / "report.md").read_text(encoding="utf-8")
    assert "zro (cell failed)" in md.split("## What won", 1)[1].split("\n## ", 1)[0]
