"""One training step of the bare model traced under ``FakeTensorMode``: the live bytes at every unit boundary.

The peak model (:mod:`zeroexp.formulas.peak.phases`) adds to this what a strategy holds (unsharded units, gradient
shards,
buckets, the optimizer's temporaries). What the trace gives is what every strategy shares: the activations the forward
saves and the transients of its ops, the loss, and in backward the gradients of activations and of the parameters as
autograd produces them. Nothing is allocated: the model is built and run on fake tensors of the cell's device (not the
meta device: attention's math path there saves the s^2 probabilities where the CPU and CUDA kernels save a logsumexp),
and ``torch.distributed._tools.MemTracker`` follows their storages exactly as the memory probe follows real ones.

The step is the training step zeroexp runs (``zeroexp.models.module``): forward, the loss, Lightning's detached copy
of the
loss (``ClosureResult``), backward. Segments end at each unit's forward pre/post hook and backward pre/post hook, at
the loss and at the end of backward; each records the peak inside it and the bytes live at its end, by category
(MemTracker's: parameter gradients are ``gradients``, what backward allocates besides is ``temporaries``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from zeroexp.formulas.peak.allocator import counted
from zeroexp.formulas.peak.phases import Segment, StepTrace, TracedUnit
from zeroexp._lib.memtrack import step_mem_tracker, totals
from zeroexp._lib.modules import own_buffers, own_parameters

__all__ = ["trace_step", "trace_steps", "trace_step_of", "trace_steps_of"]


def trace_step(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), device: str = "cpu",
               dtype: torch.dtype | None = None, checkpointing: Any = False,
               grads_in_place: bool = False, own_params_units: bool = False,
               module_dtype: torch.dtype | None = None, root_unit: bool = False, block: int = 1) -> StepTrace:
    """Trace one step of the model config's module at ``batch_size`` samples of ``model.input_shape`` on fake tensors
    of ``device``; units are the modules of a ``wrap`` class (FSDP's units; every strategy is segmented the same
    way), or, with ``own_params_units``, every module that holds parameters of its own (DeepSpeed stage 3 gathers and
    releases parameters module by module); then the trace also records each unit's parameters, whether its input
    required grad and whether its output did (``StepTrace.units``). ``root_unit``: where no module of a ``wrap`` class
    is found, the model itself is the one unit (named ``<model>``: FSDP wraps such a model as one unit). ``dtype``:
    the compute dtype (autocast; None or fp32: the model's own).
    ``module_dtype``: the module's floating parameters and buffers cast to it before the step and the floating input
    cast to it inside the step, as a strategy that computes in a low precision does (DeepSpeed's bf16 engine converts
    the module; FSDP's ``MixedPrecision`` / ``MixedPrecisionPolicy``, zeroexp's ZeRO;
    :func:`zeroexp.formulas.peak.precision.trace_dtypes` says which for a cell). ``checkpointing``: each
    unit ``checkpointing`` names (a :class:`~zeroexp.formulas.peak.checkpointing.Checkpointing`; True: ``full``) in
    torch's non-reentrant ``checkpoint_wrapper``, as the strategies apply it (:func:`zeroexp.models.checkpoint_units`,
    ``selective_op`` with its policy): forward keeps each such unit's input (and what its policy saves), and the
    unit's backward segment holds its recompute (the unit's forward hooks that fire again inside backward end no
    segment). ``grads_in_place``: every parameter's ``.grad`` exists before
    the step (views of one zeroed flat buffer, part of the step's start), so autograd adds into it in place and
    backward allocates no gradient: the step of a flow whose gradients live across the step (zeroexp's ZeRO-1/2
    buckets, a later micro-batch of ``grad_accum``). Without checkpointing its segments are the plain trace's less its
    gradients (measured on the GPT); with it, where the incoming gradients are freed moves the recompute's peak.
    ``block``: each storage counted in blocks of that many bytes (512: CUDA's allocated bytes,
    :func:`zeroexp.formulas.peak.allocator.counted`; 1: the CPU's), the loss too."""
    return trace_steps(model_cfg, batch_size, wrap, device, dtype, checkpointing, grads_in_place,
                       ((own_params_units, root_unit),), module_dtype, block)[0]


def trace_steps(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), device: str = "cpu",
                dtype: torch.dtype | None = None, checkpointing: Any = False, grads_in_place: bool = False,
                units: tuple[tuple, ...] = ((False, False),), module_dtype: torch.dtype | None = None,
                block: int = 1) -> tuple[StepTrace, ...]:
    """:func:`trace_step` once per ``(own_params_units, root_unit)`` or ``(own_params_units, root_unit, block)`` of
    ``units`` (a pair counted in ``block``-byte blocks), from one run of the step where they cannot differ (its ops and
    tensors are the same whatever the segments and blocks): each segmentation's marks cut the run's peak into finer
    intervals, and a segment's peak is the first highest of the intervals it spans (as MemTracker raises its peak only
    on a higher total); each block size has its own tracker, entered around the same run. A unit whose call has more
    than one input requiring grad holds its inputs' gradients until the last (``register_multi_grad_hook``): a
    segmentation with such a unit is traced in a run of its own."""
    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp.models import unit_classes, zeros_batch

    classes = unit_classes(wrap)
    units = tuple((bool(u[0]), bool(u[1]), int(u[2]) if len(u) > 2 else int(block)) for u in units)
    with fake_tensor_mode(), torch.device(device):
        net = _step_module(model_cfg, device, classes, module_dtype, checkpointing)
        names = {id(m): name or "root" for name, m in net.named_modules()}
        batch = zeros_batch(model_cfg, batch_size)
        if grads_in_place:
            _give_flat_grads([p for p in net.parameters() if p.requires_grad])
        clocks: dict[int, _Clock] = {}
        for b in dict.fromkeys(u[2] for u in units):  # one tracker per block size, in the order first asked
            mt = step_mem_tracker(b)
            mt.track_external(net, batch)
            clocks[b] = _Clock(mt, device)
        index = {id(p): i for i, p in enumerate(net.parameters())}
        marks = [_Marks(clocks[b], index, own) for own, _, b in units]
        hooks = []
        for m, (own, root, _) in zip(marks, units):
            seg_names = dict(names)
            hooks += m.hook(_units(net, seg_names, classes, own, root), seg_names)
        try:
            loss = _run_step(net, batch, model_cfg, list(clocks.values()), device, dtype, module_dtype)
        finally:
            for h in hooks:
                h.remove()
    if len(units) > 1 and any(c.several_inputs for c in clocks.values()):
        return tuple(trace_steps(model_cfg, batch_size, classes, device, dtype, checkpointing, grads_in_place, (u,),
                                 module_dtype)[0] for u in units)
    nbytes = loss.untyped_storage().nbytes()  # the closure's copy kept to the next forward: one loss
    return tuple(StepTrace(batch_size=int(batch_size), segments=tuple(m.segments), loss_bytes=counted(nbytes, b),
                           seed_bytes=counted(nbytes, b), units=tuple(m.seen.values()),
                           recomputes=tuple(m.recomputes))
                 for m, (_, _, b) in zip(marks, units))


def trace_step_of(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), **kwargs: Any
                  ) -> StepTrace:
    """:func:`trace_steps_of` for one ``(own_params_units, root_unit)``."""
    units = ((bool(kwargs.pop("own_params_units", False)), bool(kwargs.pop("root_unit", False))),)
    return trace_steps_of(model_cfg, batch_size, wrap, units=units, **kwargs)[0]


