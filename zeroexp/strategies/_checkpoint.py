"""Full and sharded checkpoints through ``torch.distributed.checkpoint.state_dict`` (DDP and FSDP adapters).

``get_state_dict(model, optimizer)`` gives FQN-keyed model and optimizer state for DDP and FSDP alike:

- **full** (``full_state_dict=True, cpu_offload=True``): rank 0 gets the whole state on the CPU, the other
  ranks empty dicts; rank 0 writes it to one file, :data:`FULL_FILE`. Loading: every rank reads that file and
  ``set_state_dict`` with ``full_state_dict=True``. (For FSDP1 this is ``FULL_STATE_DICT`` with
  ``offload_to_cpu=True, rank0_only=True``, which fails when the parameters are already on the CPU: the FSDP
  adapter calls FSDP's own API there, see ``zeroexp.strategies.fsdp``.)
- **sharded** (default options): for FSDP1 ``SHARDED_STATE_DICT`` (each rank's shards as ShardedTensors);
  for DDP plain, replicated tensors. ``torch.distributed.checkpoint.save`` writes each rank's items to
  ``__<rank>_0.distcp`` (a replicated tensor is deduplicated by the default save planner and written by one
  rank only) and rank 0 writes ``.metadata``. Loading: ``get_state_dict`` of the fresh model gives the
  tensors to load into (it first initialises the optimizer's state by a zero-gradient step with lr 0),
  ``torch.distributed.checkpoint.load`` fills them in place, ``set_state_dict`` puts them back.

Every function here is a collective: call it on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["FULL_FILE", "save_full", "load_full", "write_full", "read_full", "save_sharded", "load_sharded",
           "save_state_dicts", "load_state_dicts", "dcp_files", "full_state_dicts", "read_whole",
           "drop_state_not_saved", "whole_model_state", "compact", "optim_by_name", "latest_step"]

FULL_FILE = "full.pt"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The whole model and optimizer state on rank 0 (CPU), keyed by parameter name; empty dicts elsewhere."""
    return get_state_dict(model, optimizer, options=_FULL)


