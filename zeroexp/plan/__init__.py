"""The planner: per-rank memory and per-step communication of any model at any scale, before running it.

``python -m zeroexp.plan`` (:mod:`zeroexp.cli.plan`, ``conf/plan.yaml``) plans every strategy the planner knows
(``zeroexp.formulas.LAYOUTS`` and the registered strategies) for a parameter count or a model config built on
the meta device; every run's ``summary.json["plan"]`` (:func:`plan_section`) compares the prediction for that
cell with what its probes measured. The formulas are ``zeroexp.formulas``'s, shared with the probes; the
conventions and limits are in docs/planner.md.

Importing the package imports no torch (a paper row, ``params=``, needs no model): each name is read from its module
on first use, and only :mod:`~zeroexp.plan.shape` and :mod:`~zeroexp.plan.check.cell` build models.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each name this package provides, and the module that defines it.
_HOMES = {"plan_section": "cell", "Precision": "core", "plan": "core", "plan_record": "core", "strategy_table": "core",
          "parse_bytes": "core", "parse_count": "core", "model_shape": "shape", "shape_of": "shape"}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
