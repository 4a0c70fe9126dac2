"""A model's shape for the planner, read on the meta device: no parameter is allocated, whatever its size."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from zeroexp._lib.modules import conv_base
from zeroexp.cell.memo import memoized
from zeroexp.cell.resolved import Cell
from zeroexp.formulas import ModelShape, next_reached
from zeroexp.formulas.deepspeed_fetch import ModuleCall
from zeroexp.models import build_model, import_class, loss_of, requires_grad, zeros_batch
from zeroexp.models.calls import CallRecorder

__all__ = ["model_shape", "cell_shape", "shared_across_units", "shape_of", "trace_units", "ready_order",
           "arguments_key"]


def shape_of(net: nn.Module, wrap: Iterable[type[nn.Module]] = (), ready: tuple[int, ...] | None = None,
             model_cfg: Mapping[str, Any] | None = None, derive: bool = True) -> ModelShape:
    """The parameters and FSDP units of ``net`` as zeroexp's FSDP adapters wrap it (``ModuleWrapPolicy``).

    Units are formed bottom-up, children before parents (FSDP's ``_recursive_wrap``): each module of a ``wrap``
    class takes the parameters in its subtree that no unit below it took, in ``named_modules`` order (the
    FlatParameter's); the root unit (the LightningModule around ``net``) takes the rest. Which parameters train
    (``requires_grad``) is read off them. With ``model_cfg``, one step is traced (:func:`trace_units`): the
    gradient-ready order, each unit's forward calls and whether backward reaches it; else ``ready`` is taken. A
    model that declares a stack of identical blocks deeper than ``DERIVED_ABOVE`` has that step derived from its
    steps at three and four blocks (:func:`derived_units`; ``derive=False``: traced whole).
    """
    classes, params = tuple(wrap), list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    units, roots, unit_modules = _units(net, classes)
    own = [tuple(index[id(p)] for p in m.parameters(recurse=False)) for m in _post_order(net)]
    trains = tuple(p.requires_grad for p in params)
    calls: tuple[int, ...] = ()
    backward: tuple[bool, ...] = ()
    after: tuple[bool, ...] = ()
    called: tuple[bool, ...] = ()
    module_calls: tuple[ModuleCall, ...] = ()
    traced = False
    if model_cfg is not None:
        step = derived_units(net, model_cfg, classes, unit_modules) if derive else None
        ready, calls, backward, after, called, module_calls = step or trace_units(net, model_cfg, unit_modules)
        traced = ready is not None
    unused = tuple(i for i, p in enumerate(params) if p.requires_grad and i not in set(ready)) if traced else ()
    uncalled = tuple(i for i, c in enumerate(called) if not c) if traced else ()
    return ModelShape(tuple(tuple(p.shape) for p in params), tuple(units), tuple(roots), ready=ready,
                      modules=tuple(m for m in own if m), trains=() if all(trains) else trains,
                      unit_calls=calls, unit_backward=backward, unit_next_reached=after, module_calls=module_calls,
                      buffers=tuple((str(b.dtype).removeprefix("torch."), b.numel() * b.element_size())
                                    for b in net.buffers()), unused=unused, uncalled=uncalled,
                      opaque=tuple(sorted({type(m).__name__ for m in net.modules()
                                           if isinstance(m, (conv_base(), nn.RNNBase))})),
                      linear_pairs=tuple((index[id(m.weight)], index[id(m.bias)]) for m in net.modules()
                                         if isinstance(m, nn.Linear) and m.bias is not None
                                         and id(m.weight) in index and id(m.bias) in index),
                      aliases=_aliases(net, index),
                      unsaved_buffers=tuple(i for i, (name, _) in enumerate(net.named_buffers())
                                            if name not in net.state_dict(keep_vars=True)))



def _aliases(net: nn.Module, index: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """Each parameter the state dict names more than once (a tied weight), as (its index, its names beyond the
    first)."""
    names: dict[int, int] = {}
    for _, p in net.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), 0) + 1
    return tuple((index[k], c - 1) for k, c in names.items() if c > 1 and k in index)

def _units(net: nn.Module, classes: tuple[type, ...]) -> tuple[list[tuple[int, ...]], list[bool], list[nn.Module]]:
    """(each unit's parameter indices, whether it is the root, its module), as :func:`shape_of` cuts them."""
    params = list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    taken: set[int] = set()
    units: list[tuple[int, ...]] = []
    roots: list[bool] = []
    unit_modules: list[nn.Module] = []

    def take(module: nn.Module) -> tuple[int, ...]:
        members = []
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                if id(p) not in taken:
                    taken.add(id(p))
                    members.append(index[id(p)])
        return tuple(members)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if classes and isinstance(module, classes) and (unit := take(module)):
            units.append(unit)
            roots.append(False)
            unit_modules.append(module)

    visit(net)
    if rest := take(net):
        units.append(rest)
        roots.append(True)
        unit_modules.append(net)
    return units, roots, unit_modules


def derived_units(net: nn.Module, model_cfg: Mapping[str, Any], classes: tuple[type, ...], units: list[nn.Module]
                  ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...], tuple[bool, ...],
                             tuple[bool, ...], tuple[ModuleCall, ...]] | None:
    """:func:`trace_units` of ``net`` (the model config's module) from the same step traced at three and four blocks,
    for a model that declares a stack of identical blocks deeper than ``DERIVED_ABOVE`` (``zeroexp.plan.stack``):
    the gradient-ready order by parameter name, each unit's calls, backward reach and next unit's reach by unit
    name and whether each parameter's module is called by parameter name, grown by ``zeroexp.plan.stack.grow_runs``;
    the three blocks' grown to four must be the four blocks' exactly. None where the model declares none, a shallow
    step does not trace, or the check fails: then the step is traced whole."""
    from zeroexp.plan.stack import at_depth, grow_runs, stack_of

    stack = stack_of(model_cfg)
    if stack is None:
        return None
    argument, container, depth = stack
    steps = {}
    for d in (3, 4):
        cfg = at_depth(model_cfg, argument, d)
        with torch.device("meta"):
            small = build_model(cfg)
        small_units = _units(small, classes)[2]
        step = _named_step(small, trace_units(small, cfg, small_units), small_units)
        if step is None:
            return None
        steps[d] = step
    grown = [grow_runs(records, 4, container) for records in steps[3]]
    if grown != list(steps[4]):
        return None
    ready, per_unit, per_param, per_call = (grow_runs(records, depth, container) for records in steps[3])
    index = {name: i for i, (name, _) in enumerate(net.named_parameters())}
    names = {id(m): name for name, m in net.named_modules()}
    if ready is None or per_unit is None or per_param is None or per_call is None \
            or [n for n, _ in per_unit] != [names[id(m)] for m in units] or any(n not in index for n, _ in ready) \
            or [n for n, _ in per_param] != list(index):
        return None
    return (tuple(index[n] for n, _ in ready), tuple(c for _, (c, _, _) in per_unit),
            tuple(b for _, (_, b, _) in per_unit), tuple(a for _, (_, _, a) in per_unit),
            tuple(c for _, c in per_param), _module_calls(net, per_call))


def _module_calls(net: nn.Module, named: list[tuple[str, tuple[bool, bool, int]]]) -> tuple[ModuleCall, ...]:
    """Module calls by name (:func:`_named_step`) as :class:`ModuleCall`\\ s of ``net``."""
    modules = {name: k for k, (name, _) in enumerate(net.named_modules())}
    index = {id(p): i for i, p in enumerate(net.parameters())}
    own = [tuple(sorted(index[id(p)] for p in m.parameters(recurse=False))) for m in net.modules()]
    return tuple(ModuleCall(modules[n], own[modules[n]], g, r, d) for n, (g, r, d) in named)


def _named_step(net: nn.Module, step: tuple, units: list[nn.Module]) -> tuple[list, list, list] | None:
    """A :func:`trace_units` answer by name: (the gradient-ready order as (parameter name, None), each unit's (name,
    (calls, backward reached, next reached)), each parameter's (name, whether its module is called)); None where the
    step did not trace."""
    ready, calls, backward, after, called, module_calls = step
    if ready is None:
        return None
    params = [name for name, _ in net.named_parameters()]
    names = {id(m): name for name, m in net.named_modules()}
    modules = [name for name, _ in net.named_modules()]
    return ([(params[i], None) for i in ready],
            [(names[id(m)], (c, b, a)) for m, c, b, a in zip(units, calls, backward, after, strict=True)],
            list(zip(params, called, strict=True)),
            [(modules[c.module], (c.grad_input, c.reached, c.depth)) for c in module_calls])


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Every submodule of ``module`` (itself included), children before parents, in definition order."""
    return [m for child in module.children() for m in _post_order(child)] + [module]


def trace_units(net: nn.Module, model_cfg: Mapping[str, Any], units: list[nn.Module] = ()
               ) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[bool, ...], tuple[bool, ...],
                          tuple[bool, ...], tuple[ModuleCall, ...]]:
    """One step of ``net`` on the meta device (one sample of ``model.input_shape``, the model's loss): the order in
    which the trainable parameters' gradients become ready (as DDP's Reducer records it to rebuild its buckets: each
    parameter's post-accumulate-grad hook fires once, after its last contribution, a tied weight too; one a step
    gives no gradient is not in it), and for each of ``units`` its forward calls, whether its output requires grad
    (backward reaches it) and whether backward reaches the unit after it in forward order; and for each parameter
    whether a module holding it as its own is called in forward (DeepSpeed stage 3 fetches no other), and every module
    call of the forward (:class:`~zeroexp.models.calls.CallRecorder`: DeepSpeed stage 3's hooks). None and empty
    when the module's step does not run on the meta device (then reverse definition order, one call per unit and
    backward through each are assumed)."""
    params = list(net.parameters())
    index, order = {id(p): i for i, p in enumerate(params)}, []
    calls, backward, finished, called = [0] * len(units), [False] * len(units), [], set()

    def seen(k: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            calls[k] += 1
            backward[k] = backward[k] or requires_grad(output)
            finished.append(k)
        return hook

    recorder = CallRecorder(net)
    hooks = [p.register_post_accumulate_grad_hook(lambda t: order.append(index[id(t)])) for p in params
             if p.requires_grad]
    hooks += [m.register_forward_hook(seen(k)) for k, m in enumerate(units)]
    hooks += [m.register_forward_pre_hook(lambda m, args: called.update(id(p) for p in m.parameters(recurse=False)))
              for m in net.modules() if any(True for _ in m.parameters(recurse=False))]
    try:
        batch = zeros_batch(model_cfg, 2, device="meta")  # two samples: BatchNorm needs more than one
        loss = loss_of(model_cfg)(net(batch), batch)
        module_calls = recorder.take()
        if loss.requires_grad:
            loss.backward()
    except Exception:  # noqa: BLE001 - a module whose forward needs real data: fall back, do not fail the plan
        return None, (), (), (), (), ()
    finally:
        recorder.remove()
        for h in hooks:
            h.remove()
    return (tuple(order), tuple(calls), tuple(backward), next_reached(finished, backward),
            tuple(id(p) in called for p in params), module_calls)


def ready_order(net: nn.Module, model_cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The gradient-ready order of one traced step (:func:`trace_units`)."""
    return trace_units(net, model_cfg)[0]


def arguments_key(*parts: Any) -> str | None:
    """A pure function's arguments as text, to remember its answer by: a DictConfig as its resolved container, a
    class as its import path (None where the arguments cannot be expressed: such an answer is not remembered)."""
    from omegaconf import DictConfig, OmegaConf

    def plain(x: Any) -> Any:
        if isinstance(x, DictConfig):
            return OmegaConf.to_container(x, resolve=True)
        if isinstance(x, type):
            return f"{x.__module__}.{x.__qualname__}"
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    try:
        return repr([plain(x) for x in parts])
    except Exception:  # noqa: BLE001
        return None


def model_shape(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> ModelShape:
    """Build the model config's module on the meta device and read its shape, FSDP units cut by ``wrap`` (import
    paths), gradient-ready order traced by one meta-device backward. Built once per invocation for the same
    arguments (zeroexp.cell.memo; a ModelShape is immutable)."""
    wrap = tuple(wrap)

    def compute() -> ModelShape:
        classes = [import_class(p) for p in wrap]
        with torch.device("meta"):
            net = build_model(model_cfg)
        return shape_of(net, classes, model_cfg=model_cfg)

    return memoized("model_shapes", arguments_key(model_cfg, wrap), compute)


def cell_shape(cell: Cell) -> ModelShape:
    """The cell's model shape: the one validation read (``Cell.shape``), else read now (:func:`model_shape`); for a
    row that computes under ``torch.autocast`` (its family's precision terms: DDP's, below fp32), the gradient-ready
    order is the one of a step under autocast (:func:`autocast_ready`)."""
    from dataclasses import replace

    shape = cell.shape if cell.shape is not None else model_shape(cell.model, cell.wrap)
    row = cell.row
    terms = row.family.precision_terms(row, cell.precision, cell.policy.precision.param_dtype, cell.itemsize)
    if terms is None or terms.autocast is None or not shape.exact or shape.ready is None:
        return shape
    ready = autocast_ready(cell.model, terms.autocast)
    return replace(shape, ready=ready) if ready is not None and sorted(ready) == sorted(shape.ready) else shape


def autocast_ready(model_cfg: Mapping[str, Any], dtype: str) -> tuple[int, ...] | None:
    """The gradient-ready order of one step under ``torch.autocast("cpu", dtype)``, on fake CPU tensors (autocast
    does not reach the meta device): each autocast cast is a node of its own in backward, so a Linear's weight
    gradient is ready before its bias's where the fp32 step readies the bias first (DDP rebuilds its buckets in this
    order). None where the step does not run on fake tensors. Remembered for the invocation."""
    def compute() -> tuple[int, ...] | None:
        from zeroexp._lib.fake_tensors import fake_tensor_mode

        with fake_tensor_mode(), torch.device("cpu"):
            net = build_model(model_cfg)
            params = list(net.parameters())
            index, order = {id(p): i for i, p in enumerate(params)}, []
            hooks = [p.register_post_accumulate_grad_hook(lambda t: order.append(index[id(t)])) for p in params
                     if p.requires_grad]
            try:
                batch = zeros_batch(model_cfg, 2)
                with torch.autocast("cpu", dtype=getattr(torch, dtype)):
                    loss = loss_of(model_cfg)(net(batch), batch)
                if loss.requires_grad:
                    loss.backward()
            except Exception:  # noqa: BLE001 - a step that needs real data: the meta step's order stands
                return None
            finally:
                for h in hooks:
                    h.remove()
        return tuple(order)

    return memoized("model_shapes", arguments_key("autocast_ready", model_cfg, dtype), compute)


def shared_across_units(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> list[tuple[str, ...]]:
    """The parameters of the model config's module (built on the meta device) that modules of more than one FSDP
    unit hold, ``wrap`` (import paths) cutting the units as :func:`shape_of` does (a module's unit: the nearest wrap
    class around it, itself included, else the root): each one's names, one for each module that holds it (a GPT's
    ``lm_head.weight`` tied to ``transformer.wte.weight``, the head a unit of ``nn.Linear``). Empty: none."""
    classes = tuple(import_class(p) for p in wrap)
    with torch.device("meta"):
        net = build_model(model_cfg)
    holders: dict[int, dict[str, int]] = {}  # a parameter's id: each holding module's name of it, and its unit's id

    def visit(module: nn.Module, prefix: str, unit: int) -> None:
        unit = id(module) if classes and isinstance(module, classes) else unit
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), recurse=False):
            holders.setdefault(id(p), {})[name] = unit
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", unit)

    visit(net, "", id(net))
    return [tuple(names) for names in holders.values() if len(set(names.values())) > 1]