def trace_steps_of(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), **kwargs: Any
                   ) -> tuple[StepTrace, ...]:
    """:func:`trace_steps`; for a model that declares a stack of identical blocks deeper than
    ``zeroexp.plan.stack.DERIVED_ABOVE``, each step derived from its steps at ``zeroexp.plan.stack.STEP_DEPTHS``
    blocks (``zeroexp.plan.stack.derived_step``: exact, checked at the third), or traced whole where they do not
    check. A step's fake-tensor trace costs about the same per block whatever the block's width (an 80-block GPT ~5 s
    here, its three shallow steps ~1 s)."""
    from zeroexp.plan.forked import fork_map
    from zeroexp.plan.stack import STEP_DEPTHS, at_depth, derived_step, stack_of

    from zeroexp.formulas.peak.checkpointing import mode_of

    units = kwargs.pop("units", ((False, False),))
    stack = stack_of(model_cfg)
    if mode_of(kwargs.get("checkpointing")).mode == "selective_layer":  # its blocks differ (every k-th checkpointed)
        stack = None
    if stack is None:
        return trace_steps(model_cfg, batch_size, wrap, units=units, **kwargs)
    argument, container, depth = stack
    shallow = fork_map(lambda d: trace_steps(at_depth(model_cfg, argument, d), batch_size, wrap, units=units,
                                             **kwargs), STEP_DEPTHS)  # side by side where there are cores
    derived = [derived_step(*(s[k] for s in shallow), depth, container) for k in range(len(units))]
    return tuple(d if d is not None else trace_steps(model_cfg, batch_size, wrap, units=(u,), **kwargs)[0]
                 for d, u in zip(derived, units))


