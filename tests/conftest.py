"""Shared fixtures: compose real configs and shrink them; run each distinct cell once per test session.

``cell(*overrides)`` runs the cell that the overrides compose (on top of :data:`BASE`) and caches its
:class:`~zeroexp.runner.CellResult`, so tests of different probes that look at the same cell share one run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from zeroexp.cli import CONF_DIR, register
from zeroexp.runner import CellResult, run_cell

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
