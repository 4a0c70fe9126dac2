"""``python -m zeroexp``: compose a cell with Hydra, run it, print its directory last.

Exit codes: 0 the cell ran and every check is PASS or n/a; 3 it ran and a check FAILed or ERRORed
(``zeroexp.report.checks.failed_checks``: a section's check or a part of the plan); 1 a cell failed to run (a sweep
runs its other cells first), the sweep report could not be written, or zeroexp's end of a sweep raised; 2 bad input,
refused before any rank started (for a sweep, before its first cell, zeroexp's check of its jobs included). A sweep
exits 1 when any cell failed to run, else 3 when any cell has a failed check, else 2 when a job was refused as invalid
for its cell (``InvalidCell``: recorded ``refused``, the sweep's other jobs run), else 0
(``zeroexp.cli.sweep.sweep_exit_code``); a signal, 128 + its number.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf

from zeroexp.cell.identity import cell_name
from zeroexp.cli.hydra_app import CONF_DIR, run_hydra_app  # noqa: F401 - CONF_DIR: tests and callers read it here
from zeroexp.config.schemas import ConfigError, InvalidCell, NotApplicableHere, register_schemas


_TASK_STARTED = False
_RAN_THIS_INVOCATION: set[Path] = set()


def register() -> None:
    """Register zeroexp's schemas and the ``zx_cell_name`` resolver (used in Hydra's output paths)."""
    register_schemas()
    if not OmegaConf.has_resolver("zx_cell_name"):
        OmegaConf.register_new_resolver("zx_cell_name", lambda *, _root_: cell_name(_root_))


def explicit_keys(overrides: list[str]) -> tuple[str, ...]:
    """The config keys named on the command line (``prefetch=post`` -> ``prefetch``)."""
    return tuple(o.split("=", 1)[0].lstrip("+~") for o in overrides)


def task(cfg: DictConfig) -> None:
    """Hydra's task function: one cell per call (one call per job of a ``--multirun`` sweep)."""
    from rich.console import Console

    from zeroexp.results.files import read_json
    from zeroexp.launch.runner import run_cell

    global _TASK_STARTED
    _TASK_STARTED = True
    console = Console(highlight=False)
    hc = HydraConfig.get()
    cell_dir = Path(hc.runtime.output_dir).resolve()
    overrides = list(hc.overrides.task)
    multirun = hc.mode == RunMode.MULTIRUN
    sweep = Path(hc.sweep.dir).name if multirun else None
    if cfg.resume and not multirun:  # resume=true is a sweep's (zeroexp.cli.sweep.check_resume): not silently ignored
        e = ConfigError("resume", True, "resume=true with --multirun and hydra.sweep.dir=<an earlier sweep>",
                        why="a single run has no sweep to resume: it runs its cell from clean")
        _discard_if_empty(cell_dir)  # nothing ran: nothing that looks like a result
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    if cfg.launcher.name != "local":  # torchrun or SLURM started this process as one rank (zeroexp.launch.cluster)
        return _external_rank(cfg, cell_dir, overrides, sweep, multirun, console)
    manifest = cell_dir / "manifest.json"
    if multirun:  # cell i of n, and the sweep's ETA from the cells run so far (zeroexp.launch.progress)
        from zeroexp.launch.progress import SWEEP_CLOCK

        console.print(SWEEP_CLOCK.line(int(hc.job.num), cell_dir.name))
    if multirun and cell_dir in _RAN_THIS_INVOCATION:
        console.print(f"[yellow]skip[/] {cell_dir.name}: this cell already ran in this sweep "
                      f"(overrides {' '.join(overrides)} give the same cell)")
        return
    _RAN_THIS_INVOCATION.add(cell_dir)
    if multirun and cfg.resume and manifest.exists() and read_json(manifest).get("status") == "ok":
        console.print(f"[yellow]skip[/] {cell_dir.name}: ok in an earlier run of this sweep (resume=true)")
        return
    if multirun and cfg.resume and _refused_before(cfg, manifest):
        console.print(f"[yellow]skip[/] {cell_dir.name}: {REFUSED_BEFORE}")
        return
    if manifest.exists():  # an earlier, unfinished or failed attempt (or resume=false): start clean
        _clear(cell_dir)
    started = time.monotonic()
    try:
        if cfg.checkpoint.get("source") is not None:  # its source cell writes the checkpoint it starts from, first
            from zeroexp.launch.sources import SourceFailed, ensure_source

            try:
                # one line each, as printed: no wrap inside the command, its brackets not read as markup
                ensure_source(cfg, overrides, say=lambda line: console.print(line, soft_wrap=True, markup=False))
            except SourceFailed as e:
                _not_run(cfg, cell_dir, overrides, sweep, e, console=console)
                print(cell_dir)
                if not multirun:
                    sys.exit(1)
                return
        result = run_cell(cfg, cell_dir, overrides=overrides, sweep=sweep,
                          explicit_keys=() if multirun else explicit_keys(overrides), progress=True)
    except (NotApplicableHere, InvalidCell) as e:  # a sweep records the job, and runs its others
        if not multirun:
            _discard_if_empty(cell_dir)
            console.print(f"[red]error:[/] {e}")
            sys.exit(2)
        _not_run(cfg, cell_dir, overrides, sweep, e, console=console)
        print(cell_dir)
        return
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: the cell is recorded failed; a sweep stops here
        if multirun:
            from zeroexp.cli.sweep import end_sweep

            end_sweep(Path(hc.sweep.dir), stopped_by=getattr(e, "signal_name", "SIGINT"))
        raise
    except ConfigError as e:
        _discard_if_empty(cell_dir)
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    if multirun:
        from zeroexp.launch.progress import SWEEP_CLOCK

        SWEEP_CLOCK.finished(int(hc.job.num), time.monotonic() - started)
    _print_result(result, console, multirun)


