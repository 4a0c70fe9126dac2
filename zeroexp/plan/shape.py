"""A model's shape for the planner, read on the meta device: no parameter is allocated, whatever its size."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from zeroexp._lib.modules import conv_base
from zeroexp.formulas import ModelShape, next_reached
from zeroexp.models import build_model, import_class, loss_of, requires_grad, zeros_batch

__all__ = ["model_shape", "shape_of", "trace_units", "ready_order", "arguments_key", "remember"]


def shape_of(net: nn.Module, wrap: Iterable[type[nn.Module]] = (), ready: tuple[int, ...] | None = None,
             model_cfg: Mapping[str, Any] | None = None) -> ModelShape:
    """The parameters and FSDP units of ``net`` as zeroexp's FSDP adapters wrap it (``ModuleWrapPolicy``).

    Units are formed bottom-up, children before parents (FSDP's ``_recursive_wrap``): each module of a ``wrap``
    class takes the parameters in its subtree that no unit below it took, in ``named_modules`` order (the
    FlatParameter's); the root unit (the LightningModule around ``net``) takes the rest. Which parameters train
    (``requires_grad``) is read off them. With ``model_cfg``, one step is traced (:func:`trace_units`): the
    gradient-ready order, each unit's forward calls and whether backward reaches it; else ``ready`` is taken.
    """
    classes, params = tuple(wrap), list(net.parameters())
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
    own = [tuple(index[id(p)] for p in m.parameters(recurse=False)) for m in _post_order(net)]
    trains = tuple(p.requires_grad for p in params)
    calls: tuple[int, ...] = ()
    backward: tuple[bool, ...] = ()
    after: tuple[bool, ...] = ()
    traced = False
    if model_cfg is not None:
        ready, calls, backward, after = trace_units(net, model_cfg, unit_modules)
        traced = ready is not None
    unused = tuple(i for i, p in enumerate(params) if p.requires_grad and i not in set(ready)) if traced else ()
    return ModelShape(tuple(tuple(p.shape) for p in params), tuple(units), tuple(roots), ready=ready,
                      modules=tuple(m for m in own if m), trains=() if all(trains) else trains,
                      unit_calls=calls, unit_backward=backward, unit_next_reached=after,
                      buffers=tuple((str(b.dtype).removeprefix("torch."), b.numel() * b.element_size())
                                    for b in net.buffers()), unused=unused,
                      opaque=tuple(sorted({type(m).__name__ for m in net.modules()
                                           if isinstance(m, (conv_base(), nn.RNNBase))})))


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Every submodule of ``module`` (itself included), children before parents, in definition order."""
    return [m for child in module.children() for m in _post_order(child)] + [module]


def trace_units(net: nn.Module, model_cfg: Mapping[str, Any], units: list[nn.Module] = ()
               ) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[bool, ...], tuple[bool, ...]]:
    """One step of ``net`` on the meta device (one sample of ``model.input_shape``, the model's loss): the order in
    which the trainable parameters' gradients become ready (as DDP's Reducer records it to rebuild its buckets: each
    parameter's post-accumulate-grad hook fires once, after its last contribution, a tied weight too; one a step
    gives no gradient is not in it), and for each of ``units`` its forward calls, whether its output requires grad
    (backward reaches it) and whether backward reaches the unit after it in forward order. None and empty when the
    module's step does not run on the meta device (then reverse definition order, one call per unit and backward
    through each are assumed)."""
    params = list(net.parameters())
    index, order = {id(p): i for i, p in enumerate(params)}, []
    calls, backward, finished = [0] * len(units), [False] * len(units), []

    def seen(k: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            calls[k] += 1
            backward[k] = backward[k] or requires_grad(output)
            finished.append(k)
        return hook

    hooks = [p.register_post_accumulate_grad_hook(lambda t: order.append(index[id(t)])) for p in params
             if p.requires_grad]
    hooks += [m.register_forward_hook(seen(k)) for k, m in enumerate(units)]
    try:
        batch = zeros_batch(model_cfg, 2, device="meta")  # two samples: BatchNorm needs more than one
        loss = loss_of(model_cfg)(net(batch), batch)
        if loss.requires_grad:
            loss.backward()
    except Exception:  # noqa: BLE001 - a module whose forward needs real data: fall back, do not fail the plan
        return None, (), (), ()
    finally:
        for h in hooks:
            h.remove()
    return tuple(order), tuple(calls), tuple(backward), next_reached(finished, backward)


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


def remember(answers: dict[str, Any], key: str | None, value: Any, most: int = 64) -> Any:
    """Keep ``value`` under ``key`` in ``answers`` (a long-lived process, the planner over many models, keeps the
    ``most`` newest); return it."""
    if key is not None:
        if len(answers) >= most:
            answers.pop(next(iter(answers)))
        answers[key] = value
    return value


#: model_shape's answers in this process, by its arguments (a finalize asks twice: the byte plan and the time plan).
_SHAPES: dict[str, ModelShape] = {}


def model_shape(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> ModelShape:
    """Build the model config's module on the meta device and read its shape, FSDP units cut by ``wrap`` (import
    paths), gradient-ready order traced by one meta-device backward. Built once per process for the same arguments
    (a ModelShape is immutable)."""
    wrap = tuple(wrap)
    key = arguments_key(model_cfg, wrap)
    if key is not None and key in _SHAPES:
        return _SHAPES[key]
    classes = [import_class(p) for p in wrap]
    with torch.device("meta"):
        net = build_model(model_cfg)
    return remember(_SHAPES, key, shape_of(net, classes, model_cfg=model_cfg))
