"""zeroexp's ZeRO-1/2 (zeroexp.strategies.zero) checkpoints, ``full`` and ``sharded``, in torch's state-dict layout.

Each rank holds its 1/N shard of every flat bucket's fp32 master and of AdamW's moments over it (``ShardedAdamW``'s
local AdamW; ``Bucket``): a full checkpoint all-gathers each bucket's master and both moments (three all_gathers a
bucket, the bucket's padded length each) and cuts them into the parameters they hold, so that rank 0 writes every
trained parameter's fp32 master, moments and Adam's step by name (the module's other tensors, frozen parameters and
buffers, as the module holds them): the layout ``get_state_dict(full_state_dict)`` writes for DDP and FSDP, which any
strategy of that layout loads, and whose checkpoints these load (``checkpoint.load_from``). Loading: every rank reads
the file, lays each bucket's parameters out in a full fp32 buffer (the padding zero), keeps its shard as the master
and the moments (Adam's step the file's latest: the local AdamW steps every bucket together) and the cast of the whole
as the compute parameters, as the step's all_gather leaves them.

``sharded``: through torch.distributed.checkpoint, keyed as a full checkpoint is, each trained parameter's master and
moments a ShardedTensor (zeroexp._lib.sharded_tensor) whose pieces are this rank's part of it: a bucket's shard cuts a
parameter at any element, and the part of it one rank holds is up to two partial rows and a block of whole ones in
each dimension (:func:`rectangles`), each a contiguous view into the shard; every rank knows every rank's from the
bucket layout. DCP writes each piece as one item and reshards on load, so the checkpoint moves to and from DDP, FSDP1,
FSDP2 and hybrids at any world size; loading fills this rank's pieces of the masters and of fresh moments in place, then
all-gathers the compute parameters as the step does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroexp.strategies._checkpoint import latest_step, optim_by_name, whole_model_state
from zeroexp.strategies.sharding import Bucket, ShardedAdamW

__all__ = ["full_state", "load_full_state", "save_sharded_state", "load_sharded_state", "rectangles", "MOMENTS"]

#: AdamW's element-wise state, sharded with the master.
MOMENTS = ("exp_avg", "exp_avg_sq")


def _gathered(b: Bucket, shard: torch.Tensor) -> torch.Tensor:
    """The bucket-sized fp32 tensor whose rank-``r`` shard is rank r's ``shard`` (an all_gather)."""
    full = torch.empty(b.flat.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard.contiguous())
    return full


def full_state(module: nn.Module, buckets: list[Bucket], optimizer: ShardedAdamW) -> tuple[dict, dict]:
    """Rank 0: the model's and the optimizer's state whole, by name (other ranks: empty dicts). A collective."""
    optimizer.wait_for_parameters()  # the last step's all_gather: in flight until now
    local = optimizer.local
    name_of = {id(p): n for n, p in module.named_parameters()}
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    step, keeps = None, dist.get_rank() == 0
    for b in buckets:
        held = local.state.get(b.master, {})
        full = {"master": _gathered(b, b.master)}
        full.update({k: _gathered(b, held[k] if k in held else torch.zeros_like(b.master)) for k in MOMENTS})
        step = held.get("step", step)
        for p, off in zip(b.params, b.offsets) if keeps else ():  # rank 0 copies each parameter's part to the host
            name = name_of[id(p)]
            masters[name] = full["master"][off:off + p.numel()].view(p.shape).to("cpu", copy=True)
            if held:
                moments[name] = {k: full[k][off:off + p.numel()].view(p.shape).to("cpu", copy=True) for k in MOMENTS}
        del full  # one bucket gathered at a time
    if not keeps:
        return {}, {}
    model_sd = whole_model_state(module, masters)
    state = {n: {**m, "step": step.detach().to("cpu", copy=True)} for n, m in moments.items()}
    return model_sd, optim_by_name(state, local.param_groups[0], [n for n in masters if n in state])


