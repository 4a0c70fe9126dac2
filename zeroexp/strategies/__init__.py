"""The strategy axis: a registry of small adapters, one module per strategy family.

Adding a strategy is one Python file in this package (a :class:`StrategyAdapter` subclass decorated with
:func:`register`), its schema's entry in :mod:`zeroexp.cell.strategy` and one YAML file in ``conf/strategy/``.
Modules here are discovered automatically. Importing this package imports no adapter (and so no torch): the
registry is filled on first use, and :class:`StrategyAdapter` is read from ``base`` when asked for.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroexp.strategies.base import StrategyAdapter

__all__ = ["StrategyAdapter", "register", "registered", "get_adapter_class"]

_REGISTRY: dict[str, type[StrategyAdapter]] = {}
_DISCOVERED = False


def __getattr__(name: str) -> Any:
    if name == "StrategyAdapter":
        from zeroexp.strategies.base import StrategyAdapter

        return StrategyAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(cls: type[StrategyAdapter]) -> type[StrategyAdapter]:
    """Class decorator: make ``cls`` selectable as ``strategy=<cls.name>``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy {cls.name!r} registered twice ({_REGISTRY[cls.name].__name__}, {cls.__name__})")
    from zeroexp.cell.strategy import SCHEMAS

    if SCHEMAS.get(cls.name) is not cls.schema:
        raise ValueError(f"strategy {cls.name!r}: its schema {cls.schema.__name__} is not its entry in "
                         "zeroexp.cell.strategy.SCHEMAS")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    global _DISCOVERED
    if not _DISCOVERED:
        for info in pkgutil.iter_modules(__path__):
            if not info.name.startswith("_") and info.name not in ("base", "schemas"):
                importlib.import_module(f"{__name__}.{info.name}")
        _DISCOVERED = True


def registered() -> dict[str, type[StrategyAdapter]]:
    """Every registered strategy name and its adapter class."""
    _discover()
    return dict(_REGISTRY)


def get_adapter_class(name: str) -> type[StrategyAdapter]:
    """The adapter class registered as ``name``; ``KeyError`` naming the accepted names otherwise."""
    reg = registered()
    if name not in reg:
        raise KeyError(f"unknown strategy {name!r}; registered: {', '.join(sorted(reg))}")
    return reg[name]
