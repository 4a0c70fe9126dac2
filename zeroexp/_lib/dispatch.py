"""torch's dispatcher-level internals as zeroexp's probes and traces read them: a dispatch mode's base class, an
operator's argument names, a process group by its registered name, a pytree's leaves. A leaf: it imports nothing of
zeroexp."""

from __future__ import annotations

from typing import Any

__all__ = ["dispatch_mode_base", "op_argument_names", "process_group_named"]


def dispatch_mode_base() -> type:
    """The base class of a Python dispatch mode, which sees every ATen, ``c10d`` and functional-collective op:
    ``torch.utils._python_dispatch.TorchDispatchMode`` (private; torch 2.13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def op_argument_names(func: Any) -> list[str]:
    """The argument names of an operator overload's schema, in order: ``[a.name for a in func._schema.arguments]``
    (``OpOverload._schema``, private; torch 2.13)."""
    return [a.name for a in func._schema.arguments]


def process_group_named(name: str) -> Any:
    """The process group a functional collective's ``group_name`` argument names:
    ``torch.distributed.distributed_c10d._resolve_process_group(name)`` (private; torch 2.13). Raises as torch does
    (RuntimeError, ValueError or KeyError) for a name no group has."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)

