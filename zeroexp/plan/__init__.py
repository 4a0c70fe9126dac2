"""The planner: per-rank memory and per-step communication of any model at any scale, before running it.

``python -m zeroexp.plan`` (:mod:`zeroexp.cli.plan`, ``conf/plan.yaml``) plans every strategy the planner knows
(``zeroexp.formulas.LAYOUTS`` and the registered strategies) for a parameter count or a model config built on
the meta device; every run's ``summary.json["plan"]`` (:func:`plan_section`) compares the prediction for that
cell with what its probes measured. The formulas are ``zeroexp.formulas``'s, shared with the probes; the
conventions and limits are in docs/planner.md.
"""

from zeroexp.plan.cell import plan_section
from zeroexp.plan.core import Precision, parse_bytes, parse_count, plan, plan_record, strategy_table
from zeroexp.plan.shape import model_shape, shape_of

__all__ = ["Precision", "plan", "plan_record", "strategy_table", "parse_bytes", "parse_count", "model_shape",
           "shape_of", "plan_section"]
