"""A dry run's functional collectives: issued on the fake process group, as a real run issues them.

A functional collective (``torch.ops._c10d_functional.all_reduce`` and its kin: DTensor's ``full_tensor()`` and
``redistribute``, which FSDP2's gradient clipping runs, ``get_total_norm(...).full_tensor()``) reaches the process
group through C++ in a real run, where the profiler records the ``c10d::*`` op it issues. Under ``FakeTensorMode``
the functional op runs its fake kernel only: no ``c10d::*`` op, so a dry run would not see it. While
:class:`IssueFunctionalCollectives` is active (inside ``FakeTensorMode``: zeroexp.rank.dryrun), each one issues the
``c10d`` collective it stands for on the group it names (the fake process group: it returns at once), with the
output's fake shape; every other op passes through.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["IssueFunctionalCollectives"]

#: ``_c10d_functional``'s reduce_op strings -> c10d's ReduceOp.
_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
           "product": dist.ReduceOp.PRODUCT}


def _all_reduce(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out, op=_REDUCE[reduce_op.lower()], group=_resolve_process_group(group_name))
    return out


def _all_reduce_(tensor: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    dist.all_reduce(tensor, op=_REDUCE[reduce_op.lower()], group=_resolve_process_group(group_name))
    return tensor


def _all_gather(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    out = tensor.new_empty((tensor.shape[0] * group_size, *tensor.shape[1:]))
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=_resolve_process_group(group_name))
    return out


def _reduce_scatter(tensor: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    out = tensor.new_empty((tensor.shape[0] // group_size, *tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_REDUCE[reduce_op.lower()],
                               group=_resolve_process_group(group_name))
    return out


def _handlers() -> dict[Any, Callable[..., torch.Tensor]]:
    ops = torch.ops._c10d_functional
    return {ops.all_reduce.default: _all_reduce, ops.all_reduce_.default: _all_reduce_,
            ops.all_gather_into_tensor.default: _all_gather, ops.reduce_scatter_tensor.default: _reduce_scatter}


class IssueFunctionalCollectives(TorchDispatchMode):
    """Each functional all_reduce, all_gather_into_tensor and reduce_scatter_tensor issues its ``c10d`` collective (see
    the module docstring); any other functional collective keeps its fake kernel (and is not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.handlers = _handlers()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):  # DTensor's own dispatch issues its collectives (a Partial
            return NotImplemented                          # norm's all_reduce) as local ops, which then come here
        handler = self.handlers.get(func)
        return func(*args, **(kwargs or {})) if handler is None else handler(*args, **(kwargs or {}))
