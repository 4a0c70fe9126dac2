"""A zeroexp checkpoint directory as a cell reads it before anything is built: its ``meta.json``, checked.

A checkpoint (``checkpoint=full|sharded``, zeroexp.probes.checkpoint) is its files and ``meta.json``, which rank 0
writes last (a directory without it is an unfinished save): the format, the kind, the strategy and world size that
wrote it, the optimizer step it was taken after, every file's size and SHA-256, and the configuration of the cell
that wrote it (``cell``: model, optimizer, precision, batch size, micro-batches, seed). A cell that starts from one
(``checkpoint.load_from``) reads it here, as :class:`Source`; the same checks refuse a damaged or unfinished
checkpoint before a restore (:func:`verify_checkpoint`). Torch-free: validation reads it before launch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["META", "FORMAT", "CheckpointError", "verify_checkpoint", "file_sha256", "Source", "cell_record"]

META = "meta.json"
FORMAT = "zeroexp-checkpoint/1"
#: The keys of a cell that wrote a checkpoint, as its ``meta.json`` records them (``cell``): what a cell that loads it
#: compares with its own (the model and the optimizer must be the same; the rest may change) and reports.
CELL_KEYS = ("model", "optimizer", "precision", "batch_size", "grad_accum", "seed", "world_size")


class CheckpointError(RuntimeError):
    """A checkpoint that zeroexp refuses to load; the message says which file or field and why."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: Path | str, *, kind: str | None = None, strategy: str | None = None,
                      world_size: int | None = None, hash_files: Iterable[str] | None = None) -> dict[str, Any]:
    """Check a checkpoint directory against its ``meta.json`` before anything is loaded; return the meta.

    Refuses (``CheckpointError``): no or unreadable ``meta.json``; another ``kind`` or ``strategy`` than
    given; a sharded checkpoint written by another ``world_size`` (its files hold that many ranks' shards);
    a listed file that is missing or whose size differs (truncated); a SHA-256 that differs (altered). Only
    the files named in ``hash_files`` are hashed (default: all). Issues no collective.
    """
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: no {META}: not a zeroexp checkpoint, or its save did not finish")
    try:
        meta = json.loads(meta_path.read_text())
        files = list(meta["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({type(e).__name__}: {e}): the checkpoint is corrupted") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r}, this zeroexp reads {FORMAT!r}")
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"{path}: a {meta.get('kind')} checkpoint; a {kind} one was asked for")
    if strategy is not None and meta.get("strategy") != strategy:
        raise CheckpointError(f"{path}: written by strategy={meta.get('strategy')}; it loads only into that "
                              f"strategy, not into strategy={strategy}")
    if world_size is not None and meta.get("kind") == "sharded" and meta.get("world_size") != world_size:
        raise CheckpointError(f"{path}: a sharded checkpoint written by {meta.get('world_size')} ranks; it holds "
                              f"their shards and loads only at world_size={meta.get('world_size')}, not "
                              f"world_size={world_size}")
    to_hash = None if hash_files is None else set(hash_files)
    for entry in files:
        file = path / entry["name"]
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {META}, written by rank {entry['rank']})")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{file}: {size} bytes, {META} says {entry['bytes']}: the file is truncated or "
                                  "corrupted")
        if (to_hash is None or entry["name"] in to_hash) and file_sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: its SHA-256 differs from the one in {META}: the file was altered "
                                  "or corrupted")
    return meta


def cell_record(cfg: Any) -> dict[str, Any]:
    """What ``meta.json`` records of the cell that writes it (:data:`CELL_KEYS`), resolved to plain values."""
    from omegaconf import DictConfig, OmegaConf

    return {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
            for k in CELL_KEYS}


@dataclass(frozen=True)
class Source:
    """The checkpoint a cell starts from: where (``dir``, absolute), what wrote it (``kind``, ``strategy``,
    ``world_size``, ``cell``: :data:`CELL_KEYS` of its cell) and after which optimizer step (``step``, counted from
    the first step of the run that began it: a cell that loads it trains steps ``step``, ``step + 1``, ...)."""

    dir: str
    kind: str
    strategy: str
    world_size: int
    step: int
    cell: Mapping[str, Any]
    label: str = ""  # the strategy with its axes (``deepspeed-stage3``; a checkpoint written before labels: its name)

    @property
    def precision(self) -> str:
        return str(self.cell["precision"]["name"])

    @classmethod
    def read(cls, path: str | Path, verify: bool = True) -> Source:
        """The checkpoint at ``path``; ``verify``: every file checked against its size and SHA-256 first
        (:func:`verify_checkpoint`; validation's, before launch), else ``meta.json`` alone (a rank's, after it).
        ``CheckpointError`` for one zeroexp cannot start from."""
        path = Path(path).expanduser().resolve()
        meta = verify_checkpoint(path, hash_files=None if verify else ())
        cell = meta.get("cell")
        if not isinstance(cell, dict) or any(k not in cell for k in CELL_KEYS):
            raise CheckpointError(f"{path / META}: records no cell configuration (a checkpoint of a zeroexp before "
                                  "checkpoints recorded their cell): a cell cannot start from it")
        return cls(dir=str(path), kind=str(meta["kind"]), strategy=str(meta["strategy"]),
                   world_size=int(meta["world_size"]), step=int(meta["step"]), cell=cell,
                   label=str(meta.get("strategy_label") or meta["strategy"]))

    def record(self) -> dict[str, Any]:
        """``summary.json["checkpoint"]["moved"]["source"]``: where the state came from."""
        return {"dir": self.dir, "kind": self.kind, "strategy": self.strategy, "label": self.label or self.strategy,
                "world_size": self.world_size, "step": self.step, "precision": self.precision}
