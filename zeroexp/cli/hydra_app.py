"""The one Hydra entry helper of zeroexp's apps (``python -m zeroexp``, ``python -m zeroexp.plan``, ``.calibrate``)."""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import hydra
from omegaconf import DictConfig

__all__ = ["CONF_DIR", "AppExit", "run_hydra_app", "sets_hydra_mode"]

#: The config groups (``conf/``), beside the package.
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


class AppExit(SystemExit):
    """An exit whose code zeroexp chose where no task may have run yet (a Hydra callback of a sweep):
    :func:`run_hydra_app` passes it on as it is."""


def run_hydra_app(config_name: str, task_fn: Callable[[DictConfig], None], started: Callable[[], bool]) -> None:
    """Run a Hydra app on ``conf/<config_name>.yaml``. Hydra reports a composition error (unknown option,
    mistyped value, unknown key) and exits 1 before any task ran: that is bad input, reported as exit code 2
    (an :class:`AppExit` keeps its code)."""
    try:
        from zeroexp.cell.memo import invocation_memo  # a sweep's jobs share their models' checks and shapes

        with (_mode_from_the_command_line(), _each_config_composed_once(), _each_sweep_expanded_once(),
              _group_options_from_one_repo(), invocation_memo()):
            hydra.main(version_base="1.3", config_path=CONF_DIR, config_name=config_name)(task_fn)()
    except SystemExit as e:
        if e.code == 1 and not started() and not isinstance(e, AppExit):
            sys.exit(2)
        raise


def sets_hydra_mode(overrides: list[str]) -> bool:
    """Whether a command-line override names ``hydra.mode`` (``hydra.mode=MULTIRUN``, Hydra's spelling of
    ``--multirun``)."""
    return any(o.lstrip("+~").split("=", 1)[0] == "hydra.mode" for o in overrides)


@contextmanager
def _mode_from_the_command_line() -> Iterator[None]:
    """Hydra (1.3) composes the whole config twice per command: once in ``Hydra.get_mode`` only to read
    ``hydra.mode``, then again to run (measured: ~0.2 s a compose on a quiet host, ~1 s on a loaded one, the
    larger part of a refused bad override's time). When ``get_mode`` answers None, Hydra takes the mode from
    ``--multirun`` itself (``hydra._internal.utils._run_app``), and None is what it answers for every zeroexp
    config, which sets no ``hydra.mode`` (tests/test_config_keys.py holds every YAML under ``conf/`` to that). So the
    probe compose is skipped unless an override names ``hydra.mode``; then Hydra's own ``get_mode`` runs."""
    from zeroexp._lib.hydra_internals import hydra_class

    Hydra = hydra_class()
    original = Hydra.get_mode

    def get_mode(self: Any, config_name: str | None, overrides: list[str]) -> Any:
        return original(self, config_name, overrides) if sets_hydra_mode(overrides) else None

    Hydra.get_mode = get_mode
    try:
        yield
    finally:
        Hydra.get_mode = original


