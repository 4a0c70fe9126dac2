"""The tensors' bytes in a checkpoint's files, read from the files: what ``plan.checkpoint`` compares with the
planner's ``zeroexp.formulas.checkpoint.written_bytes``.

A ``torch.save`` file is a zip archive with one record per storage under ``<archive>/data/``: its payload is the sum
of those records' sizes, the rest (the pickled structure, the zip's headers and alignment) serialization.
torch.distributed.checkpoint's ``__<rank>_<i>.distcp`` files hold one item after another, each tensor a
``torch.save`` stream of its own and each other value pickled bytes; ``.metadata`` says where each item lies
(``storage_data``: file, offset, length): a ``.distcp`` file's payload is its tensor items' payloads. ``.metadata``
itself holds none.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

__all__ = ["file_payload", "files_payload"]


def _zip_payload(blob: io.BufferedIOBase | io.BytesIO) -> int:
    """The storages' bytes of one ``torch.save`` archive (0 for bytes that are no zip archive: a pickled value)."""
    try:
        with zipfile.ZipFile(blob) as z:
            return sum(i.file_size for i in z.infolist() if "/data/" in i.filename)
    except zipfile.BadZipFile:
        return 0


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, seekable: one DCP item as the zip reader sees it, which
    reads its end records and central directory alone, not the tensors (a checkpoint's files are not read again)."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence] + pos)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        size = self._length - self._pos if size is None or size < 0 else min(size, self._length - self._pos)
        self._f.seek(self._offset + self._pos)
        data = self._f.read(max(size, 0))
        self._pos += len(data)
        return data


def file_payload(path: Path, items: dict[str, list[tuple[int, int]]] | None = None) -> int:
    """The tensors' bytes of one checkpoint file: a ``torch.save`` archive, or a ``.distcp`` file whose items
    (``items``: per file name, each item's offset and length, from DCP's metadata) are read one by one (their zip
    directories, not their data)."""
    if path.name == ".metadata":
        return 0
    with open(path, "rb") as f:
        if path.suffix == ".distcp":
            return sum(_zip_payload(_Window(f, offset, length)) for offset, length in (items or {}).get(path.name, []))
        return _zip_payload(f)


def files_payload(directory: Path, names: list[str]) -> int:
    """The tensors' bytes of the files ``names`` of a checkpoint ``directory`` (DCP's metadata read where a
    ``.distcp`` file is among them)."""
    items: dict[str, list[tuple[int, int]]] | None = None
    if any(n.endswith(".distcp") for n in names):
        import torch.distributed.checkpoint as dcp

        items = {}
        for info in dcp.FileSystemReader(directory).read_metadata().storage_data.values():
            items.setdefault(Path(info.relative_path).name, []).append((int(info.offset), int(info.length)))
    return sum(file_payload(directory / n, items) for n in names)