def save_full(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
    """Gather the whole model and optimizer state to rank 0 (CPU) and write it there; the files this rank wrote."""
    return write_full(path, *full_state_dicts(model, optimizer))


def write_full(path: Path, model_sd: dict, optim_sd: dict) -> list[Path]:
    """Rank 0 writes the full model and optimizer state dicts to :data:`FULL_FILE`, each tensor compact
    (:func:`compact`); the files this rank wrote."""
    if dist.get_rank() != 0:
        return []
    torch.save(compact({"model": model_sd, "optim": optim_sd}), path / FULL_FILE)
    return [path / FULL_FILE]


def compact(state: Any, done: dict[int, torch.Tensor] | None = None) -> Any:
    """``state`` with every tensor that is a view into a larger storage copied into one of its own size. torch.save
    writes a tensor's whole storage, and a loader that keeps the tensors it reads (DDP's and ZeroRedundancyOptimizer's
    AdamW) keeps all of it: FSDP2's full state dict holds each DTensor made whole as a view of the padded all_gather
    buffer (measured: a 64-row weight at N=3, 66 rows written, the moments loaded into DDP held 1.5 % more bytes than
    they are). One tensor under two names (a tied weight) stays one tensor."""
    done = {} if done is None else done
    if isinstance(state, torch.Tensor):
        if id(state) not in done:
            whole = state.untyped_storage().nbytes() == state.numel() * state.element_size()
            done[id(state)] = state if whole and state.is_contiguous() else state.clone(
                memory_format=torch.contiguous_format)
        return done[id(state)]
    if isinstance(state, dict):
        return {k: compact(v, done) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(compact(v, done) for v in state)
    return state


def read_full(path: Path) -> dict:
    """``{"model": ..., "optim": ...}`` of a :data:`FULL_FILE`, on the CPU (tensors and plain types only)."""
    return torch.load(path / FULL_FILE, map_location="cpu", weights_only=True)


def load_full(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank reads :data:`FULL_FILE` and keeps what its model and optimizer hold of it. Not strict: a parameter no
    step gave a gradient has no optimizer state in the file, which torch 2.13's ``set_state_dict`` refuses as strict
    ("Missing optimizer state for parameter"); the state the load made for it is removed (:func:`drop_state_not_saved`).
    What the load restored is checked by the probe, tensor by tensor (zeroexp.probes.checkpoint: a restore's
    parameters, a move's whole state)."""
    full = read_full(path)
    set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True, strict=False))
    drop_state_not_saved(set(full["optim"]["state"]), model, optimizer)


def save_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
    """Each rank writes its own items with ``torch.distributed.checkpoint``; the files this rank wrote."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(path))
    return dcp_files(path, dist.get_rank())


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a :func:`save_sharded` checkpoint in place into ``model`` and ``optimizer``; a partial load, as
    :func:`load_full` is not strict (the state the load made for a parameter without any in the checkpoint is removed;
    what was restored is the probe's to check)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata  # "optim.state.<name>.<key>"
    saved = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    drop_state_not_saved(saved, model, optimizer)


def save_state_dicts(kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
    """A ``kind`` checkpoint through torch's state-dict API alone (an adapter with nothing of its own to add:
    DDP, FSDP2's HSDP): ``full``, :func:`save_full`; ``sharded``, :func:`save_sharded`."""
    return (save_full if kind == "full" else save_sharded)(path, model, optimizer)


def load_state_dicts(kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore a :func:`save_state_dicts` checkpoint: :func:`load_full` or :func:`load_sharded`."""
    (load_full if kind == "full" else load_sharded)(path, model, optimizer)


def dcp_files(path: Path, rank: int) -> list[Path]:
    """The files ``torch.distributed.checkpoint``'s ``FileSystemWriter`` wrote for ``rank`` (rank 0 also
    the ``.metadata`` it writes as coordinator)."""
    files = sorted(path.glob(f"__{rank}_*.distcp"))
    return files + ([path / ".metadata"] if rank == 0 and (path / ".metadata").exists() else [])


def read_whole(kind: str, path: Path) -> dict:
    """``{"model": ..., "optim": ...}`` of a :func:`save_state_dicts` checkpoint of either kind, whole, on the CPU, in
    this process alone (no collective): a full one as written; a sharded one through torch.distributed.checkpoint's
    ``dcp_to_torch_save`` (its shards read whole, with no process group). What a moved checkpoint is checked against,
    and what the unsharded reference starts from (zeroexp.probes.checkpoint, zeroexp.probes.equivalence)."""
    if kind == "full":
        return read_full(path)
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="zeroexp-whole-") as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(path, whole)
        return torch.load(whole, map_location="cpu", weights_only=True)


def drop_state_not_saved(saved: set[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """After a load of a checkpoint in this layout: the optimizer state the load created for a parameter the
    checkpoint holds none of, removed (torch's state-dict API first gives every trainable parameter zero moments and
    a step, ``_init_optim_state``; a parameter no step had given a gradient has none in the checkpoint, and keeps
    none in a run that was not interrupted). Only a parameter of the model by its own name (a wrapper's prefixes and
    DDP's ``module.`` taken off) whose tensor keys the optimizer's state; ``saved``: the names the checkpoint holds
    optimizer state for. The names removed."""
    from zeroexp._lib.modules import wrapper_prefixes

    prefixes = [*wrapper_prefixes().values(), "module."]
    dropped = []
    for name, p in model.named_parameters():
        for prefix in prefixes:
            name = name.replace(prefix, "")
        if p in optimizer.state and name not in saved and p.requires_grad and "_flat_param" not in name:
            optimizer.state.pop(p)
            dropped.append(name)
    return dropped


def optim_by_name(state: dict, group: dict, names: list) -> dict:
    """An optimizer state dict in this layout: ``state`` by parameter name and one param group, ``group``'s
    hyper-parameters with ``names`` as its parameters (what ``get_state_dict(full_state_dict)`` gives for one group;
    a writer whose optimizer numbers its parameters, or holds flat partitions, names them)."""
    return {"state": state, "param_groups": [{**{k: v for k, v in group.items() if k != "params"}, "params": names}]}


def latest_step(state: dict) -> Any:
    """The latest of Adam's ``step`` among a checkpoint's per-parameter states (None before any step): the one step
    of an optimizer that steps its flat buffers together (a parameter another strategy first graded later holds
    fewer)."""
    steps = [s["step"] for s in state.values() if "step" in s]
    return max(steps, key=float) if steps else None


def whole_model_state(module: nn.Module, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module``'s state dict as a full checkpoint writes it, on the CPU: each parameter's fp32 master from
    ``masters`` (by its first name) under every name it has (a tied parameter's second name too: a sharding strategy
    holds an empty or compute-dtype tensor there), every other entry (frozen parameters outside ``masters``,
    buffers) as the module holds it."""
    first = {id(p): n for n, p in module.named_parameters()}
    copies: dict[int, torch.Tensor] = {}  # one copy of a tensor under two names (a tied frozen weight): written once
    for t in module.state_dict(keep_vars=True).values():
        if first.get(id(t)) not in masters and id(t) not in copies:
            copies[id(t)] = t.detach().to("cpu", copy=True)
    return {n: masters[first[id(t)]] if first.get(id(t)) in masters else copies[id(t)]
            for n, t in module.state_dict(keep_vars=True).items()}
