"""The code passes ruff: pyflakes (``F``) and lines of at most 120 characters (``E501``), as configured in
pyproject.toml's ``[tool.ruff]``, over zeroexp/, tests/ and benchmarks/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (the dev extra installs it: pip install -e '.[dev]')")
def test_ruff_finds_nothing() -> None:
    cmd = [sys.executable, "-m", "ruff", "check", "--no-cache", "zeroexp", "tests", "benchmarks"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd[1:])} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
