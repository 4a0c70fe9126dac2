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


def file_payload(path: Path, items: dict[str, list[tuple[int, int]]] | None = None) -> int:
    """The tensors' bytes of one checkpoint file: a ``torch.save`` archive, or a ``.distcp`` file whose items
    (``items``: per file name, each item's offset and length, from DCP's metadata) are read one by one."""
    if path.name == ".metadata":
        return 0
    if path.suffix == ".distcp":
        total = 0
        with open(path, "rb") as f:
            for offset, length in (items or {}).get(path.name, []):
                f.seek(offset)
                total += _zip_payload(io.BytesIO(f.read(length)))
        return total
    with open(path, "rb") as f:
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
