"""``init=meta``: a model built on the meta device, its initial values replayed one module at a time.

The full build (``init=full``) draws every parameter from torch's default CPU generator in the order its constructor
runs: each module's ``reset_parameters`` as it is constructed (``modules()`` pre-order), then whatever the model's
own constructor does after (the GPT's GPT-2 init, :meth:`zeroexp.models.gpt.GPT.init_steps`). :func:`replay_init`
runs the same steps in the same order from the same seed, each on fresh CPU tensors of one module's own parameters,
and hands each parameter's full value to a ``sink`` that keeps the rank's part (a shard, or all of it for a
replica); the temporaries are freed before the next module. So the draws, and the values, are the full build's,
bit for bit, while no more than one module's parameters are ever held in full.

A model says it can be replayed so (``replayable_init = True`` on its class): its constructor draws nothing but
its modules' ``reset_parameters`` in construction order and its own ``init_steps``. Others are refused
(zeroexp.config.init_mode) rather than initialised with other values.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from zeroexp._lib.modules import own_parameters

__all__ = ["InitStep", "init_steps", "replayable", "replay_init"]


class InitStep(NamedTuple):
    """One step of a model's initialisation: ``fn(module)`` sets the ``names`` of ``module``'s own parameters in
    full (it may read their shapes, never their values)."""

    module: nn.Module
    names: tuple[str, ...]
    fn: Callable[[nn.Module], None]


def _own(module: nn.Module) -> tuple[str, ...]:
    return tuple(n for n, p in own_parameters(module).items() if p is not None)


def replayable(model_or_class: nn.Module | type) -> bool:
    """True when the model's class declares that :func:`init_steps` replays its constructor's draws."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return bool(getattr(cls, "replayable_init", False))


def init_steps(model: nn.Module) -> list[InitStep]:
    """The constructor's draws of a replayable ``model`` as steps, in order: every module with parameters of its
    own, its ``reset_parameters`` (``modules()`` pre-order: the construction order of a model that builds its
    children in definition order), then the model's ``init_steps()`` when it has one."""
    if not replayable(model):
        raise ValueError(f"{type(model).__qualname__} does not declare replayable_init: its initialisation cannot be "
                         "replayed module by module")
    steps = [InitStep(m, _own(m), type(m).reset_parameters) for m in model.modules() if _own(m)]
    own_steps = getattr(model, "init_steps", None)
    return steps + (list(own_steps()) if own_steps is not None else [])


def _canonical_names(model: nn.Module) -> dict[tuple[int, str], str]:
    """``(id(module), own name) -> the parameter's name in model.named_parameters()`` (a tied one: its first)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {(id(m), n): first[id(p)] for m in model.modules() for n, p in own_parameters(m).items() if p is not None}


def replay_init(model: nn.Module, seed: int, sink: Callable[[str, torch.Tensor], None]) -> int:
    """Replay the initialisation of ``model`` (built on the meta device; left unchanged) from
    ``torch.manual_seed(seed)``: each step runs on fresh CPU tensors (the full build's device and generator) of its
    module's own parameters, and ``sink(name, value)`` receives each parameter it sets (a parameter set twice is
    sunk twice: the last value is the full build's). The global RNG is left as it was. Returns the most elements
    held in full at once."""
    names, most = _canonical_names(model), 0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(int(seed))
        for step in init_steps(model):
            m, saved = step.module, dict(own_parameters(step.module))
            try:
                for n in _own(m):
                    p = saved[n]
                    own_parameters(m)[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                        requires_grad=p.requires_grad)
                most = max(most, sum(own_parameters(m)[n].numel() for n in _own(m)))
                step.fn(m)
                for n in step.names:
                    sink(names[(id(m), n)], own_parameters(m)[n].detach())
            finally:
                own_parameters(m).update(saved)  # the meta parameters again (ties kept)
    return most

