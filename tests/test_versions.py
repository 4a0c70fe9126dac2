"""The library versions zeroexp supports: pyproject.toml's torch requirement is what ``import zeroexp`` checks, and
an older torch is refused with its name and the supported range."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import zeroexp

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_requires_the_torch_the_package_checks():
    deps = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["dependencies"]
    wanted = ".".join(map(str, zeroexp.TORCH_AT_LEAST))
    assert f"torch>={wanted}" in deps


@pytest.mark.parametrize("version", ["2.4.0", "2.12.1+cu126", "1.13.1"])
def test_an_older_torch_is_refused(version):
    with pytest.raises(ImportError, match=rf"torch>=2\.13 .*torch {version.replace('+', '[+]')} is installed"):
        zeroexp._check_torch(version)


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.13.1", "2.14.0.dev20260101", "3.0.0", "not-a-version"])
def test_a_supported_or_unreadable_torch_passes(version):
    zeroexp._check_torch(version)


def test_the_installed_torch_passes_and_import_zeroexp_imports_no_torch():
    zeroexp._check_torch()
    out = subprocess.run([sys.executable, "-c", "import sys, zeroexp; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True, cwd=PYPROJECT.parent)
    assert out.stdout.strip() == "False"