def _print_result(result: Any, console: Any, multirun: bool) -> None:
    """The cell's status line, then its digest and its directory (the last line); a single run exits 1 when it
    failed to run, 3 when a check failed."""
    cell_dir = result.cell_dir
    colour = "green" if result.status == "ok" else "red"
    line = f"[{colour}]{result.status}[/] {cell_dir.name}"
    if result.summary is not None and result.summary.get("final_loss") is not None:  # a dry run has no loss
        line += f"  final_loss={result.summary['final_loss']:.6g}"
    if result.error:
        log = result.error.get("log")
        line += f"  error: {result.error['message']}" + (
            f" (see {log})" if log and log not in result.error["message"] else "")
    console.print(line)
    if result.summary is not None and not multirun:  # a sweep's cells are in its report
        _print_digest(result.summary, console)
    print(cell_dir)
    if multirun:  # a sweep's exit code is decided at its end (zeroexp.cli.sweep.end_sweep)
        return
    if result.status != "ok":
        sys.exit(1)
    if result.summary is not None:
        from zeroexp.report.checks import failed_checks

        if failed_checks(result.summary):
            sys.exit(3)


def _print_digest(summary: dict[str, Any], console: Any) -> None:
    """One line per probe and per part of the plan: what it found and its check (zeroexp.report.digest)."""
    from rich.table import Table

    from zeroexp.report.digest import digest
    from zeroexp.results.verdict import Verdict

    rows = digest(summary)
    if not rows:
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("probe", "found", "check"):
        table.add_column(col, overflow="fold")
    colours = {Verdict.PASS: "green", Verdict.FAIL: "red", Verdict.ERROR: "red"}
    for probe, found, check in rows:
        table.add_row(probe, found, f"[{colours[check]}]{check}[/]" if check in colours else check)
    console.print(table)


#: A job of a sweep that does not run: its ``manifest.json`` ``status`` and ``error.cause`` (docs/results.md).
NOT_RUN = {NotApplicableHere: ("skipped", "not_applicable"), InvalidCell: ("refused", "invalid_config")}
#: What ``resume=true`` says of a job it does not retry (:func:`_refused_before`).
REFUSED_BEFORE = "refused in an earlier run of this sweep, its configuration unchanged (resume=true does not retry it)"


