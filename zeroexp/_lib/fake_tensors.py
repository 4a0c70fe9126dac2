"""torch's fake tensors (``torch._subclasses.fake_tensor``, private: no public path in torch 2.13) as zeroexp uses
them: the planner's traces and the dry run. A leaf: it imports nothing of zeroexp; torch's module is imported when a
function is called."""

from __future__ import annotations

from typing import Any

__all__ = ["fake_tensor_mode", "real_tensors", "is_data_dependent", "untraceable"]


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


def untraceable(exc: BaseException) -> str | None:
    """Why a model's step cannot run on fake tensors, where ``exc`` (or one of its causes) says so, else None: an op
    whose output's shape depends on its input's values (``DynamicOutputShapeException``: ``nonzero``, boolean
    masking), one that reads values (``DataDependentOutputException``: ``.item()``, ``.tolist()``), one without a fake
    kernel (``UnsupportedOperatorException``) (``torch._subclasses.fake_tensor``, torch 2.13)."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedOperatorException)

    what = {DynamicOutputShapeException: "its output's shape depends on the input's values",
            DataDependentOutputException: "it reads a tensor's values",
            UnsupportedOperatorException: "torch has no fake-tensor kernel for it"}
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        for kind, why in what.items():
            if isinstance(cause, kind):
                op = cause.args[0] if cause.args else kind.__name__
                return f"{op}: {why} ({kind.__name__})"
        cause = cause.__cause__ or cause.__context__
    return None
