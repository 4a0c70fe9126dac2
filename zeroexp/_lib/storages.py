"""A tensor storage's identity as torch keeps it. A leaf: it imports nothing of zeroexp, nor torch."""

from __future__ import annotations

from typing import Any

__all__ = ["storage_address"]


def storage_address(storage: Any) -> int:
    """The address of an untyped storage's C++ ``StorageImpl``: one per storage however many tensors view it, also
    for a storage with no data pointer (a fake tensor's): ``UntypedStorage._cdata`` (private; torch 2.13)."""
    return storage._cdata