def load_full_state(module: nn.Module, buckets: list[Bucket], optimizer: ShardedAdamW, full: dict[str, Any]) -> None:
    """Set the module's and the optimizer's state from a full checkpoint read whole (``{"model", "optim"}``) on every
    rank: each bucket's master and moments this rank's shard of the parameters' full values, the compute parameters
    their cast, the rest of the module as the file holds it."""
    optimizer.wait_for_parameters()
    name_of = {id(p): n for n, p in module.named_parameters()}
    model_sd, state = full["model"], full["optim"]["state"]
    step = latest_step(state)
    bucketed = {id(p) for b in buckets for p in b.params}
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():  # frozen parameters and buffers as they are
            if id(t) not in bucketed:  # (a tied parameter's second name is its bucketed first)
                t.copy_(model_sd[name].to(t.dtype))
        for b in buckets:
            full_of = {k: torch.zeros(b.flat.numel(), dtype=torch.float32, device=b.master.device)
                       for k in ("master", *MOMENTS)}
            for p, off in zip(b.params, b.offsets):
                name = name_of[id(p)]
                full_of["master"][off:off + p.numel()].copy_(model_sd[name].flatten())
                for k in MOMENTS:
                    if k in state.get(name, {}):
                        full_of[k][off:off + p.numel()].copy_(state[name][k].flatten())
            b.master.copy_(b.shard(full_of["master"]))
            b.flat.copy_(full_of["master"].to(b.flat.dtype))
            if step is not None:
                optimizer.local.state[b.master] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                                   **{k: b.shard(full_of[k]).clone() for k in MOMENTS}}
            del full_of  # one bucket laid out at a time


def rectangles(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangles in it, in order: each
    ``(offsets, sizes, flat start)``; each is contiguous in memory (a partial row of the first dimension that is cut,
    recursively, then whole rows)."""
    if stop <= start:
        return []
    if not shape:  # a scalar: itself
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    head_stop = min(stop, (first + 1) * row)
    if start % row or head_stop - start < row:  # a partial first row
        out += [((first, *o), (1, *z), first * row + f) for o, z, f in
                rectangles(shape[1:], start - first * row, head_stop - first * row)]
        first += 1
    whole_stop = last + 1 if stop % row == 0 else last
    if whole_stop > first:  # whole rows
        out.append(((first, *(0,) * (len(shape) - 1)), (whole_stop - first, *shape[1:]), first * row))
    if stop % row and last >= first and last * row >= start:  # a partial last row
        out += [((last, *o), (1, *z), last * row + f) for o, z, f in rectangles(shape[1:], 0, stop - last * row)]
    return out


def _pieces(b: Bucket, p: nn.Parameter, off: int, shard: torch.Tensor, rank: int) -> list:
    """This rank's rectangles of parameter ``p`` (at ``off`` in bucket ``b``) as views into ``shard`` (the rank's
    shard of a bucket-sized tensor), each with its offsets."""
    lo, hi = max(off, rank * b.shard_numel), min(off + p.numel(), (rank + 1) * b.shard_numel)
    return [(shard[off + f - rank * b.shard_numel:off + f - rank * b.shard_numel + math.prod(z)].view(z), o)
            for o, z, f in rectangles(tuple(p.shape), lo - off, hi - off)]


def _places(b: Bucket, p: nn.Parameter, off: int) -> list:
    """Every rank's rectangles of parameter ``p`` (offsets, sizes, rank)."""
    out = []
    for r in range(b.world_size):
        lo, hi = max(off, r * b.shard_numel), min(off + p.numel(), (r + 1) * b.shard_numel)
        out += [(o, z, r) for o, z, _ in rectangles(tuple(p.shape), lo - off, hi - off)]
    return out


