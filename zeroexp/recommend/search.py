"""The search: the configurations of the space walked fastest first by the planner's step-time model, each judged
by the planner's peak model against the device less its headroom until ``top_k`` fit.

Everything is the planner's (one fact, one place): the model state of a row (``zeroexp.plan.core.plan_record``),
its groups (``zeroexp.plan.core.row_groups``), its step (``zeroexp.plan.network.predict_on``) and its peak
(``zeroexp.plan.row_peak.row_peak``: the peak model, or state + activations where the peak model does not cover the
row). What makes 10,000 configurations cheap: the shape is read once; a row's state is computed once per (row,
precision, offload, bucket size, shard size) and its groups once per (row, precision, bucket size, shard size,
grad_accum); a step once per configuration less its offload (the step-time model has no offload term), and only
for the configurations the walk reaches that could fit or be the fastest (:func:`search`: every other one is set
aside at a floor of its step that needs no groups, its micro-batches' compute); and a peak
only for the configurations walked, its step traces once per (model, micro-batch, dtypes, checkpointing,
segmentation). A configuration whose floor (its model state with the device's workspace, and the activations one
forward keeps, :meth:`Evaluator.floor_bytes`: a lower bound of its peak) exceeds the budget is known not to fit
without a trace of its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from zeroexp.formulas import COMPUTE_ITEMSIZE, LAYOUTS, ModelShape, PlanKnobs, checkpointed_numel
from zeroexp.formulas.device import DeviceSemantics
from zeroexp.recommend.space import Axes, Config, configurations

__all__ = ["Problem", "Scored", "Result", "Evaluator", "search", "FLOOR_SLACK"]

#: The activation floor's margin below its extrapolation (a floor prunes; it must never exceed a peak).
FLOOR_SLACK = 0.95


@dataclass
class Problem:
    """What the search is asked: a model's shape at a world size on a network (one per precision, ``networks``),
    a device of ``memory`` bytes with ``headroom`` kept free. ``model_cfg`` and ``wrap``: the model config and its
    unit classes for the traces (None: a parameter count, judged on its state alone); ``flops``: (micro-batch,
    checkpointing) -> FLOPs one rank computes in one micro-batch's forward and backward, or None where not counted;
    ``peak_flops``: precision -> the device's peak FLOP/s (None: unknown)."""

    shape: ModelShape
    world_size: int
    networks: dict[str, Any]
    device: DeviceSemantics
    memory: int
    headroom: float
    param_dtypes: dict[str, str]
    loss_scaling: dict[str, bool]
    tokens: int = 1
    model_cfg: Any = None
    wrap: list = field(default_factory=list)
    flops: Callable[[int, bool], float | None] | None = None
    peak_flops: dict[str, float | None] = field(default_factory=dict)

    @property
    def budget(self) -> int:
        """The bytes a configuration's peak may reach: the device less its headroom."""
        from zeroexp.plan.core import usable_bytes

        return usable_bytes(self.memory, self.headroom)


@dataclass
class Scored:
    """One configuration with its predicted step (``step``: a ``StepTime``) and, once judged, its peak (``peak``:
    ``row_peak``'s fields; None: not judged, or known not to fit from its state, ``state_bytes``)."""

    config: Config
    step: Any
    state_bytes: int
    peak: dict[str, Any] | None = None

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step.step_s


@dataclass
class Result:
    """The search's answer: ``fitting`` (fastest first, at most top_k), ``searched`` (configurations of the space),
    ``judged`` (peaks computed), ``fastest`` (the fastest configuration, fitting or not), ``timed`` (steps
    computed: the others were set aside by their model state, :func:`search`)."""

    fitting: list[Scored]
    searched: int
    judged: int
    fastest: Scored | None
    world_size: int
    timed: int = 0


