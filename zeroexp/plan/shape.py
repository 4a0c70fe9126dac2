"""A model's shape for the planner, read on the meta device: no parameter is allocated, whatever its size."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from zeroexp.formulas import ModelShape
from zeroexp.models import build_model, import_class, loss_of, zeros_batch

__all__ = ["model_shape", "shape_of", "ready_order"]


def shape_of(net: nn.Module, wrap: Iterable[type[nn.Module]] = (), ready: tuple[int, ...] | None = None) -> ModelShape:
    """The parameters and FSDP units of ``net`` as zeroexp's FSDP adapters wrap it (``ModuleWrapPolicy``).

    Units are formed bottom-up, children before parents (FSDP's ``_recursive_wrap``): each module of a ``wrap``
    class takes the parameters in its subtree that no unit below it took, in ``named_modules`` order (the
    FlatParameter's); the root unit (the LightningModule around ``net``) takes the rest. ``ready``: the gradient-
    ready order (:func:`ready_order`), when traced.
    """
    classes, params = tuple(wrap), list(net.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    taken: set[int] = set()
    units: list[tuple[int, ...]] = []
    roots: list[bool] = []

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

    visit(net)
    if rest := take(net):
        units.append(rest)
        roots.append(True)
    own = [tuple(index[id(p)] for p in m.parameters(recurse=False)) for m in _post_order(net)]
    return ModelShape(tuple(tuple(p.shape) for p in params), tuple(units), tuple(roots), ready=ready,
                      modules=tuple(m for m in own if m))


def _post_order(module: nn.Module) -> list[nn.Module]:
    """Every submodule of ``module`` (itself included), children before parents, in definition order."""
    return [m for child in module.children() for m in _post_order(child)] + [module]


def ready_order(net: nn.Module, model_cfg: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The order in which the parameters' gradients become ready in one backward of ``net`` (on the meta device: one
    sample of ``model.input_shape``, the model's loss), as DDP's Reducer records it to rebuild its buckets: each
    parameter's post-accumulate-grad hook fires once, after its last contribution (a tied weight too). None when the
    module's forward does not run on the meta device (then reverse definition order is assumed)."""
    params = list(net.parameters())
    index, order = {id(p): i for i, p in enumerate(params)}, []
    hooks = [p.register_post_accumulate_grad_hook(lambda t: order.append(index[id(t)])) for p in params
             if p.requires_grad]
    try:
        batch = zeros_batch(model_cfg, 1, device="meta")
        loss_of(model_cfg)(net(batch), batch).backward()
    except Exception:  # noqa: BLE001 - a module whose forward needs real data: fall back, do not fail the plan
        return None
    finally:
        for h in hooks:
            h.remove()
    return tuple(order) if len(order) == len(hooks) else None


#: model_shape's answers in this process, by its arguments (a finalize asks twice: the byte plan and the time plan).
_SHAPES: dict[str, ModelShape] = {}


def model_shape(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> ModelShape:
    """Build the model config's module on the meta device and read its shape, FSDP units cut by ``wrap`` (import
    paths), gradient-ready order traced by one meta-device backward. Built once per process for the same arguments
    (a ModelShape is immutable)."""
    wrap = tuple(wrap)
    try:
        from omegaconf import DictConfig, OmegaConf

        key = repr((OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig)
                    else model_cfg, wrap))
    except Exception:  # noqa: BLE001 - not expressible as text: not remembered
        key = None
    if key is not None and key in _SHAPES:
        return _SHAPES[key]
    classes = [import_class(p) for p in wrap]
    with torch.device("meta"):
        net = build_model(model_cfg)
    shape = shape_of(net, classes, ready_order(net, model_cfg))
    if key is not None:
        if len(_SHAPES) >= 64:  # a long-lived process (the planner over many models): the oldest goes
            _SHAPES.pop(next(iter(_SHAPES)))
        _SHAPES[key] = shape
    return shape
