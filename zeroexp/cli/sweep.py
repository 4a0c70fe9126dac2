"""Hydra callbacks for ``--multirun``: validate every job before the first cell runs; a table and the sweep
report (``zeroexp.report``) at the end.

Hydra (1.3, ``hydra._internal.callbacks.Callbacks._notify``) turns a callback's exception into a warning and runs
the sweep on: here an exception stops the sweep with its message on stderr, exit 2 from the check of the jobs
(nothing was run), 1 from the end of the sweep.

Which refusals stop a sweep and which stop one job: ``zeroexp.config.schemas.validate`` (its two stages) and
:func:`check_jobs`; the exit code of a sweep: :func:`sweep_exit_code`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from zeroexp.cli.hydra_app import AppExit


def sweep_jobs(config: DictConfig, loader: Any = None) -> list[list[str]]:
    """The override lists of every job the basic sweeper will run (the Cartesian product of the sweep), job ``i`` being
    Hydra's job number ``i``. ``loader``: Hydra's config loader, which a ``glob(...)`` sweep needs to list a group's
    options (as the sweeper passes it). A ``shuffle(...)`` sweep is shuffled once per app: within
    ``zeroexp.cli.hydra_app.run_hydra_app`` the sweeper gets this expansion's order (``_each_sweep_expanded_once``)."""
    from zeroexp._lib.hydra_internals import basic_sweeper_class
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = list(config.hydra.overrides.task)
    params = config.hydra.sweeper.get("params") or {}
    overrides = [f"{k}={v}" for k, v in params.items()] + overrides  # as BasicSweeper does
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    batches = basic_sweeper_class().split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def check_resume(config: DictConfig) -> None:
    """``resume=true`` re-runs the cells of the sweep in ``hydra.sweep.dir`` that are missing or not ok. A directory
    that does not exist, or holds nothing an earlier sweep wrote (Hydra's ``multirun.yaml``, written before the first
    job, or a cell's ``manifest.json``), has nothing to resume: a mistyped path, or no ``hydra.sweep.dir`` at all (the
    default is a new, timestamped directory). Raises :class:`ConfigError` naming ``hydra.sweep.dir`` rather than
    start hours of a fresh sweep; the caller refuses the sweep (exit 2, before the first cell)."""
    from zeroexp.config.schemas import ConfigError

    if not config.get("resume"):
        return
    sweep_dir = Path(str(config.hydra.sweep.dir))
    if sweep_dir.is_dir() and ((sweep_dir / "multirun.yaml").is_file() or any(sweep_dir.glob("*/manifest.json"))):
        return
    if not sweep_dir.exists():
        state = "does not exist"
    elif not sweep_dir.is_dir():
        state = "is not a directory"
    elif not any(sweep_dir.iterdir()):
        state = "is empty"
    else:
        state = "holds no sweep (no multirun.yaml, no cell's manifest.json)"
    given = any(o.lstrip("+~").split("=", 1)[0] == "hydra.sweep.dir" for o in config.hydra.overrides.hydra)
    raise ConfigError("hydra.sweep.dir", str(sweep_dir),
                      "the directory of an earlier --multirun sweep (or resume=false to start a new sweep)",
                      why=f"resume=true, but this directory {state}: nothing there can be resumed"
                          + ("" if given else " (hydra.sweep.dir was not given: the default is a new directory)"))


