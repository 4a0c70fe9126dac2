"""zeroexp's ZeRO-1/2 (zeroexp.strategies.zero) checkpoints, ``full`` only, in torch's state-dict layout.

Each rank holds its 1/N shard of every flat bucket's fp32 master and of AdamW's moments over it (``ShardedAdamW``'s
local AdamW; ``Bucket``): a full checkpoint all-gathers each bucket's master and both moments (three all_gathers a
bucket, the bucket's padded length each) and cuts them into the parameters they hold, so that rank 0 writes every
trained parameter's fp32 master, moments and Adam's step by name (the module's other tensors, frozen parameters and
buffers, as the module holds them): the layout ``get_state_dict(full_state_dict)`` writes for DDP and FSDP, which any
strategy of that layout loads, and whose checkpoints these load (``checkpoint.load_from``). Loading: every rank reads
the file, lays each bucket's parameters out in a full fp32 buffer (the padding zero), keeps its shard as the master
and the moments (Adam's step the file's latest: the local AdamW steps every bucket together) and the cast of the whole
as the compute parameters, as the step's all_gather leaves them. No sharded kind: the buckets cut parameters at any
element, which torch.distributed.checkpoint's shards cannot describe (FSDP1's flat parameters are all-gathered per
parameter for the same reason, ``SHARDED_STATE_DICT``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroexp.strategies._checkpoint import latest_step, optim_by_name, whole_model_state
from zeroexp.strategies.sharding import Bucket, ShardedAdamW

__all__ = ["full_state", "load_full_state", "MOMENTS"]

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
