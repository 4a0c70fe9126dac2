"""A model's shape for the planner, read on the meta device: no parameter is allocated, whatever its size."""

from __future__ import annotations

import importlib
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from zeroexp.formulas import ModelShape
from zeroexp.models import build_model

__all__ = ["model_shape", "shape_of", "wrap_classes"]


def shape_of(net: nn.Module, wrap: Iterable[type[nn.Module]] = ()) -> ModelShape:
    """The parameters and FSDP units of ``net`` as zeroexp's FSDP adapters wrap it (``ModuleWrapPolicy``).

    Units are formed bottom-up, children before parents (FSDP's ``_recursive_wrap``): each module of a ``wrap``
    class takes the parameters in its subtree that no unit below it took, in ``named_modules`` order (the
    FlatParameter's); the root unit (the LightningModule around ``net``) takes the rest.
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
    return ModelShape(tuple(tuple(p.shape) for p in params), tuple(units), tuple(roots))


def wrap_classes(paths: Iterable[str]) -> list[type[nn.Module]]:
    """The FSDP unit classes named by import path (``strategy.wrap``, else ``model.wrap``: see
    zeroexp.strategies.fsdp.wrap_paths); raises ImportError, AttributeError or TypeError for a bad one."""
    classes = []
    for path in paths:
        module, _, name = str(path).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"{path} is not an nn.Module class")
        classes.append(cls)
    return classes


def model_shape(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> ModelShape:
    """Build the model config's module on the meta device and read its shape, FSDP units cut by ``wrap``."""
    classes = wrap_classes(wrap)
    with torch.device("meta"):
        net = build_model(model_cfg)
    return shape_of(net, classes)
