"""Lightning callbacks made where they run: a class with Lightning's hook names (a probe, the fault injector) that
imports no Lightning, so the launching process reads it (a probe's digest line and report table, the fault switch's
name) without importing Lightning; a rank, or the dry run, instantiates :func:`as_callback` of it. A leaf: it imports
nothing of zeroexp."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["as_callback"]


@functools.cache
def as_callback(cls: type) -> type:
    """The Lightning callback class of ``cls``: ``cls`` first, then ``lightning.pytorch.Callback`` (whose no-op hooks
    serve the hooks ``cls`` does not define). Made once per class, in the process that runs cells (a rank, a dry
    run); an instance is an instance of ``cls`` too, and pickles as one of this class (rebuilt through
    ``as_callback``: the class itself is found under ``cls``'s name, which names ``cls``)."""
    import lightning.pytorch as pl

    def __reduce__(self: Any) -> tuple[Any, ...]:
        return _rebuild_callback, (cls, self.__dict__)

    return type(cls.__name__, (cls, pl.Callback), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                   "__doc__": cls.__doc__, "__reduce__": __reduce__})


def _rebuild_callback(cls: type, state: dict[str, Any]) -> Any:
    """Unpickle an instance of ``as_callback(cls)``."""
    made = as_callback(cls)
    obj = made.__new__(made)
    obj.__dict__.update(state)
    return obj