def _step_module(model_cfg: Mapping[str, Any], device: str, classes: tuple[type, ...],
                 module_dtype: torch.dtype | None, checkpointing: Any) -> torch.nn.Module:
    """The model config's module on fake tensors, its floating parameters and buffers cast to ``module_dtype``, and
    with ``checkpointing`` each module of a ``classes`` class checkpointed (:func:`trace_step`)."""
    from zeroexp.formulas.peak.checkpointing import mode_of
    from zeroexp.models import checkpoint_units

    net = _fake_module(model_cfg, device)
    if module_dtype not in (None, torch.float32):  # as the strategy casts them (``.data``: fake tensors swap not)
        for t in [*net.parameters(), *net.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(module_dtype)
    if checkpointing and classes:
        checkpoint_units(net, classes, mode_of(checkpointing))
    return net


def _give_flat_grads(params: list[torch.nn.Parameter]) -> None:
    """Give every parameter of ``params`` a ``.grad``: views of one zeroed flat buffer (``grads_in_place``)."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype if params else None)
    for p, view in zip(params, flat.split([p.numel() for p in params])):
        p.grad = view.view_as(p)


def _units(net: torch.nn.Module, names: dict[int, str], classes: tuple[type, ...], own_params_units: bool,
           root_unit: bool) -> list[torch.nn.Module]:
    """The traced units of ``net`` (:func:`trace_step`): the modules of a ``classes`` class, or with
    ``own_params_units`` every module holding parameters of its own; with ``root_unit`` and none found, ``net``
    itself, named ``<model>`` in ``names``."""
    units = [m for m in net.modules() if (any(True for _ in m.parameters(recurse=False)) if own_params_units
                                          else classes and isinstance(m, classes))]
    if root_unit and not units:
        units, names[id(net)] = [net], "<model>"
    return units


class _Clock:
    """The run's peak cut at every mark of every segmentation (:func:`trace_steps`): each tick folds the interval's
    peak into each segmentation's (:meth:`_Marks.fold`) and starts the next; ``several_inputs``: a unit's call had
    more than one input requiring grad."""

    def __init__(self, mt: Any, device: str) -> None:
        self.mt, self.device, self.marks = mt, device, []
        self.base: tuple[int, dict[str, int]] | None = None  # the step's start: parameters and the batch
        self.in_backward = False
        self.several_inputs = False

    def start(self) -> None:
        """The step's start (inside the entered tracker): the bytes every segment is counted above."""
        self.base = totals(self.mt.get_tracker_snapshot("current"), self.device)
        self.mt.reset_peak()

    def tick(self) -> tuple[int, dict[str, int]]:
        """End the interval: its peak folded into every segmentation's; the bytes live now."""
        peak = totals(self.mt.get_tracker_snapshot("peak"), self.device)
        for m in self.marks:
            m.fold(peak)
        self.mt.reset_peak()
        return totals(self.mt.get_tracker_snapshot("current"), self.device)

    def mark(self, phase: str, unit: str, at: str) -> None:
        """A mark of every segmentation (the loss, backward's end)."""
        for m in self.marks:
            m.mark(phase, unit, at)


class _Marks:
    """The segments of one traced step: a mark ends one (its peak and the bytes live at its end, above the step's
    start, by category) and starts the next; the units' forward hooks mark their forward and arm their backward
    marks (:func:`_mark_backward`), and with ``own_params_units`` record each unit (``seen``)."""

    def __init__(self, clock: _Clock, index: dict[int, int], own_params_units: bool) -> None:
        self.clock, self.index, self.own_params_units = clock, index, own_params_units
        clock.marks.append(self)
        self.segments: list[Segment] = []
        self.recomputes: list[Segment] = []  # StepTrace.recomputes (own_params_units)
        self.high: tuple[int, dict[str, int]] | None = None  # the peak since this segmentation's last mark
        self.since: tuple[int, dict[str, int]] | None = None  # the peak since its last mark or recompute mark
        self.recomputed = False  # a recompute mark since the last mark
        self.seen: dict[str, TracedUnit] = {}
        self.inputs: dict[str, list[torch.Tensor]] = {}  # each call's inputs that require grad, till its forward ends

    def fold(self, peak: tuple[int, dict[str, int]]) -> None:
        if self.high is None or peak[0] > self.high[0]:  # the first highest, as MemTracker keeps it
            self.high = peak
        if self.since is None or peak[0] > self.since[0]:
            self.since = peak

    def mark(self, phase: str, unit: str, at: str) -> None:
        clock = self.clock
        if phase == "forward" and clock.in_backward:  # a checkpointed unit's recompute, inside its backward
            if self.own_params_units:  # cut no segment: a recompute segment beside them
                self.recomputes.append(self._segment("recompute", unit, at, clock.tick(), self.since))
                self.since, self.recomputed = None, True
            return
        now = clock.tick()
        if self.recomputed:  # the rest of the segment, after its recompute's last mark
            self.recomputes.append(self._segment("tail", unit, at, now, self.since))
        self.segments.append(self._segment(phase, unit, at, now, self.high))
        self.high = self.since = None
        self.recomputed = False

    def _segment(self, phase: str, unit: str, at: str, now: tuple[int, dict[str, int]],
                 high: tuple[int, dict[str, int]] | None) -> Segment:
        (b, b_cats), (n, n_cats) = self.clock.base, now
        peak, peak_cats = high if high is not None else now
        return Segment(phase, unit, at, peak - b, _less(peak_cats, b_cats), n - b, _less(n_cats, b_cats))

    def pre_forward(self, m: torch.nn.Module, args: tuple, kwargs: dict, u: str) -> None:
        from zeroexp.models import grad_tensors

        if self.own_params_units and u not in self.seen:  # its parameters and whether autograd reaches its input
            self.seen[u] = TracedUnit(u, tuple(self.index[id(p)] for p in m.parameters(recurse=False)),
                                      any(isinstance(t, torch.Tensor) and t.requires_grad for t in args), False)
        if not self.clock.in_backward:  # a recompute's inputs are not held: its forward gets no backward marks
            self.inputs[u] = grad_tensors((args, kwargs))
            self.clock.several_inputs |= len(self.inputs[u]) > 1
        self.mark("forward", u, "start")

    def post_forward(self, output: Any, u: str) -> None:
        from zeroexp.models import grad_tensors, requires_grad

        if self.own_params_units and not self.clock.in_backward and requires_grad(output):  # backward reaches the unit
            self.seen[u] = self.seen[u]._replace(reached=True)
        if not self.clock.in_backward:  # a checkpointed unit's recompute is never differentiated: no backward marks
            _mark_backward(grad_tensors(output), self.inputs.pop(u, []), u, self.mark)
        self.mark("forward", u, "end")

    def hook(self, units: list[torch.nn.Module], names: dict[int, str]) -> list[Any]:
        """Register each unit's forward pre and post hooks; their handles."""
        hooks = []
        for m in units:
            u = names[id(m)]
            hooks += [m.register_forward_pre_hook(lambda m, a, k, u=u: self.pre_forward(m, a, k, u),
                                                  with_kwargs=True),
                      m.register_forward_hook(lambda m, a, o, u=u: self.post_forward(o, u))]
        return hooks


def _run_step(net: torch.nn.Module, batch: torch.Tensor, model_cfg: Mapping[str, Any], clocks: list[_Clock],
              device: str, dtype: torch.dtype | None, module_dtype: torch.dtype | None) -> torch.Tensor:
    """Run the step inside the trackers (each clock's, entered in order): forward (under autocast for a low ``dtype``;
    the floating input cast to ``module_dtype``), the loss, Lightning's detached copy of it, backward, marking the loss
    and backward's end on every clock; the loss."""
    from contextlib import ExitStack, nullcontext

    from zeroexp.models import loss_of

    # Without autocast's weight-cast cache, as Lightning's MixedPrecision plugin runs it (plugins/precision/amp.py:
    # cache_enabled=False): a cast the backward does not need (the first Linear's weight) is freed at once.
    cast = (torch.autocast(device, dtype=dtype, cache_enabled=False) if dtype not in (None, torch.float32)
            else nullcontext())
    with ExitStack() as trackers:
        for clock in clocks:
            trackers.enter_context(clock.mt)
        for clock in clocks:
            clock.start()
        with cast:
            x = batch.to(module_dtype) if module_dtype is not None and batch.is_floating_point() else batch
            out = net(x)
            del x
            loss = loss_of(model_cfg)(out, batch)
        del out  # the step keeps only what autograd saved of the output
        kept = loss.detach().clone()  # Lightning's ClosureResult keeps this copy of the loss
        for clock in clocks:
            clock.mark("forward", "loss", "end")
            clock.in_backward = True
        loss.backward()
        for clock in clocks:
            clock.mark("backward", "root", "end")
        del kept
    return loss


def _mark_backward(outputs: list[torch.Tensor], inputs: list[torch.Tensor], u: str,
                   mark: Callable[[str, str, str], None]) -> None:
    """Mark one call's backward with gradient hooks that hold no tensor, as the strategies' own hooks do (FSDP's
    pre-backward: on its outputs, the first to fire; its post-backward: when every input's gradient is computed): a
    unit's backward starts when autograd is about to run the first node of its outputs and ends when every input that
    requires grad has its gradient, or at once where none does. A unit's start is a node pre-hook, which autograd runs
    after the tensor hooks of the same gradient: where one unit's input is the unit before's output, the later unit
    ends before the earlier one starts. Not ``register_full_backward_hook``: it keeps the gradients of the outputs alive
    to the unit's end, a peak the run does not have (1,920 B of PyTorch's test Transformer at dim 32)."""
    from torch.autograd.graph import register_multi_grad_hook

    nodes = {id(t.grad_fn): t.grad_fn for t in outputs if t.grad_fn is not None}
    if not nodes:  # backward never runs through this call
        return
    ends_at_start = not inputs  # a bool: the hooks must not keep the inputs alive
    started = [False]  # one backward per traced forward

    def start(*_: Any) -> None:
        if not started[0]:
            started[0] = True
            mark("backward", u, "start")
            if ends_at_start:
                mark("backward", u, "end")

    for node in nodes.values():
        node.register_prehook(start)
    if inputs:
        register_multi_grad_hook(inputs, lambda _: mark("backward", u, "end"), mode="all")


def _fake_module(model_cfg: Mapping[str, Any], device: str) -> torch.nn.Module:
    """The model config's module on fake tensors (inside ``FakeTensorMode``). A constructor that reads tensor values
    (``nn.init.trunc_normal_``: ViT and most vision models) cannot run there: it is built on the meta device, where
    initialisation is skipped, and each parameter and buffer then made a fake tensor of its shape (values do not matter
    to a trace of bytes; a parameter two modules share stays one)."""
    from zeroexp._lib.fake_tensors import is_data_dependent
    from zeroexp.models import build_model

    try:
        return build_model(model_cfg)
    except Exception as e:  # noqa: BLE001 - Hydra's instantiate wraps the factory's exception
        cause: BaseException | None = e
        while cause is not None and not is_data_dependent(cause):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        with torch.device("meta"):
            net = build_model(model_cfg)
        made: dict[int, torch.Tensor] = {}  # a parameter two modules share stays one (tied weights)
        for m in net.modules():
            for name, p in list(own_parameters(m).items()):
                if p is not None:
                    if id(p) not in made:
                        made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                         requires_grad=p.requires_grad)
                    own_parameters(m)[name] = made[id(p)]
            for name, b in list(own_buffers(m).items()):
                if b is not None:
                    own_buffers(m)[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
        return net


def _less(cats: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    """``cats`` above ``base``, category by category, zeros left out."""
    return {c: int(b) - base.get(c, 0) for c, b in cats.items() if int(b) != base.get(c, 0)}
