"""A key of an app's config that nothing reads, refused naming it and its nearest keys (every app: the cell's
``zeroexp.config.schemas.validate``, ``zeroexp.cli.plan``, ``.recommend``, ``.calibrate``)."""

from __future__ import annotations

from typing import Mapping

from omegaconf import DictConfig, OmegaConf

from zeroexp.errors import ConfigError

__all__ = ["check_known_keys"]


def check_known_keys(cfg: DictConfig, schema: type, prefix: str = "", groups: Mapping[str, type] | None = None
                     ) -> None:
    """A key of an app's composed config (``cfg``) that its schema (a dataclass: ``ZeroexpConfig``, ``PlanConfig``,
    ``RecommendConfig``, ``CalibrateConfig``) does not have is read by nothing (``+world_sizes=8``, as Hydra suggests
    for a misspelt key): refused, naming it and its nearest keys. A field whose default is a dataclass (``recommend``,
    ``calibrate``, ``allocator``, ``probes``) is checked within, as is a config group ``groups`` gives a schema of
    (the cell's ``optimizer``, ``logger``, ...); any other (``model``) is open."""
    import difflib
    from dataclasses import MISSING as NO_FACTORY
    from dataclasses import fields, is_dataclass

    own = {f.name: f for f in fields(schema)}
    for key in map(str, cfg):
        if key == "hydra" and not prefix:
            continue
        name, f = f"{prefix}{key}", own.get(key)
        if f is None:
            near = difflib.get_close_matches(key, list(own), n=3)
            hint = f"did you mean {' or '.join(prefix + k for k in near)}?" if near else "a misspelt key?"
            raise ConfigError(name, OmegaConf.select(cfg, key, throw_on_resolution_failure=False),
                              ", ".join(prefix + k for k in own), why=f"nothing reads {name!r} ({hint})")
        inner = (groups or {}).get(key)
        if inner is None:
            default = f.default_factory() if f.default_factory is not NO_FACTORY else f.default
            inner = type(default) if is_dataclass(default) else None
        node = OmegaConf.select(cfg, key, throw_on_missing=False) if inner is not None else None
        if isinstance(node, DictConfig):
            check_known_keys(node, inner, f"{name}.")