class Evaluator:
    """The planner's figures for configurations of one :class:`Problem`, each computed once (see the module)."""

    def __init__(self, problem: Problem):
        self.p = problem
        self._records: dict[tuple, dict[str, Any]] = {}
        self._groups: dict[tuple, Any] = {}
        self._steps: dict[tuple, Any] = {}
        self._checkpointed: dict[Any, int] = {}

    def checkpointed(self, mode: Any) -> int:
        """The parameters whose forward ``mode`` recomputes (``checkpointed_numel``, ``selective_op``'s share
        counted on the model: ``zeroexp.plan.flops.recompute_share``; 1 for a parameter count)."""
        if mode not in self._checkpointed:
            from zeroexp.plan.flops import recompute_share

            shape = self.p.shape
            share = (recompute_share(self.p.model_cfg, 1, tuple(self.p.wrap), mode)
                     if self.p.model_cfg is not None and mode.policy else 1.0)
            self._checkpointed[mode] = checkpointed_numel(shape.units, shape.root, shape.numels, mode, share)
        return self._checkpointed[mode]

    def knobs(self, c: Config) -> PlanKnobs:
        return PlanKnobs(bucket_cap_bytes=int((c.bucket_cap_mb or 25) * 2**20),
                         loss_scaling=self.p.loss_scaling[c.precision], shard_size=c.shard_size or 0,
                         micro_batches=c.grad_accum, sync_each_microbatch=bool(c.sync_each_microbatch),
                         overlap_comm=bool(c.overlap_comm),
                         recompute=bool(c.checkpointing), recompute_mode=c.checkpointing.mode.replace("none", ""),
                         recompute_every=c.checkpointing.every, offload=c.offload)

    def itemsize(self, c: Config) -> int:
        return COMPUTE_ITEMSIZE[self.p.param_dtypes[c.precision]]

    def record(self, c: Config) -> dict[str, Any]:
        """The row's plan record (model state, gather floor) at this precision, offload, bucket and shard size."""
        from zeroexp.plan.core import Precision, plan_record

        key = (c.row, c.precision, c.offload, c.bucket_cap_mb, c.shard_size)
        if key not in self._records:
            knobs = replace(self.knobs(c), micro_batches=1)
            self._records[key] = plan_record(c.row, LAYOUTS[c.row], self.p.shape, self.p.world_size,
                                             Precision(c.precision, self.p.param_dtypes[c.precision]), c.offload,
                                             knobs, self.p.memory, headroom=self.p.headroom)
        return self._records[key]

    def groups(self, c: Config) -> Any:
        from zeroexp.plan.core import row_groups

        key = (c.row, c.precision, c.bucket_cap_mb, c.shard_size, c.grad_accum)
        if key not in self._groups:
            self._groups[key] = row_groups(c.row, LAYOUTS[c.row], self.p.shape, self.p.world_size,
                                           self.itemsize(c), self.knobs(c))
        return self._groups[key]

    def step(self, c: Config, without: str | None = None) -> Any:
        """The predicted step (``zeroexp.plan.network.predict_on``); ``without``: with that op left out."""
        from zeroexp.plan.network import compute_rate, model_ops, predict_on

        key = (replace(c, offload="none"), without)
        if key not in self._steps:
            network, groups = self.p.networks[c.precision], self.groups(c)
            self._steps[key] = predict_on(network, LAYOUTS[c.row], groups,
                                          self.itemsize(c), self.knobs(c), c.micro_batch, self.p.world_size,
                                          c.prefetch or "pre", self.checkpointed(c.checkpointing), without,
                                          model_ops(network, self.p.model_cfg, c.micro_batch),
                                          compute_rate(network, self.p.model_cfg, c.micro_batch, groups.numel))
        return self._steps[key]

    def floor_s(self, c: Config) -> float:
        """A lower bound of :meth:`step`'s ``step_s`` without the row's groups (``zeroexp.formulas.step_floor``)."""
        from zeroexp.formulas import step_floor
        from zeroexp.plan.network import compute_rate, model_ops

        network, psi = self.p.networks[c.precision], self.p.shape.trained_numel
        return step_floor(compute_rate(network, self.p.model_cfg, c.micro_batch, psi), psi, c.micro_batch, c.grad_accum,
                          model_ops(network, self.p.model_cfg, c.micro_batch), self.checkpointed(c.checkpointing))

    def state_bytes(self, c: Config) -> int:
        """A lower bound of the peak: the device's model state and the workspace it keeps."""
        return self.record(c)["device_bytes"] + self.p.device.workspace_bytes

    def floor_bytes(self, c: Config) -> int:
        """A lower bound of the peak: the model state and workspace, and (with a model) the activations one forward
        keeps at the micro-batch, from two traces per precision and checkpointing (:data:`FLOOR_SLACK` below the
        affine extrapolation A(1) + (m - 1) x (A(2) - A(1)), as every tensor of a forward is either proportional to
        the batch or free of it; tests/test_recommend.py holds every judged peak above it)."""
        from zeroexp.plan.row_peak import activation_bytes

        state = self.state_bytes(c)
        if self.p.model_cfg is None or state > self.p.budget:
            return state
        dtype = self.p.param_dtypes[c.precision]
        one, two = (activation_bytes(self.p.model_cfg, m, self.p.wrap, dtype, c.checkpointing) for m in (1, 2))
        return state + int(FLOOR_SLACK * (one + (c.micro_batch - 1) * max(two - one, 0)))

    def judge(self, s: Scored) -> dict[str, Any]:
        """The peak of ``s`` (``zeroexp.plan.row_peak.row_peak``) against the budget; a parameter count (no model to
        trace) is judged on its model state and gather floor alone (``judge_fits``)."""
        from zeroexp.plan.core import judge_fits
        from zeroexp.plan.row_peak import precision_of, row_peak

        c, record = s.config, self.record(s.config)
        if self.p.model_cfg is None:
            from zeroexp.formulas import LAYOUTS
            from zeroexp.plan.reserved import device_terms

            out = {**record, "peak_bytes": None, "workspace_bytes": self.p.device.workspace_bytes,
                   "by_category": {}}
            out.update(device_terms(LAYOUTS[c.row], self.groups(c), self.itemsize(c), self.knobs(c), self.p.device,
                                    None))
            judge_fits(out)
        else:
            out = row_peak(record, self.p.shape, precision_of(c.precision, self.p.param_dtypes[c.precision]),
                           self.knobs(c), self.p.model_cfg, c.micro_batch, self.p.wrap, c.checkpointing,
                           c.prefetch or "none", self.p.device, self.p.memory, self.p.headroom)
        s.peak = out
        return out


