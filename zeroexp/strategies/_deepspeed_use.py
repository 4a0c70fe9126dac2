"""What a DeepSpeed training step used, observed live (:class:`StepUse`): the parameters it gave a gradient, those of
the modules forward called, and its module calls as stage 3's hooks see them (DeepSpeed's fetch schedule,
:mod:`zeroexp.formulas.deepspeed_fetch`)."""

from __future__ import annotations

from torch import nn

from zeroexp.formulas.deepspeed_fetch import ModuleCall
from zeroexp.models.calls import CallRecorder

__all__ = ["StepUse"]


class StepUse:
    """Which parameters of ``module`` a training step used, observed live: those autograd gave a gradient (their
    post-accumulate-grad hooks, the hooks DeepSpeed's own reductions hang on; in the order they first fired, the order
    stages 2-3 reduce them) and those held by a module forward
    called (DeepSpeed stage 3 fetches a module's parameters in its pre-forward hook). Registered before
    ``deepspeed.initialize``; :meth:`close` (at each optimizer step) ends a step's record, the micro-batches' together.
    Before the first record (or without a module) every parameter counts as used."""

    def __init__(self, module: nn.Module | None = None) -> None:
        self._graded: dict[int, None] = {}  # in the order the hooks first fired
        self._called: set[int] = set()
        self._last: tuple[dict[int, None], frozenset[int]] | None = None
        self._micro: tuple[ModuleCall, ...] = ()  # the last micro-batch's forward calls
        self._calls: tuple[ModuleCall, ...] = ()  # the last step's
        self.recorder: CallRecorder | None = None
        self._modules: list[nn.Module] = []
        if module is None:
            return
        self.recorder = CallRecorder(module)
        self._modules = list(module.modules())
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda t: self._graded.setdefault(id(t)))
        for m in module.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(lambda m, args: self._called.update(map(id, m.parameters(recurse=False))))

    def backward_begins(self) -> None:
        """A micro-batch's forward is over: its calls are kept; none is recorded in backward (a checkpointed module's
        recompute)."""
        if self.recorder is not None:
            self._micro, self.recorder.paused = self.recorder.take(), True

    def backward_ends(self) -> None:
        if self.recorder is not None:
            self.recorder.paused = False

    def close(self) -> None:
        """End the step's record (the last one :meth:`ungraded`, :meth:`called` and :meth:`calls` answer for)."""
        self._last = dict(self._graded), frozenset(self._called)
        self._graded, self._called, self._calls = {}, set(), self._micro

    def calls(self) -> tuple[ModuleCall, ...]:
        """The module calls of the last step's (last micro-batch's) forward; empty before the first step."""
        return self._calls

    def recomputed(self) -> frozenset[int]:
        """The last step's calls whose forward backward runs again: each call a checkpoint wrapper makes (torch's
        ``checkpoint_wrapper``: its wrapped module's, the call after the wrapper's; the wrapper's own hooks run outside
        the checkpoint)."""
        from zeroexp._lib.checkpointing import checkpoint_prefix

        attr = checkpoint_prefix().rstrip(".")
        return frozenset(k + 1 for k, c in enumerate(self._calls)
                         if k + 1 < len(self._calls) and hasattr(self._modules[c.module], attr))

    def ungraded(self, params: list[nn.Parameter]) -> tuple[int, ...]:
        """Indices into ``params`` of those the last step gave no gradient."""
        return () if self._last is None else tuple(i for i, p in enumerate(params) if id(p) not in self._last[0])

    def ready(self, params: list[nn.Parameter]) -> list[int] | None:
        """Indices into ``params`` of those the last step gave a gradient, in the order their hooks first fired; None
        before the first step."""
        if self._last is None:
            return None
        at = {id(p): i for i, p in enumerate(params)}
        return [at[g] for g in self._last[0] if g in at]

    def called(self, p: nn.Parameter) -> bool:
        """Whether a module holding ``p`` as its own was called in the last step's forward."""
        return self._last is None or id(p) in self._last[1]


