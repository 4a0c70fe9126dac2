"""zeroexp's own ZeRO-1 and ZeRO-2 (``zeroexp.strategies.sharding``): no DDP, no library optimizer wrapper.

``wrap`` flattens the trainable parameters into padded buckets (and casts them to the precision's
``param_dtype``, keeping an fp32 master shard), ``make_optimizer`` returns :class:`ShardedAdamW`, whose
``step`` runs Lightning's closure (forward, zero_grad, backward), then reduce_scatter -> AdamW on this rank's
shard -> all_gather. See Rajbhandari et al., ZeRO, arXiv:1910.02054, sections 5.1 and 7.2.1.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zeroexp.formulas import Groups, Shard
from zeroexp.formulas.rows import row_of
from zeroexp.strategies.sharding import (Bucket, DynamicLossScale, ShardedAdamW, flatten_into_buckets,
                                         gather_full_masters)
from zeroexp.errors import ConfigError
from zeroexp.models import torch_dtype
from zeroexp.strategies import register
from zeroexp.strategies.base import (StateTensor, StrategyAdapter, optimizer_state_tensors,
                                     parameter_state_tensors)
from zeroexp.cell.policy import CellPolicy
from zeroexp.cell.strategy import ZeroConfig


def _cast_floating_inputs(dtype: torch.dtype) -> Callable[..., Any]:
    """A forward pre-hook casting the floating-point tensor arguments (top level only) to ``dtype``."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def _loss_scaling_precision(scale: DynamicLossScale) -> Any:
    """Lightning's 32-true precision plugin whose backward multiplies the loss by ``scale.value`` (fp16)."""
    from lightning.pytorch.plugins.precision import Precision

    class LossScaling(Precision):
        def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
            return super().pre_backward(tensor * scale.value, module)

    return LossScaling()