def search(problem: Problem, axes: Axes, top_k: int, evaluator: Evaluator | None = None) -> Result:
    """The ``top_k`` fastest configurations of ``axes`` that fit (see the module): ranked by predicted step time;
    at equal time a configuration without offload first (the step-time model has no offload term), then the
    configurations' own order (deterministic); a bucket size that changes nothing is searched once.

    Walked lazily, in exactly that order: every configuration enters a heap at its step's floor
    (:meth:`Evaluator.floor_s`, below its step), is timed when it comes first, and re-enters at its step; a timed
    one that comes first is the next in the order. Once the fastest is timed, a configuration whose model state
    exceeds the budget is set aside untimed when it comes first: it can neither fit nor be the fastest."""
    ev = evaluator or Evaluator(problem)
    configs = list(configurations(axes, problem.world_size))
    states = [ev.state_bytes(c) for c in configs]
    if problem.model_cfg is not None:  # the views of a step the walk may judge, traced in one run per step
        from zeroexp.plan.check.memory import trace_units_wanted

        # grad_accum 1: the step with its gradients allocated is traced for the rows the walk judges it for alone
        trace_units_wanted(list(dict.fromkeys(
            (c.row, c.precision, problem.param_dtypes[c.precision], 1) for c, state in zip(configs, states)
            if c.offload == "none" and state <= problem.budget)))
    floor, timed = 0, 1  # a heap entry's kind (a configuration has one entry at a time: keys never tie)
    heap = [(ev.floor_s(c), c.offload != "none", c, floor, i) for i, c in enumerate(configs)]
    heapq.heapify(heap)
    scored: dict[int, Scored] = {}
    fitting, judged, fastest, seen = [], 0, None, set()
    while heap and len(fitting) < top_k:
        _, _, c, kind, i = heapq.heappop(heap)
        if kind == floor:
            if fastest is None or states[i] <= problem.budget:
                scored[i] = Scored(c, ev.step(c), states[i])
                heapq.heappush(heap, (scored[i].step.step_s, c.offload != "none", c, timed, i))
            continue
        s = scored[i]
        fastest = fastest or s
        key = (replace(c, bucket_cap_mb=None), s.step.step_s, s.state_bytes)  # a bucket size that changes nothing
        if c.bucket_cap_mb is not None and key in seen:
            continue
        seen.add(key)
        if s.state_bytes > problem.budget or ev.floor_bytes(c) > problem.budget:
            continue
        judged += 1
        if ev.judge(s)["fits"]:
            fitting.append(s)
    return Result(fitting, len(configs), judged, fastest, problem.world_size, timed=len(scored))
