"""torch's fake tensors (``torch._subclasses.fake_tensor``, private: no public path in torch 2.13) as zeroexp uses
them: the planner's traces and the dry run. A leaf: it imports nothing of zeroexp; torch's module is imported when a
function is called."""

from __future__ import annotations

from typing import Any

__all__ = ["fake_tensor_mode", "real_tensors", "is_data_dependent"]


def fake_tensor_mode() -> Any:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode()`` (torch 2.13): tensors made inside it have shapes,
    dtypes and devices and no data; ``mode.from_tensor(t)`` fakes a real tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def real_tensors() -> Any:
    """A context in which tensors are real again inside a fake tensor mode:
    ``torch._subclasses.fake_tensor.unset_fake_temporarily()`` (torch 2.13)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_data_dependent(exc: BaseException) -> bool:
    """Whether ``exc`` is fake tensors' refusal to read a tensor's values
    (``torch._subclasses.fake_tensor.DataDependentOutputException``, torch 2.13)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    return isinstance(exc, DataDependentOutputException)