class ShardedZeroAdapter(StrategyAdapter):
    """Shared by ``zero1`` and ``zero2``: the stage is their row's (``StateLayout.stage``). It keeps each module it
    wrapped with its buckets and optimizer (a checkpoint's restore wraps a second module beside the trained one)."""

    schema = ZeroConfig
    checkpoint_kinds = frozenset({"full", "sharded"})  # zeroexp.strategies._zero_checkpoint
    moved_kinds = frozenset({"full", "sharded"})

    def __init__(self, policy: CellPolicy) -> None:
        super().__init__(policy)
        p = self.policy.precision
        self.dtype = torch_dtype(p.param_dtype)
        self.loss_scale = None if p.loss_scale is None else DynamicLossScale(p.loss_scale, p.growth_interval)
        self.buckets: list[Bucket] = []
        self.module: nn.Module | None = None
        self.optimizer: ShardedAdamW | None = None
        self._held: dict[int, tuple[list[Bucket], ShardedAdamW | None]] = {}  # by id of the module wrapped

    @classmethod
    def validate(cls, cfg) -> None:
        s, p = cfg.strategy, cfg.precision
        if s.reduce not in ("reduce_scatter", "allreduce"):
            raise ConfigError("strategy.reduce", s.reduce, "reduce_scatter, allreduce")
        if not s.bucket_cap_mb > 0:
            raise ConfigError("strategy.bucket_cap_mb", s.bucket_cap_mb, "a positive number of MiB")
        if p.get("loss_scale") is not None and not (p.loss_scale > 0 and p.growth_interval >= 1):
            raise ConfigError("precision.loss_scale", p.loss_scale, "null or a positive initial scale, with "
                              "precision.growth_interval >= 1")

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """Flatten the trainable parameters into buckets (views) in the compute dtype; no wrapper module."""
        self.module = module
        cap = int(float(self.config.bucket_cap_mb) * 1024 * 1024)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = flatten_into_buckets(trainable, dist.get_world_size(), dist.get_rank(), cap, self.dtype)
        self._held[id(module)] = (self.buckets, None)
        if self.dtype != torch.float32:
            for t in [*module.buffers(), *(p for p in module.parameters() if not p.requires_grad)]:
                if t.is_floating_point():
                    t.data = t.data.to(self.dtype)
            for child in module.children():  # the LightningModule's net: its inputs in the compute dtype
                child.register_forward_pre_hook(_cast_floating_inputs(self.dtype), with_kwargs=True)
        return module

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        bucketed = {id(p) for b in self.buckets for p in b.params}
        if any(p.requires_grad and id(p) not in bucketed for p in params):
            raise ValueError("make_optimizer got parameters that wrap() did not flatten")
        optimizer = ShardedAdamW(self.buckets, stage=row_of(self.layout).stage, reduce=str(self.config.reduce),
                                 clip_grad_norm=self.config.clip_grad_norm, loss_scale=self.loss_scale,
                                 **self.optimizer_kwargs())
        self.optimizer = optimizer
        self._held[id(self.module)] = (self.buckets, optimizer)
        optimizer.overlap_parameter_gather(self.module)  # the next forward waits for each bucket's all_gather
        return optimizer

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """The padded buckets (param; stage 1 grad), the stage-2 gradient shards, the fp32 master shards
        (``master``) and AdamW's moments of them; logical numel excludes the padding."""
        buckets = self.held(model)[0]
        for b in buckets:
            yield StateTensor("param", b.flat, b.numel)
            if b.grad is not None:
                yield StateTensor("grad", b.grad, b.numel)
            if b.grad_shard is not None:
                yield StateTensor("grad", b.grad_shard, b.logical_shard_numel)
        yield from parameter_state_tensors(model)  # views into the buckets (not counted twice); frozen ones
        for b in buckets:
            yield StateTensor("master", b.master, b.logical_shard_numel)
        local = optimizer.local if isinstance(optimizer, ShardedAdamW) else optimizer
        yield from optimizer_state_tensors(local, {id(b.master): b.logical_shard_numel for b in buckets})

    def current_loss_scale(self) -> float | None:
        return None if self.loss_scale is None else float(self.loss_scale.value)

    def no_sync(self, model: nn.Module) -> Any:
        """``ShardedAdamW.accumulating``: stage 1 reduces the accumulated buffer once, at the last micro-batch;
        stage 2 reduce-scatters every micro-batch into its gradient shard."""
        return self.held(model)[1].accumulating()

    def clip_gradients(self, model: nn.Module) -> None:
        """Nothing here: ``ShardedAdamW.step`` clips the averaged gradient shards by their global norm (one fp32
        all_reduce of the squared norm), after the reduce_scatter."""

    @property
    def computes_grad_norm(self) -> bool:
        """``ShardedAdamW.step`` takes the global norm where it clips or scales the loss (fp16)."""
        return self.clip_grad_norm is not None or self.loss_scale is not None

    def step_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The norm ``ShardedAdamW.step`` all-reduced (``taken["norm"]``), where it took and kept one."""
        taken = self.held(model)[1].taken
        norm, taken["norm"] = taken["norm"], None
        return norm if self.computes_grad_norm else None

    def keep_grad_norm(self, model: nn.Module, keep: bool) -> None:
        self.held(model)[1].taken["keep"] = keep

    grad_norm_unavailable = ("zeroexp's ZeRO reduces the gradients inside its optimizer step (its reduce_scatter "
                             "waited there): before the step no rank holds its averaged shard; it takes the norm "
                             "only where it clips (strategy.clip_grad_norm) or scales the loss")

    def grad_norm(self, model: nn.Module) -> Any:
        raise NotImplementedError(self.grad_norm_unavailable)

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """Each flat bucket as it is laid out (its parameters' element ranges, its padded length): one reduce_scatter
        (or all_reduce) and one all_gather each per step."""
        buckets = self.held(model)[0]
        shards = tuple(Shard(tuple((off, off + p.numel()) for p, off in zip(b.params, b.offsets)), b.flat.numel())
                       for b in buckets)
        numels = tuple(p.numel() for b in buckets for p in b.params)
        frozen = tuple(p.numel() for p in model.parameters() if not p.requires_grad)
        return Groups(self.layout, dist.get_world_size(), numels, shards, frozen=frozen)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """The fp32 master shards all-gathered (what the optimizer trains; the compute parameters are their
        cast): a collective, enter it on every rank. Parameters outside the buckets are returned as they are."""
        buckets, optimizer = self.held(model)
        with torch.no_grad():
            if optimizer is not None:  # the last step's all_gather: in flight until now
                optimizer.wait_for_parameters()
            full = gather_full_masters(buckets)
            yield {name: full.get(p, p.detach()) for name, p in model.named_parameters()}

    def held(self, model: nn.Module) -> tuple[list[Bucket], ShardedAdamW | None]:
        """The buckets and the optimizer of the module ``model`` (the last wrapped where it is no module wrapped)."""
        return self._held.get(id(model), (self.buckets, self.optimizer))

    def checkpoint_format(self, kind: str) -> str:
        if kind == "sharded":
            return ("torch.distributed.checkpoint, by parameter name (torch's state-dict layout): each rank its pieces "
                    "of every parameter's fp32 master and AdamW moments, as its bucket shards cut them")
        return ("each bucket's fp32 master and AdamW moments all-gathered and cut into its parameters; rank 0 writes "
                "them by name with Adam's step (torch's state-dict layout) to one file")

    def full_state_dicts(self, model: nn.Module, optimizer: Any) -> tuple[dict, dict]:
        from zeroexp.strategies._zero_checkpoint import full_state

        return full_state(model, *self.held(model))

    def save_checkpoint(self, kind: str, path: Any, model: nn.Module, optimizer: Any) -> list[Any]:
        from zeroexp.strategies._checkpoint import dcp_files, write_full
        from zeroexp.strategies._zero_checkpoint import save_sharded_state

        if kind == "sharded":
            save_sharded_state(path, model, *self.held(model))
            return dcp_files(path, dist.get_rank())
        return write_full(path, *self.full_state_dicts(model, optimizer))

    def load_checkpoint(self, kind: str, path: Any, model: nn.Module, optimizer: Any) -> None:
        from zeroexp.strategies._checkpoint import read_full
        from zeroexp.strategies._zero_checkpoint import load_full_state, load_sharded_state

        if kind == "sharded":
            return load_sharded_state(path, model, *self.held(model))
        load_full_state(model, *self.held(model), read_full(path))

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        strategy = super().lightning_strategy(timeout_s, backend)
        if self.loss_scale is not None:
            strategy.precision_plugin = _loss_scaling_precision(self.loss_scale)
        return strategy


@register
class Zero1Adapter(ShardedZeroAdapter):
    name = "zero1"
    semantics = (
        "ZeRO-1 (P_os) by hand: parameters and gradients replicated in the compute dtype, the fp32 master and "
        "Adam moments sharded 1/N; gradients reduce-scattered, updated shards all-gathered."
    )


@register
class Zero2Adapter(ShardedZeroAdapter):
    name = "zero2"
    semantics = (
        "ZeRO-2 (P_os+g) by hand: parameters replicated; after the reduce_scatter each rank keeps only its "
        "gradient shard; the fp32 master and Adam moments sharded 1/N."
    )
