"""A model's shape for the planner, read on the meta device: no parameter is allocated, whatever its size."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from hydra.utils import get_class
from torch import nn

from zeroexp.formulas import ModelShape
from zeroexp.models import build_model

__all__ = ["model_shape", "shape_of"]


def shape_of(net: nn.Module, wrap: Iterable[type[nn.Module]] = ()) -> ModelShape:
    """The parameters and FSDP units of ``net`` as zeroexp's FSDP adapter wraps it (``ModuleWrapPolicy``).

    Units are formed bottom-up, children before parents (FSDP's ``_recursive_wrap``): each module of a ``wrap``
    class takes the parameters in its subtree that no unit below it took, in ``named_modules`` order (the
    FlatParameter's); the root unit (the LightningModule around ``net``) takes the rest.
    """
    classes, taken = tuple(wrap), set()
    units: list[tuple[int, ...]] = []
    roots: list[bool] = []

    def take(module: nn.Module) -> tuple[int, ...]:
        numels = []
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                if id(p) not in taken:
                    taken.add(id(p))
                    numels.append(p.numel())
        return tuple(numels)

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
    return ModelShape(tuple(p.numel() for p in net.parameters()), tuple(units), tuple(roots))


def model_shape(model_cfg: Mapping[str, Any], wrap: Iterable[str] = ()) -> ModelShape:
    """Build the model config's module on the meta device and read its shape; ``wrap``: FSDP unit classes by
    import path (``strategy.wrap``, else ``model.wrap``: zeroexp.strategies.fsdp.wrap_paths)."""
    classes = []
    for path in wrap:
        cls = get_class(str(path))
        if not issubclass(cls, nn.Module):
            raise TypeError(f"{path} is not an nn.Module class")
        classes.append(cls)
    with torch.device("meta"):
        net = build_model(model_cfg)
    return shape_of(net, classes)
