"""The module calls of a step as DeepSpeed stage 3's hooks see them (every module of a root, each forward call), for
its fetch schedule (:mod:`zeroexp.formulas.deepspeed_fetch`): read live by the DeepSpeed adapter, traced on the meta
device by the planner (:func:`zeroexp.plan.shape.trace_units`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroexp.formulas.deepspeed_fetch import ModuleCall
from zeroexp.models.build import grad_tensors

__all__ = ["CallRecorder"]


class CallRecorder:
    """Hooks on every module of ``root`` (``root`` included) recording each forward call as a
    :class:`~zeroexp.formulas.deepspeed_fetch.ModuleCall`: the module's index in ``root.modules()``, its own
    parameters' indices in ``root.parameters()``, whether an input needs a gradient (DeepSpeed's post-backward hook) and
    whether its output does (its pre-backward hook), its nesting depth. ``paused``: calls are not recorded (the
    recompute of a checkpointed module inside backward)."""

    def __init__(self, root: nn.Module) -> None:
        index = {id(p): i for i, p in enumerate(root.parameters())}
        self.calls: list[ModuleCall] = []
        self.paused = False
        self._open: list[int] = []
        self._hooks: list[Any] = []
        for m, module in enumerate(root.modules()):
            own = tuple(sorted(index[id(p)] for p in module.parameters(recurse=False)))
            self._hooks.append(module.register_forward_pre_hook(self._pre(m, own), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._post()))

    def _pre(self, m: int, own: tuple[int, ...]) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.paused:
                return
            self._open.append(len(self.calls))
            self.calls.append(ModuleCall(m, own, bool(grad_tensors((args, kwargs))), False, len(self._open) - 1))
        return hook

    def _post(self) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.paused or not self._open:
                return
            k = self._open.pop()
            self.calls[k] = self.calls[k]._replace(reached=bool(grad_tensors(output)))
        return hook

    def take(self) -> tuple[ModuleCall, ...]:
        """The calls recorded since the last take (the last step's)."""
        calls, self.calls, self._open = tuple(self.calls), [], []
        return calls

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
