"""Hydra's internals (``hydra._internal``, private; Hydra 1.3) as zeroexp's command line patches them for the length
of one app (zeroexp.cli.hydra_app). A leaf: it imports nothing of zeroexp; Hydra's modules are imported when a
function is called."""

from __future__ import annotations

from typing import Any

__all__ = ["hydra_class", "config_loader_class", "caching_repo", "basic_sweeper_class"]


def hydra_class() -> type:
    """``hydra._internal.hydra.Hydra`` (Hydra 1.3): its ``get_mode(self, config_name, overrides)`` composes a config
    only to read ``hydra.mode``."""
    from hydra._internal.hydra import Hydra

    return Hydra


def config_loader_class() -> type:
    """``hydra._internal.config_loader_impl.ConfigLoaderImpl`` (Hydra 1.3): its ``load_configuration(self,
    config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True)`` composes a config."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    return ConfigLoaderImpl


def caching_repo(loader: Any, config_name: str | None, overrides: list[str]) -> Any:
    """The config repository a ``ConfigLoaderImpl`` (Hydra 1.3) makes for one ``get_group_options(group_name,
    results_filter, config_name, overrides)`` call (its private ``_parse_overrides_and_create_caching_repo``): a deep
    copy of the loader's sources, the search path set from ``overrides``; its ``get_group_options(group_name,
    results_filter)`` answers the call."""
    return loader._parse_overrides_and_create_caching_repo(config_name, overrides)[1]


def basic_sweeper_class() -> type:
    """``hydra._internal.core_plugins.basic_sweeper.BasicSweeper`` (Hydra 1.3): its static ``split_arguments(overrides,
    max_batch_size)`` expands a sweep's parsed overrides into batches of jobs, in Hydra's job order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return BasicSweeper
