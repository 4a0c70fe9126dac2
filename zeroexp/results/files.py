"""The files of a cell directory: atomic writers, the manifest, and reading results back.

Every file is written to a temporary name in the same directory and renamed into place, so a file that
exists is whole. The public contract of these files is ``docs/results.md``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import io
import json
import math
import os
import platform
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

__all__ = ["redact", "redact_obj", "write_text", "write_json", "write_csv", "read_json", "flat_keys", "versions",
           "git_commit", "utc_now", "load_sweep", "SCHEMA_VERSION", "schema_version"]

#: The version of the cell files' layout, written as ``schema_version`` at the top of ``summary.json`` and
#: ``manifest.json`` (docs/results.md). 1: files written before the field existed (they have none); 2: the
#: field. Readers (:func:`load_sweep`, the report) read every version up to this one.
SCHEMA_VERSION = 2


#: Environment variables whose names contain one of these are secrets: their values never reach a file.
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")


def secret_values() -> list[str]:
    """Values of the secret-named environment variables (longest first, at least 4 characters)."""
    vals = {v for k, v in os.environ.items() if any(m in k.upper() for m in SECRET_MARKERS) and len(v) >= 4}
    return sorted(vals, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every secret environment value replaced by ``***``."""
    for v in secret_values():
        text = text.replace(v, "***")
    return text


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like object with secret environment values redacted in every string."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


def write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same directory, fsync, rename).

    Secret environment values (see :data:`SECRET_MARKERS`) are redacted first.
    """
    text = redact(text)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with _open_tmp(fd, path) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _open_tmp(fd: int, path: Path) -> Any:
    """The file object :func:`write_text` writes ``path``'s temporary file through (zeroexp.rank.faults replaces it to
    fill the disk in the middle of a result write)."""
    return os.fdopen(fd, "w", encoding="utf-8")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: Path | str, obj: Mapping[str, Any]) -> None:
    """Atomically write ``obj`` as indented JSON (non-finite floats become null)."""
    write_text(path, json.dumps(_finite(obj), indent=2, default=_json_default, allow_nan=False) + "\n")


def write_csv(path: Path | str, frame: Any) -> None:
    """Atomically write a pandas DataFrame as CSV without the index."""
    buf = io.StringIO()
    frame.to_csv(buf, index=False)
    write_text(path, buf.getvalue())


def read_json(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


_PACKAGES = ("torch", "lightning", "hydra-core", "omegaconf", "wandb", "deepspeed", "pandas")


def versions() -> dict[str, str | None]:
    """Python and package versions (null when a package is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(cwd: Path | str | None = None) -> dict[str, Any] | None:
    """The commit of the checkout zeroexp runs from, and whether it has uncommitted changes; null outside git."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return {"commit": commit, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return None


def host() -> str:
    return socket.gethostname()


def flat_keys(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``d`` with its nested mappings spelled as dotted keys (an empty mapping kept as a value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: Top-level summary.json fields that repeat the manifest's (the manifest's value is kept).
_SUMMARY_DUPLICATES = ("schema_version", "status", "error", "cell", "cell_id", "world_size")


def schema_version(doc: Mapping[str, Any], name: str = "file") -> int:
    """The ``schema_version`` of a ``summary.json`` / ``manifest.json`` (1 when it has none, as before the field
    existed); ValueError for a version newer than this zeroexp reads."""
    version = int(doc.get("schema_version", 1))
    if version > SCHEMA_VERSION:
        raise ValueError(f"{name} has schema_version {version}; this zeroexp reads up to {SCHEMA_VERSION}: "
                         "upgrade zeroexp to read it")
    return version


def load_sweep(sweep_dir: Path | str) -> Any:
    """Every cell of a sweep directory as a pandas DataFrame, one row per cell (directory-name order).

    A cell is a subdirectory holding ``manifest.json``. Columns are the manifest's fields and, for a cell
    whose status is ``ok``, its ``summary.json``, flattened with dots: ``status``, ``error.message``,
    ``cell.strategy``, ``config.model.width``, ``versions.torch``, ``final_loss``, ``state.factors.param``,
    ``collectives.counts.all_reduce``, ``timing.median_ms``, ... (``docs/results.md`` defines each), plus
    ``cell_dir`` (absolute path). Lists stay Python lists (``timing.step_ms``, ``memory.peak_bytes``). Failed, refused,
    skipped or running cells are rows too, with their ``status`` and ``error.*``; their partial results are not
    read. A field a cell lacks (a probe section its strategy does not have) is missing (NaN/None).
    ``schema_version`` is the manifest's (1 for files written before the field existed); a cell written by a
    newer zeroexp (a version above :data:`SCHEMA_VERSION`) is a row with status ``unreadable``, saying so.
    """
    import pandas as pd

    rows = []
    for manifest_path in sorted(Path(sweep_dir).glob("*/manifest.json")):
        cell = manifest_path.parent
        row: dict[str, Any] = {"cell_dir": str(cell.resolve())}
        try:
            manifest = read_json(manifest_path)
            version = schema_version(manifest, f"{cell.name}/manifest.json")  # before the row takes its status
            row.update(flat_keys(manifest), schema_version=version)
            summary_path = cell / "summary.json"
            if row.get("status") == "ok" and summary_path.exists():
                summary = read_json(summary_path)
                schema_version(summary, f"{cell.name}/summary.json")  # versions 1 and 2: the same fields
                row.update(flat_keys({k: v for k, v in summary.items() if k not in _SUMMARY_DUPLICATES}))
        except (OSError, ValueError) as e:  # unreadable JSON: keep the cell, say why
            row.setdefault("status", "unreadable")
            row["error.message"] = f"cannot read {cell.name}: {e}"
        row.setdefault("cell_name", cell.name)
        rows.append(row)
    return pd.DataFrame(rows)
