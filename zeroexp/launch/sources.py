"""The source cell of ``checkpoint.source`` (zeroexp.cell.written), run before the cell that starts from it.

A job with ``checkpoint.source`` first makes sure its source's checkpoint exists: under an exclusive lock (jobs of a
sweep in other processes wait for one another, one writes), a whole checkpoint already there (its ``meta.json``, its
files' sizes) is reused; otherwise the source cell runs as ``python -m zeroexp`` with the job's own overrides but the
source's, ``checkpoint=<kind> checkpoint.keep=true checkpoint.dir=<source dir>/checkpoint`` and its cell directory
``<source dir>/cell``; its printed digest and exit code are its own. The job then starts from that checkpoint
(``checkpoint.load_from`` is what zeroexp.cell.written.load_dir names). A source cell that fails to run leaves no
checkpoint: the job is recorded failed with the source cell's directory; one the source's strategy refuses is the
job's refusal (its key, ``checkpoint.source``).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from zeroexp.cell.source import META, CheckpointError, verify_checkpoint
from zeroexp.cell.written import ACCEPTED, SourceSpec, parse_source, source_dir
from zeroexp.errors import InvalidCell

__all__ = ["ensure_source", "source_command", "SourceFailed"]


class SourceFailed(RuntimeError):
    """The source cell ran and wrote no checkpoint: the message names its directory and exit code."""


def _kept(override: str, spec: SourceSpec) -> bool:
    """Whether the source cell keeps a job's override: not one of the strategy's (``strategy``, ``strategy.*``,
    ``prefetch``: the source names its own), of ``checkpoint`` (the source's kind and directory), of ``resume``, nor
    one of a key the source sets."""
    key = override.lstrip("+~").split("=", 1)[0]
    root = key.split(".")[0]
    return root not in ("strategy", "prefetch", "checkpoint", "resume", "hydra") and root not in spec.keys


def source_command(cfg: Any, overrides: Sequence[str]) -> list[str]:
    """The command that runs the source cell of ``cfg`` (a job with ``checkpoint.source``), ``overrides``: the job's."""
    spec = parse_source(cfg.checkpoint.source)
    where = source_dir(cfg)
    return [sys.executable, "-m", "zeroexp", *(o for o in overrides if _kept(o, spec)), *spec.overrides,
            *([] if any(o.startswith("checkpoint=") for o in spec.overrides) else [f"checkpoint={spec.kind}"]),
            "checkpoint.keep=true", f"checkpoint.dir={where / 'checkpoint'}", "checkpoint.source=null",
            f"hydra.run.dir={where / 'cell'}"]


def ensure_source(cfg: Any, overrides: Sequence[str], say: Any = print) -> Path:
    """The checkpoint directory of ``cfg``'s source, written by its source cell unless a whole one is there
    (``say``: one line each, where it is and whether it was reused). Raises :class:`InvalidCell` (``checkpoint.source``)
    when the source cell was refused, :class:`SourceFailed` when it ran and wrote no whole checkpoint."""
    where = source_dir(cfg)
    checkpoint = where / "checkpoint"
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
        if _whole(checkpoint):
            say(f"source {cfg.checkpoint.source!r}: reusing {checkpoint}")
            return checkpoint
        command = source_command(cfg, overrides)
        say(f"source {cfg.checkpoint.source!r}: writing {checkpoint}: {shlex.join(command)}")  # runs as printed
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "source.log", "w") as log:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
        if rc == 2:
            raise InvalidCell("checkpoint.source", cfg.checkpoint.source, ACCEPTED,
                              why=f"the source cell was refused (exit 2): {_last_line(where / 'source.log')}")
        if not _whole(checkpoint):
            raise SourceFailed(f"the source cell {cfg.checkpoint.source!r} exited {rc} and wrote no whole checkpoint "
                               f"(see {where / 'source.log'} and {where / 'cell'})")
        say(f"source {cfg.checkpoint.source!r}: written (exit {rc}: "
            f"{'every check PASS or n/a' if rc == 0 else 'a check did not pass, see ' + str(where / 'cell')})")
        return checkpoint


def _whole(path: Path) -> bool:
    """A checkpoint whose ``meta.json`` lists files all there at their sizes (hashes: checked by the cell's load)."""
    if not (path / META).is_file():
        return False
    try:
        verify_checkpoint(path, hash_files=())
    except CheckpointError:
        return False
    return True


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return next((line.removeprefix("error: ") for line in reversed(lines) if line.startswith("error:")),
                lines[-1] if lines else "no output")