def _not_run(cfg: DictConfig, cell_dir: Path, overrides: list[str], sweep: str | None, e: Exception,
             launch: dict[str, Any] | None = None, console: Any = None) -> None:
    """The manifest of a sweep job that does not run, and its line: ``skipped`` (``NotApplicableHere``: not on this
    machine), ``refused`` (``InvalidCell``: invalid for this cell) or ``failed`` (``SourceFailed``: the source cell
    of its ``checkpoint.source`` wrote no checkpoint), the refusal's key, value, accepted values and message in
    ``error``. ``launch``: how it would have been launched (default: locally)."""
    from zeroexp.cell.identity import cell_axes, cell_id
    from zeroexp.results.files import utc_now, write_json
    from zeroexp.launch.runner import manifest_config, new_manifest

    from zeroexp.launch.sources import SourceFailed

    status, cause = (("failed", "source_failed") if isinstance(e, SourceFailed) else
                     NOT_RUN[NotApplicableHere if isinstance(e, NotApplicableHere) else InvalidCell])
    resolved = manifest_config(cfg)
    run_info = {"cell": cell_axes(cfg), "cell_id": cell_id(cfg), "cell_name": cell_name(cfg), "sweep": sweep}
    manifest = new_manifest(cfg, resolved, run_info, overrides, sweep, "n/a", "n/a", launch or
                            {"launcher": "local", "nodes": 1, "ranks_per_node": int(cfg.world_size), "job_id": None})
    manifest.update(status=status, error={"rank": None, "cause": cause, "key": getattr(e, "key", "checkpoint.source"),
                                          "value": _plain(getattr(e, "value", cfg.checkpoint.get("source"))),
                                          "accepted": getattr(e, "accepted", None), "message": str(e)},
                    ended_at=utc_now(), duration_s=None)  # nothing ran: no wall time (the report reads n/a)
    cell_dir.mkdir(parents=True, exist_ok=True)
    if (cell_dir / "manifest.json").exists():  # an earlier attempt of this cell: its files are not this outcome's
        _clear(cell_dir)
    write_json(cell_dir / "manifest.json", manifest)
    if console is not None:
        console.print(f"[{'yellow' if status == 'skipped' else 'red'}]{status}[/] {cell_dir.name}: {e}")


def _plain(value: Any) -> Any:
    """A refused value as JSON holds it: an OmegaConf node as plain lists and dicts, anything else not JSON as text."""
    import json

    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _refused_before(cfg: DictConfig, manifest: Path) -> bool:
    """Whether ``manifest`` records this cell ``refused`` with the same configuration (``resume`` aside): then
    ``resume=true`` does not retry it. Another configuration in the same cell directory (a key outside the cell's
    identity, ``resources.check``) is checked again."""
    import json

    from zeroexp.launch.runner import manifest_config
    from zeroexp.results.files import read_json

    if not manifest.exists():
        return False
    try:
        m = read_json(manifest)
    except (OSError, ValueError):
        return False
    if m.get("status") != "refused" or not isinstance(m.get("config"), dict):
        return False
    now = json.loads(json.dumps(manifest_config(cfg), default=str))  # as the manifest's JSON reads it back
    return {k: v for k, v in m["config"].items() if k != "resume"} == {k: v for k, v in now.items() if k != "resume"}


