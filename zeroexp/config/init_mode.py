"""The ``init`` axis (conf/init/): ``full`` (every rank builds the whole model, today's default) or ``meta`` (built
on the meta device, each rank materialises its part: zeroexp.models.init, zeroexp.strategies._meta_init).

Its schema and its check before launch live here, beside each other; zeroexp.config.schemas registers and calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from zeroexp.errors import ConfigError

__all__ = ["InitConfig", "INIT_OPTIONS", "check_init"]

INIT_OPTIONS = ("full", "meta")


@dataclass
class InitConfig:
    name: str = MISSING  # full | meta


def check_init(cfg: Any, adapter: Any) -> None:
    """``init=meta`` needs a strategy that materialises a meta model (``StrategyAdapter.meta_init``), a model whose
    initialisation zeroexp can replay (``replayable_init``), and real tensors (not ``dry_run``)."""
    node = cfg.get("init")
    if node is None or node.name == "full":
        return
    from zeroexp.models import import_class
    from zeroexp.models.init import replayable

    name = str(cfg.strategy.name)
    if adapter.meta_init is None:
        from zeroexp.strategies import registered

        able = sorted(n for n, a in registered().items() if a.meta_init is not None)
        raise ConfigError("init", node.name, "full", why=f"strategy={name} does not materialise a model built on the "
                          f"meta device (the reason is beside its adapter's meta_init; strategies that do: "
                          f"{', '.join(able)})")
    target = str(cfg.model._target_)
    try:
        cls = import_class(target, base=None)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError("model._target_", target, "an importable nn.Module class", why=str(e)) from e
    if not isinstance(cls, type) or not replayable(cls):
        raise ConfigError("init", node.name, "full", why=f"model._target_={target} does not declare replayable_init: "
                          "init=meta gives the full build's values only for a model whose constructor draws just its "
                          "modules' reset_parameters and its own init_steps (zeroexp.models.LinearStack and "
                          "zeroexp.models.gpt.GPT do)")
    if cfg.get("dry_run"):
        raise ConfigError("init", node.name, "full", why="a dry run allocates no parameter: there is nothing to "
                          "initialise")
