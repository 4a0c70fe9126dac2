"""The one Hydra entry helper of zeroexp's apps (``python -m zeroexp``, ``python -m zeroexp.plan``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import hydra
from omegaconf import DictConfig

__all__ = ["CONF_DIR", "run_hydra_app"]

#: The config groups (``conf/``), beside the package.
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def run_hydra_app(config_name: str, task_fn: Callable[[DictConfig], None], started: Callable[[], bool]) -> None:
    """Run a Hydra app on ``conf/<config_name>.yaml``. Hydra reports a composition error (unknown option,
    mistyped value, unknown key) and exits 1 before any task ran: that is bad input, reported as exit code 2."""
    try:
        hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(task_fn)()
    except SystemExit as e:
        if e.code == 1 and not started():
            sys.exit(2)
        raise
