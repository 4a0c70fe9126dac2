"""torch's activation checkpoint wrapper (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, private:
no public path in torch 2.13) as zeroexp applies it. A leaf: it imports nothing of zeroexp; torch's module is
imported when a function is called."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["checkpoint_modules", "checkpoint_prefix"]


def checkpoint_modules(module: nn.Module, classes: tuple[type, ...], chosen: Callable[[nn.Module], bool] | None = None,
                       context_fn: Callable[[], Any] | None = None) -> None:
    """Replace each module of ``classes`` inside ``module`` (those ``chosen`` accepts, default all) by torch's
    non-reentrant ``checkpoint_wrapper``: ``apply_activation_checkpointing(module, check_fn=...,
    checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))`` of
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (torch 2.13); ``context_fn``: passed on to
    ``torch.utils.checkpoint.checkpoint`` (a selective policy's contexts)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    extra = {"context_fn": context_fn} if context_fn is not None else {}
    apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, classes) and (chosen is None or chosen(m)),
                                   checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                                                 checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra))


def checkpoint_prefix() -> str:
    """What the wrapper puts in the names of the parameters it wraps (``_checkpoint_wrapped_module.``):
    ``checkpoint_wrapper._CHECKPOINT_PREFIX`` (private; torch 2.13)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return _CHECKPOINT_PREFIX