def check_strategy_keys(jobs: list[list[str]], cfgs: list[DictConfig], console: Any) -> None:
    """A ``strategy.<key>`` of a sweep (on the command line, or set by an experiment preset) applies to every job
    whose strategy has that key; to the others it does not apply and makes no new cell (zeroexp.cell.identity). Print
    which keys did not apply to which cells; refuse (exit 2, before the first cell) a key that the sweep names and that
    no job's strategy has (a typo: ``strategy.reduse=x``)."""
    from zeroexp.cell.identity import cell_name
    from zeroexp.config.schemas import ConfigError, owners_of, strategy_extras, strategy_key
    from zeroexp.cell.strategy import SCHEMAS, schema_keys

    named = {k for job in jobs for o in job if (k := strategy_key(o.split("=", 1)[0].lstrip("+~"))) and k != "name"}
    applied: set[str] = set()
    not_applied: dict[str, dict[str, Any]] = {}  # key -> {cell name: the value it did not take}
    lacking: dict[str, dict[str, None]] = {}  # key -> the strategies without it, in the sweep's order
    strategies: set[str] = set()
    for cfg in cfgs:
        strategies.add(str(cfg.strategy.name))
        extras = strategy_extras(cfg)
        applied.update(k for k in cfg.strategy if k not in extras)
        for key in extras:
            not_applied.setdefault(key, {})[cell_name(cfg)] = cfg.strategy.get(key)
            lacking.setdefault(key, {})[str(cfg.strategy.name)] = None
    for key in sorted(named - applied):
        own = sorted({k for s in strategies if s in SCHEMAS for k in schema_keys(SCHEMAS[s])} - {"name"})
        owners = owners_of(key)
        value = next(iter(not_applied.get(key, {None: None}).values()))
        e = ConfigError(f"strategy.{key}", value, f"the keys of the swept strategies: {', '.join(own)}",
                        why=f"no strategy of this sweep ({', '.join(sorted(strategies))}) has it"
                            + (f"; strategies that do: {', '.join(owners)}" if owners else ""))
        console.print(f"[red]error:[/] {e}\nnothing was run")
        sys.exit(2)
    for key, cells in sorted(not_applied.items()):  # the cells by name while few; by strategy where many
        which = ", ".join(cells) if len(cells) <= 4 else f"those of {', '.join(lacking[key])}"
        console.print(f"[yellow]not applied:[/] strategy.{key} to {len(cells)} cell(s) whose strategy has no such key "
                      f"(it makes no new cell): {which}")


#: In a sweep directory: {job number: the earlier job number of the same cell}, written before the first job.
DUPLICATES = ".duplicate_jobs.json"


def duplicate_of(sweep_dir: Path, job_num: int) -> int | None:
    """The earlier job of this sweep that runs the same cell as job ``job_num``, or None."""
    path = Path(sweep_dir) / DUPLICATES
    if not path.exists():
        return None
    from zeroexp.results.files import read_json

    return read_json(path).get(str(job_num))


