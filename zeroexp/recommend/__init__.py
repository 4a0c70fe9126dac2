"""``python -m zeroexp.recommend``: which configuration to run, for a model on a cluster.

Every configuration of strategy x prefetch x precision x offload x activation checkpointing x micro-batch / grad_accum
x bucket size x hybrid shard size (:mod:`~zeroexp.recommend.space`) is timed by the planner's step-time model and the
fastest are judged by its peak model against the device less a headroom (:mod:`~zeroexp.recommend.search`); the
answer lists the ``top_k`` that fit, ties, what binds each and the command that runs it, or the nearest changes when
nothing fits (:mod:`~zeroexp.recommend.core`, :mod:`~zeroexp.recommend.answer`). The figures are the planner's
(``zeroexp.plan``, ``zeroexp.formulas``): nothing here models memory or time of its own. Importing the package
imports no torch.
"""

from __future__ import annotations

from zeroexp.plan.network import MODEL_TIME_ERROR
from zeroexp.recommend.core import recommend
from zeroexp.recommend.search import Evaluator, Problem, search
from zeroexp.recommend.space import Axes, Config, configurations

__all__ = ["recommend", "search", "Problem", "Evaluator", "Axes", "Config", "configurations",
           "MEASURED_TIME_ERROR"]

#: The step-time model's own error, as measured on this machine: the planner's (ties closer than it).
MEASURED_TIME_ERROR = MODEL_TIME_ERROR
