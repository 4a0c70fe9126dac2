"""``init=meta`` in the adapters: the model arrives built on the meta device; each rank materialises its part and
fills it with the full build's values (:func:`zeroexp.models.init.replay_init`, from a second meta copy of the model).

- replicas (``ddp``, ``zro``, ``zero1``, ``zero2``: every rank keeps every parameter): :func:`fill_replica`, the
  whole model materialised on the rank, as ``init=full`` holds it, only drawn one module at a time;
- FSDP1: :func:`fsdp1_param_init_fn` materialises each unit empty just before FSDP flattens and shards it,
  :func:`fill_flat_shards` then writes each parameter's part of the rank's FlatParameter shard;
- FSDP2: ``fully_shard`` on the meta model, ``to_empty`` (only the local shards), :func:`fill_dtensors`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zeroexp._lib.fsdp1 import flat_param, param_infos, shard_param_infos, shared_param_infos
from zeroexp._lib.modules import own_parameters
from zeroexp.models import build_model
from zeroexp.models.init import replay_init

__all__ = ["is_meta", "to_empty_tied", "fill_replica", "fsdp1_param_init_fn", "fill_flat_shards", "fill_dtensors"]


def is_meta(module: nn.Module) -> bool:
    """True when ``module`` was built on the meta device (``init=meta``)."""
    return any(p.is_meta for p in module.parameters())


def _replay(policy: Any, sink: Callable[[str, torch.Tensor], None]) -> int:
    """Replay the cell's model initialisation from ``policy.seed`` (its CellPolicy) on a meta copy of the model into
    ``sink``."""
    with torch.device("meta"):
        source = build_model(policy.model)
    return replay_init(source, policy.seed, sink)


def _net(module: nn.Module) -> nn.Module:
    # the user's model inside the LightningModule (zeroexp.models.module.CellModule)
    return getattr(module, "net", module)


def _params_by_name(root: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``root`` by their names in the model as built (``activation_checkpointing``'s wrappers
    left out of the names)."""
    from zeroexp._lib.checkpointing import checkpoint_prefix

    prefix = checkpoint_prefix()
    return {name.replace(prefix, ""): p for name, p in root.named_parameters()}


def to_empty_tied(module: nn.Module, device: torch.device, memo: dict[int, Any], recurse: bool = True) -> None:
    """``module.to_empty(device)`` that keeps tied parameters tied (``nn.Module.to_empty`` gives each module its own
    tensor: the GPT's head would no longer be its embedding): each meta parameter, by identity, becomes one new
    uninitialised parameter, ``memo`` holding weak references to those made so far (share it across calls on one
    model's modules; weak: FSDP1 frees each unit's parameters once it has flattened and sharded them)."""
    import weakref

    for m in module.modules() if recurse else (module,):
        for name, p in own_parameters(m).items():
            if p is not None and p.is_meta:
                new = memo[id(p)]() if id(p) in memo else None
                if new is None:
                    new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                    memo[id(p)] = weakref.ref(new)
                own_parameters(m)[name] = new


def fill_replica(module: nn.Module, device: torch.device, policy: Any) -> None:
    """Materialise every parameter of ``module`` on ``device`` and give it the full build's value."""
    to_empty_tied(module, device, {})
    params = _params_by_name(_net(module))
    with torch.no_grad():
        _replay(policy, lambda name, value: params[name].copy_(value))


def fsdp1_param_init_fn(device: torch.device) -> Callable[[nn.Module], None]:
    """FSDP1's ``param_init_fn``: called on each module of a unit about to be flattened and sharded, it allocates
    the module's own parameters (uninitialised: :func:`fill_flat_shards` writes the rank's shard after wrapping)."""
    memo: dict[int, Any] = {}  # the meta parameters of the model, by identity: a tied one stays one

    def init(module: nn.Module) -> None:
        to_empty_tied(module, device, memo, recurse=False)
    return init


def fill_flat_shards(model: nn.Module, names: dict[int, str], policy: Any) -> None:
    """Write each original parameter's part of this rank's FlatParameter shards (``_shard_param_infos``).
    ``names``: ``id(module) -> its name in the user's model``, taken before wrapping."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    where: dict[str, tuple[Any, int]] = {}
    for unit in FullyShardedDataParallel.fsdp_modules(model):
        flat = flat_param(unit)
        if flat is None:
            continue
        for i, info in enumerate(param_infos(flat)):
            where[_join(names[id(info.module)], info.param_name)] = (flat, i)
        for shared in shared_param_infos(flat):  # a tied parameter's other names: its primary's place
            where[_join(names[id(shared.module)], shared.param_name)] = \
                where[_join(names[id(shared.prim_module)], shared.prim_param_name)]

    def sink(name: str, value: torch.Tensor) -> None:
        flat, i = where[name]
        info = shard_param_infos(flat)[i]
        if info.in_shard:
            flat.data[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard].copy_(
                value.reshape(-1)[info.intra_param_start_idx:info.intra_param_end_idx + 1])

    with torch.no_grad():
        _replay(policy, sink)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def fill_dtensors(root: nn.Module, policy: Any) -> None:
    """Write each DTensor parameter's local shard of ``root`` (after ``fully_shard`` and ``to_empty``): the rows
    of the full value its placement gives this rank (FSDP2: dim 0 chunked as ``torch.chunk``, ceil(rows / n) each,
    the last ranks' chunks short or empty). The rows are sliced, not indexed: no index tensor is allocated."""
    from torch.distributed.tensor import DTensor

    params = _params_by_name(root)

    def sink(name: str, value: torch.Tensor) -> None:
        p = params[name]
        if not isinstance(p, DTensor):
            p.detach().copy_(value)
            return
        local, mesh, coords = p.to_local(), p.device_mesh, p.device_mesh.get_coordinate()
        index = [slice(None)] * value.dim()
        for mesh_dim, placement in enumerate(p.placements):
            if placement.is_shard():
                d = placement.dim
                start = coords[mesh_dim] * -(-value.shape[d] // mesh.size(mesh_dim))
                index[d] = slice(start, start + local.shape[d])
        local.copy_(value[tuple(index)])

    with torch.no_grad():
        _replay(policy, sink)
