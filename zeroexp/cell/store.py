"""Answers kept on disk between the planner's invocations: a model's shape, its units, its traced steps and forwards,
its counted operators (the tables :data:`STORED_TABLES` of :mod:`zeroexp.cell.memo`), so that a second
``python -m zeroexp.plan`` or ``zeroexp.recommend`` of the same model neither imports its modeling code nor traces it
again (a Llama 3 70B plan: a 5.5-s import floor and 8 s of fake-tensor traces the first time).

Each answer is a pure function of its key (the model config, the batch, the dtypes, the units, ...) and of the code
that computed it. The code is a fingerprint of zeroexp's sources (every ``.py`` file of the package, byte for byte),
the Python, torch and transformers versions, and the distribution of the model's own code (its ``_target_``'s and
its unit classes' top-level package, with its version): an answer is read back only under the same fingerprint,
so an edit of any of them computes everything afresh. A model whose code is no installed distribution's nor
zeroexp's (a module on ``PYTHONPATH``, or an editable install, that may change under the same name and version)
is never stored: :func:`fingerprint` says None. The files are
``<directory>/<table>/<sha256 of the fingerprint, table and key>.pkl``, each written whole (a temporary file renamed
over it); one that does not read back is computed again and rewritten.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

__all__ = ["AnswerStore", "DEFAULT_DIR", "ENV", "fingerprint", "store_directory"]

#: Where the planner keeps its answers, relative to the working directory (as ``outputs/calibration/``).
DEFAULT_DIR = "outputs/cache"
#: The environment variable that moves the store (a directory) or turns it off (``off`` or empty).
ENV = "ZEROEXP_CACHE_DIR"
#: The marker of a key whose text names an object's address: not the same key in another process, never stored.
_ADDRESS = " at 0x"


def store_directory(enabled: bool) -> Path | None:
    """The store's directory for an invocation whose ``cache`` key is ``enabled``: ``$ZEROEXP_CACHE_DIR`` where set
    (``off`` or empty: none), else :data:`DEFAULT_DIR`; None when off."""
    if not enabled:
        return None
    where = os.environ.get(ENV)
    if where is None:
        return Path(DEFAULT_DIR)
    return None if where.strip().lower() in ("", "off") else Path(where)


def _zeroexp_sources() -> str:
    """sha256 of zeroexp's sources: every ``.py`` file of the package, its path and bytes, in path order (about
    20 ms; read once per invocation, where its store opens)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _distribution(module: str) -> str | None:
    """``name==version`` of the installed distribution named as ``module``'s top-level package (torch, transformers,
    deepspeed), ``zeroexp`` for zeroexp's own (its sources are hashed); None for any other code: a module on
    ``PYTHONPATH``, or an editable install (``pip install -e``: its code changes under the same version)."""
    top = str(module).split(".", 1)[0]
    if top == "zeroexp":
        return "zeroexp"
    try:
        dist = metadata.distribution(top)
    except metadata.PackageNotFoundError:
        return None
    try:  # PEP 610's record of a direct install: {"dir_info": {"editable": true}, ...}
        editable = json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable", False)
    except ValueError:
        editable = False
    if editable:
        return None
    return f"{top}=={dist.version}"


def fingerprint(code: Iterable[str], files: Iterable[str] = ()) -> str | None:
    """The fingerprint answers about a model are stored under (see the module): zeroexp's sources, Python's, torch's
    and transformers' versions, the distribution of each import path in ``code`` (the model's ``_target_``, its
    unit classes) and the bytes of each of ``files`` the model is built from (a Hugging Face ``config.json``, or the
    one in a directory); None where an import path is no installed distribution's nor zeroexp's, or a file does
    not read."""
    parts = [f"python=={sys.version}", _zeroexp_sources()]
    for name in ("torch", "transformers"):  # what builds and traces every model
        dist = _distribution(name)
        if dist is None and importlib.util.find_spec(name) is not None:  # editable, or not a distribution's
            return None
        parts.append(dist or f"{name}: none")
    for path in sorted(set(code)):
        dist = _distribution(path)
        if dist is None:
            return None
        parts.append(dist)
    for name in sorted(set(files)):
        path = Path(name) / "config.json" if Path(name).is_dir() else Path(name)
        try:
            parts.append(f"{name}: {hashlib.sha256(path.read_bytes()).hexdigest()}")
        except OSError:
            return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass
class AnswerStore:
    """The answers of :data:`zeroexp.cell.memo.STORED_TABLES` under ``directory`` for code ``fingerprint``;
    ``read`` and ``written`` count what an invocation took from it and gave it."""

    directory: Path
    fingerprint: str
    read: dict[str, int] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)

    def _path(self, table: str, key: Any) -> Path | None:
        text = repr(key)
        if _ADDRESS in text:
            return None
        digest = hashlib.sha256(f"{self.fingerprint}\n{table}\n{text}".encode()).hexdigest()
        return self.directory / table / f"{digest}.pkl"

    def load(self, table: str, key: Any) -> tuple[bool, Any]:
        """(found, the answer) of ``key`` in ``table``; a file that does not read back is not found."""
        path = self._path(table, key)
        if path is None or not path.is_file():
            return False, None
        try:
            with path.open("rb") as f:
                value = pickle.load(f)
        except Exception:  # noqa: BLE001 - a truncated or stale file: computed again and rewritten
            return False, None
        self.read[table] = self.read.get(table, 0) + 1
        return True, value

    def save(self, table: str, key: Any, value: Any) -> None:
        """Write the answer whole (a temporary file renamed over the answer's); an answer that does not pickle, or a
        directory that cannot be written, keeps nothing."""
        path = self._path(table, key)
        if path is None:
            return
        tmp = None
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception:  # noqa: BLE001 - nothing kept: the next invocation computes it again
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return
        self.written[table] = self.written.get(table, 0) + 1

    def summary(self) -> str:
        """One line for the invocation's notes: what it read and wrote, where."""
        read, written = sum(self.read.values()), sum(self.written.values())
        return (f"cache: {read} answer(s) of an earlier run with the same model and code read from {self.directory}/, "
                f"{written} written (shapes, traced steps and forwards, counted operators; cache=false computes "
                "every one afresh)")