@contextmanager
def _each_config_composed_once() -> Iterator[None]:
    """A ``--multirun`` composed each job's config three times: zeroexp's check of every job before the first cell
    (``zeroexp.cli.sweep.SweepSummary``), Hydra's ``BasicSweeper.validate_batch_is_legal``, and Hydra's launch of the
    job, each through ``ConfigLoader.load_sweep_config`` with the same arguments (measured: a 12-job sweep spent ~11 s
    of its main process composing, 0.2 to 0.6 s a compose here). For the duration of one app, a compose is remembered
    under its arguments and each later call gets a deep copy of the first result (the launcher writes the job's
    number and id into its copy): the same config, composed once per job. A compose is a function of its arguments,
    the config files and the ConfigStore (neither changes while the app runs), and of a little process state that
    zeroexp keeps fixed through a sweep: the working directory (``hydra.runtime.cwd``: ``hydra.job.chdir`` is false
    and Hydra restores it after each job), ``hydra.job.env_copy`` (empty) and the job's name (set: ``zeroexp``).
    Interpolations (``${now:...}``, ``oc.env``) stay unresolved in the composed config, and ``load_sweep_config`` copies
    their cache from the master config on each call, outside the memo, as before. A compose that raises is not
    remembered: a later call raises again."""
    from zeroexp._lib.hydra_internals import config_loader_class

    ConfigLoaderImpl = config_loader_class()
    original = ConfigLoaderImpl.load_configuration
    composed: dict[tuple[Any, ...], DictConfig] = {}

    def load_configuration(self: Any, config_name: str | None, overrides: list[str], run_mode: Any,
                           from_shell: bool = True, validate_sweep_overrides: bool = True) -> DictConfig:
        key = (id(self), config_name, tuple(overrides), run_mode, from_shell, validate_sweep_overrides)
        if key not in composed:
            cfg = original(self, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
            composed[key] = copy.deepcopy(cfg)
            return cfg
        return copy.deepcopy(composed[key])

    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        ConfigLoaderImpl.load_configuration = original


@contextmanager
def _group_options_from_one_repo() -> Iterator[None]:
    """``--help`` lists the config groups and their options (Hydra's ``format_config_groups``) through one
    ``ConfigLoader.get_group_options`` call per group, and each call deep-copies every config source, the ConfigStore's
    structured schemas included, into a fresh repository (measured: 165 copies, 5 of the 6 s of ``python -m zeroexp
    --help`` on this 2-core machine). For the duration of one app, the repository made for a ``(config_name,
    overrides)`` is made once and answers every later call with the same arguments: the config files and the
    ConfigStore do not change while the app runs, and the repository is only read."""
    from hydra.core.object_type import ObjectType

    from zeroexp._lib.hydra_internals import caching_repo, config_loader_class

    ConfigLoaderImpl = config_loader_class()
    original = ConfigLoaderImpl.get_group_options
    repos: dict[tuple[Any, ...], Any] = {}

    def get_group_options(self: Any, group_name: str, results_filter: Any = ObjectType.CONFIG,
                          config_name: str | None = None, overrides: list[str] | None = None) -> list[str]:
        key = (id(self), config_name, tuple(overrides or ()))
        if key not in repos:
            repos[key] = caching_repo(self, config_name, list(overrides or ()))
        return repos[key].get_group_options(group_name, results_filter)

    ConfigLoaderImpl.get_group_options = get_group_options
    try:
        yield
    finally:
        ConfigLoaderImpl.get_group_options = original


@contextmanager
def _each_sweep_expanded_once() -> Iterator[None]:
    """A ``--multirun`` expanded its sweep into jobs twice: zeroexp's check of every job before the first cell
    (``zeroexp.cli.sweep.sweep_jobs``), then Hydra's ``BasicSweeper.sweep``, each through
    ``BasicSweeper.split_arguments``. A ``shuffle(...)`` sweep is shuffled anew by each expansion (Python's unseeded
    ``random.shuffle``, in ``Override.sweep_iterator``), so the check numbered the jobs in one order and Hydra ran them
    in another: the duplicate-cell map (``.duplicate_jobs.json``) and the check's ``sweep job #i`` named the wrong
    jobs. For the duration of one app, the expansion of a list of overrides (the same input lines) is remembered and
    each later call gets the same jobs in the same order, split into batches as it asks: one shuffle per sweep, the
    numbering Hydra's launcher gives (job ``i`` of the expansion is ``hydra.job.num`` ``i``)."""
    from zeroexp._lib.hydra_internals import basic_sweeper_class

    sweeper = basic_sweeper_class()
    original = sweeper.__dict__["split_arguments"]
    expanded: dict[tuple[Any, ...], list[list[str]]] = {}

    def split_arguments(overrides: list[Any], max_batch_size: int | None) -> list[list[list[str]]]:
        key = tuple(o.input_line for o in overrides)
        if key not in expanded:
            expanded[key] = [list(job) for batch in original.__func__(overrides, None) for job in batch]
        jobs = [list(job) for job in expanded[key]]
        assert max_batch_size is None or max_batch_size > 0
        if max_batch_size is None:
            return [jobs]
        return list(sweeper.split_overrides_to_chunks(jobs, max_batch_size))

    sweeper.split_arguments = staticmethod(split_arguments)
    try:
        yield
    finally:
        sweeper.split_arguments = original
