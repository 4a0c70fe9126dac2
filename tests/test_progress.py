"""Progress you can see: rank 0's ``.progress.json``, the plain lines and the rich bar the
launching process shows from it, and a sweep's ``cell i of n`` with its ETA."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

from zeroexp.launch.progress import SweepClock, format_line, read_progress, watch_progress
from zeroexp.rank.progress import PROGRESS_FILE, StepRecorder
from conftest import STEPS

LINE = re.compile(r"^(?P<name>\S+): step (?P<k>\d+) of (?P<n>\d+), loss \S+, step [\d.]+ ms, "
                  r"elapsed \d+:\d\d, ETA (\d+:\d\d|\?)$")


def _fake_rank0(cell: Path, steps: int, step_s: float) -> threading.Thread:
    rec = StepRecorder(cell, steps, every_s=0.0)

    def train() -> None:
        for k in range(1, steps + 1):
            time.sleep(step_s)
            rec.step(k, 1.0 / k)

    return threading.Thread(target=train)


def test_plain_lines_are_spaced_and_end_at_the_last_step(tmp_path):
    out = io.StringIO()
    with watch_progress(tmp_path, "cellA", stream=out, interactive=False, line_every_s=0.5):
        t = _fake_rank0(tmp_path, 12, 0.1)
        t.start()
        t.join()
    lines = out.getvalue().splitlines()
    assert lines and all(LINE.match(line) for line in lines), lines
    steps = [int(LINE.match(line)["k"]) for line in lines]
    assert steps[-1] == 12 and steps == sorted(steps) and len(set(steps)) == len(steps)
    assert 2 <= len(lines) <= 1.2 / 0.5 + 2, lines  # ~1.2 s of training, a line at most every 0.5 s, the last
    assert read_progress(tmp_path)["step"] == 12 and not list(tmp_path.glob(f"{PROGRESS_FILE}.*.tmp"))


def test_rich_bar_on_a_terminal(tmp_path):
    out = io.StringIO()
    with watch_progress(tmp_path, "cellB", stream=out, interactive=True):
        t = _fake_rank0(tmp_path, 5, 0.05)
        t.start()
        t.join()
    text = out.getvalue()
    assert "cellB" in text and "5/5" in text and "ETA 0:00" in text and "loss 0.2" in text


def test_format_line_and_sweep_clock():
    rec = {"step": 7, "steps": 30, "loss": 0.123456, "step_s": 0.0341, "eta_s": 20.4}
    assert format_line("c", rec, 12.2) == "c: step 7 of 30, loss 0.1235, step 34.1 ms, elapsed 0:12, ETA 0:20"
    clock = SweepClock()
    clock.start(4)
    assert clock.line(0, "a") == "cell 1 of 4: a"
    clock.finished(0, 10.0)
    clock.finished(1, 20.0)
    assert clock.line(2, "c") == "cell 3 of 4: c  (sweep ETA 0:30, 15.0 s per cell so far)"


def test_a_cell_records_its_progress(cell):
    result = cell()
    assert result.status == "ok"
    rec = read_progress(result.cell_dir)
    assert rec["step"] == rec["steps"] == result.summary["steps"] and rec["eta_s"] == 0.0
    assert abs(rec["loss"] - result.summary["final_loss"]) < 1.0  # rank 0's loss, not the ranks' mean


def test_cli_sweep_shows_cells_and_their_progress(ladder_sweep):
    """As a user runs it (stderr not a terminal: plain lines; the session's ladder sweep, conftest.LADDER_SWEEP:
    12 jobs, 6 distinct cells): each cell's progress ends at its last step, and the sweep prints ``cell i of n`` for
    every job, with its ETA once a cell has finished."""
    sweep_dir, proc = ladder_sweep
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[-1] == str(sweep_dir)
    heads = [line for line in out if line.startswith("cell ")]
    assert len(heads) == 12 and re.fullmatch(r"cell 1 of 12: ddp_\S+", heads[0]), heads
    for i, head in enumerate(heads[1:], start=2):  # a duplicate job prints its head too, then its skip
        assert re.fullmatch(rf"cell {i} of 12: \S+  \(sweep ETA \d+:\d\d, [\d.]+ s per cell so far\)", head), heads
    # Hydra's jobs: strategy by strategy, each with prefetch pre, post, none (a duplicate names its cell too)
    assert [h.split(": ")[1].split("_")[0] for h in heads] == ["ddp"] * 3 + ["zro"] * 3 + ["fsdp"] * 6, heads
    finals = [m["name"] for line in proc.stderr.splitlines()
              if (m := LINE.match(line)) and m["k"] == m["n"] == str(STEPS)]
    assert [n.split("_")[0] for n in finals] == ["ddp", "zro", "fsdp", "fsdp", "fsdp", "fsdp"], proc.stderr[-3000:]
    cells = list(sweep_dir.glob("*/manifest.json"))
    assert len(cells) == 6
    for cell_dir in cells:
        assert read_progress(cell_dir.parent)["step"] == STEPS
