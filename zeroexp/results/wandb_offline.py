"""Read an offline W&B run file (``run-<id>.wandb``) without a W&B account or network.

wandb >= 0.2x writes runs through its Go core and ships no Python reader. The file is a LevelDB-style log
(wandb's ``datastore`` format): a 7-byte header (``:W&B``, magic 0xBEE1, version 1), then 32 KiB blocks of
records, each with a 7-byte header (CRC-32C, little-endian length, type FULL/FIRST/MIDDLE/LAST); every
assembled record is a serialised ``wandb_internal_pb2.Record``. zeroexp uses this to test what it logged and
to let users inspect a sweep's runs before ``wandb sync``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

__all__ = ["iter_records", "read_run"]

_HEADER = b":W&B"
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if not data.startswith(_HEADER):
        raise ValueError("not a W&B run file (missing ':W&B' header)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end of a block
            pos += room - 7 - length if room - 7 - length > 0 else 0


def iter_records(path: Path | str) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` in the run file, in order."""
    from wandb.proto import wandb_internal_pb2

    for payload in _payloads(Path(path).read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        yield rec


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: Path | str) -> dict[str, Any]:
    """``{"run": {id, name, group, job_type}, "config": {...}, "summary": {...}, "history": [rows]}``."""
    out: dict[str, Any] = {"run": {}, "config": {}, "summary": {}, "history": []}
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out["run"] = {"id": r.run_id, "name": r.display_name, "group": r.run_group, "job_type": r.job_type,
                          "project": r.project}
            for item in r.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][_key(item)] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    return out