class SweepSummary(Callback):
    """Refuses a sweep with an invalid config (or no job that can run) before it starts; prints every cell's outcome
    and writes the sweep report at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _or_stop(check_jobs, config, code=2, what="zeroexp's check of the sweep's jobs", then="nothing was run")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        code = _or_stop(end_sweep, Path(config.hydra.sweep.dir), code=1, what="zeroexp's end of the sweep")
        if code:
            raise AppExit(code)


def _or_stop(step: Callable[..., Any], *args: Any, code: int, what: str, then: str = "") -> Any:
    """``step(*args)``; an exception it raises stops the sweep: its message on stderr, exit ``code`` (a
    ``SystemExit`` it raises, with its own code, passes)."""
    try:
        return step(*args)
    except Exception as e:  # noqa: BLE001 - Hydra would make it a warning and run the sweep unchecked
        print(f"error: {what} raised {type(e).__name__}: {e}" + (f"\n{then}" if then else ""), file=sys.stderr)
        raise AppExit(code) from e


def check_jobs(config: DictConfig) -> None:
    """Refuse (exit 2, before the first cell) ``resume=true`` with nothing to resume (:func:`check_resume`), a sweep
    with a job whose config is invalid on its own (a plain ``ConfigError`` of ``zeroexp.config.schemas.validate``: a
    typo, a bad value, a model that does not build), and a sweep none of whose jobs would run because one or more is
    refused; print the jobs refused for their own cell (``InvalidCell``: recorded ``refused`` by the job) or skipped
    here (``NotApplicableHere``), and the strategy keys that do not apply; note the jobs that repeat a cell
    (:data:`DUPLICATES`)."""
    from hydra.core.global_hydra import GlobalHydra
    from rich.console import Console

    from zeroexp.cell.identity import cell_name
    from zeroexp.config.schemas import ConfigError, InvalidCell, NotApplicableHere, validate

    try:
        check_resume(config)
    except ConfigError as e:  # soft_wrap: the path stays whole on one line
        Console(highlight=False, soft_wrap=True).print(f"[red]error:[/] {e}\nnothing was run")
        sys.exit(2)
    loader = GlobalHydra.instance().config_loader()
    jobs = sweep_jobs(config, loader)
    # As Hydra's sweeper and launcher compose each job (the same arguments): composed once (zeroexp.cli.hydra_app)
    cfgs = [loader.load_sweep_config(config, job) for job in jobs]
    console = Console(highlight=False)
    check_strategy_keys(jobs, cfgs, console)
    from zeroexp.launch.progress import SWEEP_CLOCK

    first: dict[str, int] = {}
    duplicates: dict[str, int] = {}
    refused = runnable = 0
    for i, (job, cfg) in enumerate(zip(jobs, cfgs)):
        try:
            validate(cfg)
            runnable += 1
        except NotApplicableHere as e:  # valid, but not on this machine: the job records it as skipped
            console.print(f"[yellow]skip:[/] sweep job #{i} ({' '.join(job)}): {e}")
        except InvalidCell as e:  # invalid for this cell only: the job records it as refused, the others run
            refused += 1
            console.print(f"[red]refused:[/] sweep job #{i} ({' '.join(job)}): {e}")
        except ConfigError as e:  # the config itself (a typo, a bad value, a model that does not build): bad input
            console.print(f"[red]error:[/] sweep job #{i} ({' '.join(job)}): {e}\nnothing was run")
            sys.exit(2)
        name = cell_name(cfg)
        if name in first:
            duplicates[str(i)] = first[name]
        first.setdefault(name, i)
    if refused and not runnable:
        console.print(f"[red]error:[/] no job of this sweep can run ({refused} of {len(jobs)} refused, the others "
                      "not applicable here)\nnothing was run" if refused < len(jobs) else
                      f"[red]error:[/] every job of this sweep is refused ({refused})\nnothing was run")
        sys.exit(2)
    SWEEP_CLOCK.start(len(jobs))  # jobs that run in this process print "cell i of n" and the sweep's ETA
    if duplicates:  # jobs that run in other processes (submitit) skip a repeated cell by this file
        from zeroexp.results.files import write_json

        write_json(Path(config.hydra.sweep.dir) / DUPLICATES, duplicates)
    else:  # a resumed sweep: an earlier invocation's list does not apply
        (Path(config.hydra.sweep.dir) / DUPLICATES).unlink(missing_ok=True)


def sweep_exit_code(statuses: list[str], checks_failed: bool, reported: bool = True, stopped: bool = False) -> int:
    """A sweep's exit code from its cells' ``manifest.json`` statuses: 1 when a cell ``failed`` to run, the report
    was not written or a signal stopped the sweep, else 3 when a cell has a check that FAILed or ERRORed, else 2 when
    a job was ``refused`` as invalid for its cell, else 0 (``skipped``, not applicable on this machine, keeps 0)."""
    if "failed" in statuses or not reported or stopped:
        return 1
    return 3 if checks_failed else 2 if "refused" in statuses else 0


def end_sweep(sweep_dir: Path, stopped_by: str | None = None) -> int:
    """Print every cell's outcome and write the sweep report over the cells that have a manifest; the sweep's exit
    code (:func:`sweep_exit_code`). ``stopped_by``: the signal that stopped the sweep early (SIGTERM, SIGHUP, SIGINT;
    zeroexp.cli.run), said above the table -- the cells not run yet are simply absent."""
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    from zeroexp.report.checks import failed_checks
    from zeroexp.results.files import read_json

    title = f"zeroexp sweep {sweep_dir}" + (f" (stopped by {stopped_by}: the cells run so far)" if stopped_by else "")
    table = Table(title=title)
    for col in ("cell", "status", "final_loss", "failed checks", "error"):
        table.add_column(col)
    statuses: list[str] = []
    checks_failed = 0
    for manifest_path in sorted(sweep_dir.glob("*/manifest.json")):
        m = read_json(manifest_path)
        summary_path = manifest_path.with_name("summary.json")
        summary = read_json(summary_path) if m["status"] == "ok" and summary_path.exists() else {}
        loss = summary.get("final_loss")
        err = m.get("error") if isinstance(m.get("error"), dict) else {}
        statuses.append(str(m["status"]))
        checks = failed_checks(summary)
        checks_failed += bool(checks)
        table.add_row(manifest_path.parent.name, m["status"], "" if loss is None else f"{loss:.6g}",
                      ", ".join(f"{c.name} {c.verdict}" for c in checks), (err or {}).get("message", ""))
    counts = Counter(statuses)
    table.caption = (f"{len(statuses)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                     + (f"; {checks_failed} with a failed check" if checks_failed else "")) if statuses else "no cell"
    Console().print(table)
    reported = True
    if statuses:
        from zeroexp.report import report_after_sweep

        reported = report_after_sweep(sweep_dir)  # never raises: a failed report keeps the cells' results
    print(sweep_dir)
    return sweep_exit_code(statuses, bool(checks_failed), reported, stopped_by is not None)
