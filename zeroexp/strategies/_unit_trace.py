"""What one training step does with each FSDP unit, observed live: its forward calls and whether backward reaches it.

FSDP gathers a unit once per forward call (again for each call of a module applied twice) and, before backward, once
more where backward reaches it; it reduce-scatters only there. Whether backward reaches a unit is whether its output
requires grad (FSDP and FSDP2 register their pre-backward hooks on such outputs): not for a frozen first layer fed
by data. The planner traces the same on the meta device (``zeroexp.plan.shape.trace_step``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroexp.formulas import next_reached
from zeroexp.models import requires_grad

__all__ = ["UnitTrace"]


class UnitTrace:
    """Forward hooks on the modules that become units and on the root: counts each unit's calls within the root's
    forward (a checkpointed unit's recompute in backward is not a forward call), whether any output required grad,
    and the order the units' forwards finished in. :meth:`of` answers for the last forward."""

    def __init__(self, root: nn.Module, units: list[nn.Module]) -> None:
        self._units = list(dict.fromkeys(units))
        self._index = {id(m): k for k, m in enumerate(self._units)}
        self._calls, self._reached, self._order = [0] * len(self._units), [False] * len(self._units), []
        self._last: dict[int, tuple[int, bool, bool]] = {}
        self._inside = False
        root.register_forward_pre_hook(self._start)
        for m in self._units:
            if m is not root:
                m.register_forward_hook(self._seen)
        root.register_forward_hook(self._end)

    def _start(self, module: nn.Module, args: Any) -> None:
        self._inside = True
        self._calls, self._reached, self._order = [0] * len(self._units), [False] * len(self._units), []

    def _seen(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._inside:
            k = self._index[id(module)]
            self._calls[k] += 1
            self._reached[k] = self._reached[k] or requires_grad(output)
            self._order.append(k)

    def _end(self, module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in self._index:
            self._seen(module, args, output)
        self._inside = False
        after = next_reached(self._order, self._reached)
        self._last = {id(m): (self._calls[k], self._reached[k], after[k]) for k, m in enumerate(self._units)}

    def of(self, module: nn.Module) -> tuple[int, bool, bool] | None:
        """``(forward calls, backward reaches it, backward reaches the unit after it in forward order)`` in the last
        forward; None before the first."""
        return self._last.get(id(module)) if self._last else None
