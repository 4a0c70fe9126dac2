"""Shared fixtures: compose real configs and shrink them; run each distinct cell once per test session.

``cell(*overrides)`` runs the cell that the overrides compose (on top of :data:`BASE`) and caches its
:class:`~zeroexp.runner.CellResult`, so tests of different probes that look at the same cell share one run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest
import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from zeroexp.cli import CONF_DIR, register
from zeroexp.runner import CellResult, run_cell

# One intra-op thread in the test process, as each rank of a cell on this 2-core machine has (zeroexp.worker): with
# two, the in-process tests' small torch ops spin-waited for a descheduled peer thread whenever the cores were busy
# (test_reference_arithmetics_differ_by_rounding_only: 179 s with two threads, 1.5 s with one, run one after the other on the same loaded host).
torch.set_num_threads(1)

#: Shrinks every test cell: no W&B unless a test asks for it, a small 8-layer Linear stack, few steps.
BASE = ("logger=none", "model.width=64", "steps=10", "warmup_steps=3")


@pytest.fixture(scope="session")
def compose() -> Callable[..., DictConfig]:
    """``compose("strategy=zro", "world_size=2")`` -> the composed config (BASE applied first)."""
    register()

    def _compose(*overrides: str, base: tuple[str, ...] = BASE) -> DictConfig:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return hydra_compose(config_name="config", overrides=[*base, *overrides])

    return _compose


@pytest.fixture(scope="session")
def cell(compose, tmp_path_factory) -> Callable[..., CellResult]:
    """Run (once per session) the cell given by the overrides; returns its CellResult."""
    cache: dict[tuple[str, ...], CellResult] = {}
    root = tmp_path_factory.mktemp("cells")

    def _cell(*overrides: str, base: tuple[str, ...] = BASE) -> CellResult:
        key = (*base, "|", *sorted(overrides))  # group choices apply before values: order is irrelevant
        if key not in cache:
            cfg = compose(*overrides, base=base)
            cache[key] = run_cell(cfg, root / f"cell{len(cache):03d}")
        return cache[key]

    return _cell


def read_csv(result: CellResult, name: str):
    import pandas as pd

    return pd.read_csv(Path(result.cell_dir) / name)


#: What starts rank processes (or a whole `python -m zeroexp`): a test that does, itself or through a fixture, is
#: ``slow``; ``pytest -m "not slow"`` is the edit-test loop's fast subset (README, Tests).
_SPAWNS = re.compile(r"\brun_cell\(|(?<![\w.])cell\(|\bmp\.spawn\(|\bstart_processes\(|\bsubprocess\.|"
                     r"\blaunch_local\(|\brun_dry\(|\bmain\(\)")


def _starts_processes(func, depth: int = 3) -> bool:
    """Whether ``func``'s body, or a function of its module it calls (``depth`` levels down), starts processes."""
    import inspect

    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    body = source.split(":", 1)[-1]  # not the signature: a fixture named `cell` in it is checked by itself
    if _SPAWNS.search(body):
        return True
    helpers = [f for name, f in vars(inspect.getmodule(func) or object).items()  # the test module's own helpers
               if inspect.isfunction(f) and f is not func and f.__module__ == func.__module__
               and re.search(rf"(?<![\w.]){re.escape(name)}\(", body)]
    return depth > 0 and any(_starts_processes(f, depth - 1) for f in helpers)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: starts rank processes (a cell, a sweep, the CLI); deselect with "
                                       "-m 'not slow'")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
        funcs = [getattr(item, "function", None), *(d.func for ds in defs.values() for d in ds)]
        if any(f is not None and _starts_processes(f) for f in funcs):
            item.add_marker(pytest.mark.slow)