def _external_rank(cfg: DictConfig, cell_dir: Path, overrides: list[str], sweep: str | None, multirun: bool,
                   console: Any) -> None:
    """One rank of a torchrun or SLURM job; rank 0 prints the cell's line (other ranks only a failure)."""
    from zeroexp.launch.cluster.rank import run_external_rank
    from zeroexp.cli.sweep import duplicate_of

    hc = HydraConfig.get()
    first = duplicate_of(Path(hc.sweep.dir), int(hc.job.num)) if multirun else None
    if first is not None:  # jobs run in other processes: the sweep's start noted which repeat a cell
        console.print(f"[yellow]skip[/] {cell_dir.name}: job #{first} of this sweep runs the same cell")
        return
    if multirun and cfg.resume and _refused_before(cfg, cell_dir / "manifest.json"):  # every rank reads it
        console.print(f"[yellow]skip[/] {cell_dir.name}: {REFUSED_BEFORE}")
        return
    try:
        result = run_external_rank(cfg, cell_dir, overrides=overrides, sweep=sweep, multirun=multirun,
                                   explicit_keys=() if multirun else explicit_keys(overrides))
    except (NotApplicableHere, InvalidCell) as e:
        if multirun:  # every rank refuses it alike, before the rendezvous; the first rank records it
            _external_not_run(cfg, cell_dir, overrides, sweep, e, console)
            return
        _discard_if_empty(cell_dir)
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    except ConfigError as e:
        _discard_if_empty(cell_dir)  # refused before anything ran (any rank may remove it)
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    if result is not None:
        _print_result(result, console, multirun)


def _external_not_run(cfg: DictConfig, cell_dir: Path, overrides: list[str], sweep: str | None, e: ConfigError,
                      console: Any) -> None:
    """A SLURM job of a sweep refused for its cell (or not applicable): rank 0 writes its manifest (:func:`_not_run`);
    a rank that cannot tell its place (not a SLURM task after all) writes it too: it is then alone."""
    from zeroexp.launch.cluster.env import detect

    try:
        env = detect(str(cfg.launcher.name))
    except ConfigError:
        env = None
    if env is not None and env.rank != 0:
        return
    launch = {"launcher": str(cfg.launcher.name), "nodes": env.nodes if env else cfg.launcher.nodes,
              "ranks_per_node": env.local_world_size if env else cfg.launcher.ranks_per_node,
              "job_id": env.job_id if env else None}
    _not_run(cfg, cell_dir, overrides, sweep, e, launch, console)
    print(cell_dir)


def _discard_if_empty(cell_dir: Path) -> None:
    """Remove a refused cell's directory when it holds nothing but Hydra's job log, and detach the logging handlers
    that write into it first: a handler left on a removed file raises FileNotFoundError at the next record any library
    logs in this process (a sweep's next job, an in-process caller)."""
    cell_dir = cell_dir.resolve()
    if not cell_dir.is_dir() or not {p.name for p in cell_dir.iterdir()} <= {"zeroexp.log"}:
        return
    for logger in [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                         if isinstance(v, logging.Logger))]:
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve().is_relative_to(cell_dir):
                logger.removeHandler(h)
                h.close()
    shutil.rmtree(cell_dir, ignore_errors=True)


def _clear(cell_dir: Path) -> None:
    for p in cell_dir.iterdir():
        if p.name != "zeroexp.log":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def main() -> None:
    """Console entry point (``python -m zeroexp`` and ``zeroexp``).

    SIGTERM and SIGHUP end the run as Ctrl-C does (``zeroexp.launch.runner.stop_on_signals``): the running cell's ranks
    are reaped and it is recorded ``failed`` naming the signal; a sweep stops and reports the cells run so far. The
    exit code is then 128 + the signal's number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP), with one line, no traceback."""
    from zeroexp.launch.local import start_forkserver_for
    from zeroexp.launch.runner import stop_on_signals

    start_forkserver_for(sys.argv[1:])  # `python -m zeroexp` started it already, the `zeroexp` script starts it here
    register()
    try:
        with stop_on_signals():
            run_hydra_app("config", task, lambda: _TASK_STARTED)
    except KeyboardInterrupt as e:
        import signal

        name = getattr(e, "signal_name", "SIGINT")
        print(f"stopped by {name}", file=sys.stderr)
        sys.exit(128 + int(getattr(e, "signum", signal.SIGINT)))


# Hydra launchers that run jobs in other processes (submitit) unpickle ``task`` by importing this module, then
# resolve the output paths, which use zeroexp's resolvers: register them on import too.
register()