def _sharded_dicts(module: nn.Module, buckets: list[Bucket], shards: dict[int, dict[str, torch.Tensor]],
                   steps: dict[str, torch.Tensor], group: dict) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts, by name, each bucketed parameter's master and moments a
    ShardedTensor of this rank's pieces of ``shards[id(bucket)]`` (``master``, the moments; a parameter of no
    elements a plain empty tensor); the module's other entries as it holds them; optimizer state (both moments and
    ``step``) for the parameters ``steps`` names (none: an empty optimizer state dict)."""
    from zeroexp._lib.sharded_tensor import sharded_tensor

    rank, name_of = dist.get_rank(), {id(p): n for n, p in module.named_parameters()}
    made: dict[str, dict[str, Any]] = {}
    for b in buckets:
        for p, off in zip(b.params, b.offsets):
            name = name_of[id(p)]
            kinds = ("master", *MOMENTS) if name in steps else ("master",)
            made[name] = {k: torch.empty(p.shape, dtype=torch.float32, device=b.master.device) if p.numel() == 0
                          else sharded_tensor(_pieces(b, p, off, shards[id(b)][k], rank), _places(b, p, off),
                                              tuple(p.shape), torch.float32, rank, b.master.device) for k in kinds}
    model_sd = {n: made[name_of[id(t)]]["master"] if name_of.get(id(t)) in made else t
                for n, t in module.state_dict(keep_vars=True).items()}
    state = {n: {**{k: made[n][k] for k in MOMENTS}, "step": t} for n, t in steps.items()}
    return model_sd, (optim_by_name(state, group, list(state)) if state else {})


def save_sharded_state(path: Any, module: nn.Module, buckets: list[Bucket], optimizer: ShardedAdamW) -> None:
    """Each rank writes its pieces of every bucketed parameter's master, and of both moments with a step per
    parameter where its bucket has optimizer state (as a full checkpoint: zeroexp.strategies._zero_checkpoint
    .full_state), through torch.distributed.checkpoint; a replicated entry (a frozen parameter, a buffer) by one rank.
    A collective."""
    import torch.distributed.checkpoint as dcp

    optimizer.wait_for_parameters()
    local = optimizer.local
    held = {id(b): local.state.get(b.master, {}) for b in buckets}
    shards = {id(b): {"master": b.master, **{k: held[id(b)][k] for k in MOMENTS if k in held[id(b)]}} for b in buckets}
    name_of = {id(p): n for n, p in module.named_parameters()}
    steps = {name_of[id(p)]: held[id(b)]["step"].detach().to("cpu", copy=True) for b in buckets if held[id(b)]
             for p in b.params}
    model_sd, optim_sd = _sharded_dicts(module, buckets, shards, steps, local.param_groups[0])
    dcp.save({"model": model_sd, **({"optim": optim_sd} if optim_sd else {})},
             storage_writer=dcp.FileSystemWriter(path))


def load_sharded_state(path: Any, module: nn.Module, buckets: list[Bucket], optimizer: ShardedAdamW) -> None:
    """Fill this rank's pieces of every bucket's master and of fresh moments from a sharded checkpoint in torch's
    layout written by any strategy at any world size (DCP reshards), the module's other entries in place: every
    entry of the module the file must hold (a strict load), the optimizer state of each parameter it holds it for (a
    parameter without keeps zero moments); then the compute parameters as the step's all_gather leaves them and Adam's
    step the checkpoint's latest (on the master's device where the update is fused or capturable, as torch keeps it).
    A collective."""
    import torch.distributed.checkpoint as dcp

    optimizer.wait_for_parameters()
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    shards = {id(b): {"master": b.master, **{k: torch.zeros_like(b.master) for k in MOMENTS}} for b in buckets}
    name_of = {id(p): n for n, p in module.named_parameters()}
    steps = {name_of[id(p)]: torch.zeros((), dtype=torch.float32) for b in buckets for p in b.params
             if f"optim.state.{name_of[id(p)]}.exp_avg" in keys}
    group = optimizer.local.param_groups[0]
    model_sd, optim_sd = _sharded_dicts(module, buckets, shards, steps, group)
    state = {"model": model_sd, **({"optim": {"state": optim_sd["state"]}} if optim_sd else {})}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    with torch.no_grad():
        for b in buckets:
            b.flat.copy_(_gathered(b, b.master).to(b.flat.dtype))
    if not steps:
        return
    step = max(float(t) for t in steps.values())
    for b in buckets:
        on = b.master.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
        optimizer.local.state[b.master] = {"step": torch.tensor(step, dtype=torch.float32, device=on),
                                           **{k: shards[id(b)][k] for k in MOMENTS}}
