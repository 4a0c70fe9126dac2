"""ZeRO-1 direction in PyTorch: DDP gradients plus ``ZeroRedundancyOptimizer`` (optimizer state by owner).

Each rank updates only the parameters it owns and then broadcasts them (ZeroRedundancyOptimizer docstring:
"each rank is only responsible for updating approximately 1 / world_size parameters and broadcasts those
parameters after each update"); see Rajbhandari et al., ZeRO, arXiv:1910.02054, section 5.1 (P_os).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from zeroexp._lib.parallel import zero_buckets, zero_partitions
from zeroexp.formulas import Groups
from zeroexp.strategies import register
from zeroexp.strategies._checkpoint import optim_by_name, read_full, write_full
from zeroexp.strategies.base import StateTensor
from zeroexp.strategies.ddp import DDPAdapter
from zeroexp.cell.strategy import ZROConfig


@register
class ZROAdapter(DDPAdapter):
    name = "zro"
    schema = ZROConfig
    semantics = (
        "ZeRO-1 (P_os): parameters and gradients replicated, Adam moments only on the owning rank; "
        "owners broadcast their updated parameters after the step."
    )
    moved_kinds = frozenset({"full"})  # consolidated and keyed by name; sharded: each owner's state by index

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """Replicated parameters and gradients, and only the owned moments: the wrapped local optimizer's state.

        ``ZeroRedundancyOptimizer.state`` itself stays empty; the owner state lives in ``optimizer.optim``.
        """
        local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        yield from super().state_tensors(model, local)

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """DDP's live buckets, the owners as the optimizer partitioned the parameters, and its broadcasts after the
        step (``_broadcast_params_from_rank``): one per owned parameter, or with ``parameters_as_bucket_view`` one per
        (device, owner) bucket, empty buckets included."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            raise NotImplementedError("the optimizer is not a ZeroRedundancyOptimizer: no owners to read")
        owners = tuple(tuple(p.numel() for group in owned for p in group["params"])
                       for owned in zero_partitions(optimizer))
        if optimizer.parameters_as_bucket_view:
            broadcasts = tuple(b.numel() for device_buckets in zero_buckets(optimizer) for b in device_buckets)
        else:
            broadcasts = tuple(k for owned in owners for k in owned)
        ddp = super().groups(model, optimizer)
        return replace(ddp, owners=owners, broadcasts=broadcasts)  # DDP's groups, the optimizer's owners beside

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(
            list(params),
            optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=bool(self.config.parameters_as_bucket_view),
            **self.optimizer_kwargs(),
        )

    def checkpoint_format(self, kind: str) -> str:
        if kind == "full":
            return ("ZeroRedundancyOptimizer.consolidate_state_dict(to=0) (every owner broadcasts its state), rank 0 "
                    "writes model and optimizer state to one file, by parameter name (torch's state-dict layout)")
        return ("rank 0 writes the replicated parameters (model.pt), each rank its owned optimizer state "
                "(optim_rank<r>.pt)")

    def full_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Every owner's state consolidated on rank 0 (``consolidate_state_dict(to=0)``, each owner broadcasts), keyed
        by parameter name in torch's state-dict layout (ZeroRedundancyOptimizer numbers its parameters)."""
        optimizer.consolidate_state_dict(to=0)  # a collective: every rank broadcasts what it owns
        if dist.get_rank() != 0:
            return {}, {}
        module, by_index = _unwrapped(model), optimizer.state_dict()
        names = _names(module, optimizer)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                  for g in by_index["param_groups"]]
        return module.state_dict(), {"state": {names[i]: s for i, s in by_index["state"].items()},
                                     "param_groups": groups}

    def save_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
        """full: consolidate to rank 0, one file; sharded: no collective, each rank writes the state it owns."""
        rank, module = dist.get_rank(), _unwrapped(model)
        if kind == "full":
            return write_full(path, *self.full_state_dicts(model, optimizer))
        files = [path / f"optim_rank{rank}.pt"]
        torch.save(optimizer.optim.state_dict(), files[0])  # the local AdamW over the owned parameters
        if rank == 0:
            torch.save(module.state_dict(), path / "model.pt")
            files.insert(0, path / "model.pt")
        return files

    def load_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank reads the parameters; full: the optimizer re-partitions the consolidated state by owner;
        sharded: each rank reads its own optimizer file (same world size, so the same owners)."""
        module = _unwrapped(model)
        if kind == "full":
            full = read_full(path)
            module.load_state_dict(full["model"])
            names = _names(module, optimizer)  # the consolidated state's indices, by parameter name
            index = {name: i for i, name in enumerate(names)}
            state = full["optim"]["state"]
            optimizer.load_state_dict(optim_by_name({index[n]: s for n, s in state.items()},
                                                    full["optim"]["param_groups"][0], list(range(len(names)))))
            return
        module.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
        optimizer.optim.load_state_dict(
            torch.load(path / f"optim_rank{dist.get_rank()}.pt", map_location="cpu", weights_only=True))


def _names(module: nn.Module, optimizer: ZeroRedundancyOptimizer) -> list[str]:
    """The optimizer's parameters by name, in the order its consolidated state dict indexes them (its param groups',
    as ZeroRedundancyOptimizer numbers them)."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _unwrapped(model: nn.Module) -> nn.Module:
    """The LightningModule inside DDP (its state dict keys have no ``module.`` prefix)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
