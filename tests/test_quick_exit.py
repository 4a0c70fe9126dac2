"""Entry points end through zeroexp.cli.quick_exit: the exit status, the atexit handlers and the flushed output are
those of a normal exit; only the interpreter's teardown is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A script whose ``main`` prints without a newline (flushed only at exit), then runs ``body``."""
    lines = ["import atexit, sys", "from pathlib import Path", "from zeroexp.cli.quick_exit import run_then_exit",
             f"atexit.register(lambda: Path({str(tmp_path / 'atexit_ran')!r}).write_text('yes'))",
             "def main():", "    print('unflushed line', end='')", f"    {body or 'pass'}",
             "run_then_exit(main)", "raise AssertionError('run_then_exit returned')"]
    script = tmp_path / "entry.py"
    script.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("body, status, stderr", [
    ("", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit(None)", 0, ""),
    ("sys.exit('bad input: model.width')", 1, "bad input: model.width"),
])
def test_status_atexit_and_output_survive(tmp_path, body, status, stderr):
    proc = _run(body, tmp_path)
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "unflushed line"
    assert proc.stderr.strip() == stderr
    assert (tmp_path / "atexit_ran").read_text() == "yes"


def test_an_exception_keeps_its_traceback(tmp_path):
    proc = _run("raise RuntimeError('boom')", tmp_path)
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr


def test_the_planner_cli_reports_bad_input_with_status_2():
    proc = subprocess.run([sys.executable, "-m", "zeroexp.plan", "model=mlp", "world_size=[0]"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "world_size" in proc.stderr + proc.stdout
