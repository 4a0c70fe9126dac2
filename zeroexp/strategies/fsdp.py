"""FSDP1 (``FullyShardedDataParallel``): SHARD_GRAD_OP and FULL_SHARD, one unit per wrapped module class.

FSDP flattens each unit's parameters into a FlatParameter, pads it to a multiple of the world size and keeps
one shard per rank (torch/distributed/fsdp/_flat_param.py). SHARD_GRAD_OP keeps the unsharded parameters from
forward until the end of backward; FULL_SHARD frees them after forward and all-gathers again in backward,
where ``BackwardPrefetch`` decides when the next unit's all-gather is issued.
On CPU, FSDP runs with gloo when given ``device_id=torch.device("cpu")``.
"""

from __future__ import annotations

import math

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig,
                                    FullyShardedDataParallel, MixedPrecision, ShardingStrategy, StateDictType)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from zeroexp._lib.fsdp1 import (flat_param, full_param_padded, is_padding_mask, is_root, numels,
                              numels_with_padding, orig_params, padded_unsharded_numel, shard_param_infos)
from zeroexp.formulas import LAYOUTS, Groups, Shard
from zeroexp.formulas.rows import row_of
from zeroexp.devices import ranks_get_a_gpu
from zeroexp.errors import ConfigError, NotApplicableHere
from zeroexp.models import import_class, torch_dtype, wrap_paths
from zeroexp.strategies import register
from zeroexp.strategies._checkpoint import load_sharded, read_full, save_sharded, write_full
from zeroexp.strategies._unit_trace import UnitTrace
from zeroexp.strategies.base import (StateTensor, StrategyAdapter, optimizer_state_tensors, post_order,
                                     parameter_state_tensors)
from zeroexp.cell.strategy import FSDPConfig, FSDPFullConfig


PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}


class FSDPAdapter(StrategyAdapter):
    """Shared FSDP1 wrapping; subclasses fix the sharding strategy."""

    sharding: ShardingStrategy
    schema = FSDPConfig
    dry_run_traced = True  # FSDP1 runs under a fake process group and FakeTensorMode
    #: bf16 / fp16 through ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``: the sharded FlatParameter,
    #: its gradient shard and Adam's moments stay fp32 (the shard is the master); each unit is gathered, computed
    #: and reduce-scattered in the low precision, its gradient cast back to fp32 after the reduce_scatter. fp16
    #: adds a dynamic ``ShardedGradScaler`` (zeroexp.strategies._amp).
    #: offload=full: ``CPUOffload(offload_params=True)`` (parameters, gradients and optimizer state on the host);
    #: needs an accelerator to compute on.
    offloads = frozenset({"none", "full"})

    @classmethod
    def validate(cls, cfg) -> None:
        least = row_of(str(cfg.strategy.layout)).min_world_size  # FSDP2's validate calls this too
        if int(cfg.world_size) < least:
            raise NotApplicableHere("world_size", int(cfg.world_size),
                                    f"an integer >= {least} (FSDP shards over its ranks)",
                                    why=f"at one rank torch shards nothing: FSDP1 runs NO_SHARD (torch.distributed."
                                        f"fsdp._init_utils) and FSDP2 skips its all-gathers and reduce-scatters "
                                        f"(_fully_shard._fsdp_param_group, world_size == 1), so strategy="
                                        f"{cfg.strategy.name} would measure neither; strategy=ddp runs one rank "
                                        "(a sweep skips this job)")
        if cfg.offload.name == "full" and not ranks_get_a_gpu(cfg):
            raise NotApplicableHere("offload", "full", "none (on this machine)",
                                    why="FSDP CPUOffload moves the shards to the host between computations, but this "
                                        "cell runs on the CPU (no GPU for each rank): there is nowhere to offload from")
        own = getattr(cls, "sharding", None)  # FSDP1: the strategy fixes it (fsdp_full, fsdp_grad_op)
        if own is not None and str(cfg.strategy.get("sharding")) != own.name:
            raise ConfigError("strategy.sharding", cfg.strategy.get("sharding"), own.name,
                              why=f"strategy={cfg.strategy.name} is {own.name}; the other sharding is the other "
                                  "strategy (fsdp_full: FULL_SHARD, fsdp_grad_op: SHARD_GRAD_OP)")
        key = "strategy.wrap" if cfg.strategy.wrap is not None else "model.wrap"
        for i, path in enumerate(wrap_paths(cfg)):
            try:
                import_class(str(path))
            except (ImportError, AttributeError, ValueError, TypeError) as e:
                raise ConfigError(f"{key}[{i}]", path, "import paths of nn.Module classes", why=str(e)) from e

    @classmethod
    def validate_model(cls, cfg, shape: Any = None) -> None:
        """Refuse a unit that mixes frozen and trainable parameters without ``strategy.use_orig_params=true``: FSDP1
        flattens a unit's parameters into one FlatParameter, which then needs one ``requires_grad`` ("Must flatten
        tensors with uniform requires_grad" in every rank otherwise). Refuse a parameter that modules of two units
        hold (tied weights split by the wrap): each unit flattens it, so FSDP1 unties it (the model trained is no
        longer the model asked for, its state and collectives twice the tied parameter's), and with
        ``use_orig_params=true`` the head's forward fails ("'weight' must be 2-D")."""
        from zeroexp.plan.shape import model_shape, shared_across_units

        shared = shared_across_units(cfg.model, wrap_paths(cfg))
        if shared:
            key = "strategy.wrap" if cfg.strategy.wrap is not None else "model.wrap"
            raise ConfigError(key, list(wrap_paths(cfg)), "module classes whose units leave each shared parameter's "
                              "modules in one unit (e.g. the model's blocks), or a model without tied weights",
                              why=f"{', '.join(' = '.join(names) for names in shared)}: one parameter held by "
                                  "modules of two FSDP units, which FSDP1 flattens in each (the tie broken)")
        if cfg.strategy.use_orig_params:
            return

        shape = shape if shape is not None else model_shape(cfg.model, wrap_paths(cfg))
        if not shape.trains:
            return
        for unit, root in zip(shape.units, shape.root):
            if len({shape.trains[i] for i in unit}) > 1:
                which = "the root unit (every parameter no wrap class takes)" if root else "a unit of a wrap class"
                raise ConfigError("strategy.use_orig_params", False, "true, or a strategy.wrap whose units hold only "
                                  "frozen or only trainable parameters",
                                  why=f"{which} holds {sum(not shape.trains[i] for i in unit)} frozen and "
                                      f"{sum(shape.trains[i] for i in unit)} trainable parameters, and FSDP1 flattens "
                                      "a unit into one FlatParameter of one requires_grad")

    #: FSDP's own recipe: ``apply_activation_checkpointing`` on the wrapped model (each unit's module inside its
    #: FSDP wrapper is checkpointed, so recompute runs under the unit's gathered parameters).
    checkpoint_after_wrap = True

    def backward_prefetch(self) -> BackwardPrefetch | None:
        return None

    def no_sync(self, model: nn.Module) -> Any:
        """``FullyShardedDataParallel.no_sync`` (unsharded gradients accumulate, no reduce_scatter) unless
        ``strategy.sync_each_microbatch``."""
        from contextlib import nullcontext

        return nullcontext() if self.config.sync_each_microbatch else model.no_sync()

    def clip_gradients(self, model: nn.Module) -> None:
        """``FullyShardedDataParallel.clip_grad_norm_`` on the root: each rank's norm of its gradient shards, one fp32
        all_reduce of their squares' sum (the total norm), each shard scaled by ``max_norm / (norm + 1e-6)``, at most
        1."""
        if self.clip_grad_norm is not None:
            self.took_grad_norm(model.clip_grad_norm_(self.clip_grad_norm))

    def grad_norm(self, model: nn.Module) -> Any:
        """``FullyShardedDataParallel.clip_grad_norm_`` with an infinite max norm: its total norm (one fp32 all_reduce
        of the shards' squares over the root's process group), every gradient scaled by 1."""
        return model.clip_grad_norm_(math.inf)

    checkpoint_kinds = frozenset({"full", "sharded"})
    moved_kinds = frozenset({"full", "sharded"})

    def checkpoint_format(self, kind: str) -> str:
        if kind == "full":
            return ("FULL_STATE_DICT with rank0_only and offload_to_cpu "
                    "(get_state_dict(full_state_dict, cpu_offload)): "
                    "every unit all-gathered, rank 0 writes model and optimizer state to one file")
        return ("SHARDED_STATE_DICT through torch.distributed.checkpoint: each rank writes its own shards "
                "(__<rank>_0.distcp), rank 0 the .metadata")

    def save_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
        """full: FULL_STATE_DICT, rank0_only (every unit all-gathered, then each optimizer state tensor), CPU offload
        on CUDA only (with the parameters already on the CPU, FSDP1's offload_to_cpu frees the gathered storage
        it is about to read, torch 2.13); sharded: zeroexp.strategies._checkpoint.save_sharded."""
        if kind != "full":
            return save_sharded(path, model, optimizer)
        return write_full(path, *self.full_state_dicts(model, optimizer))

    def full_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """FULL_STATE_DICT, rank0_only; CPU offload on CUDA only (see :meth:`save_checkpoint`)."""
        offload = next(model.parameters()).device.type != "cpu"
        with FullyShardedDataParallel.state_dict_type(
                model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=offload, rank0_only=True),
                FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=True)):
            return model.state_dict(), FullyShardedDataParallel.optim_state_dict(model, optimizer)

    def load_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """full: every rank reads the file and keeps its shards (optim_state_dict_to_load); sharded: DCP."""
        if kind != "full":
            return load_sharded(path, model, optimizer)
        full = read_full(path)
        with FullyShardedDataParallel.state_dict_type(
                model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                FullOptimStateDictConfig(rank0_only=False)):
            model.load_state_dict(full["model"])
            optimizer.load_state_dict(
                FullyShardedDataParallel.optim_state_dict_to_load(model, optimizer, full["optim"]))

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """Each unit's FlatParameter local shard and its gradient shard, then the optimizer's tensors.

        A shard's physical size includes FSDP's padding; its logical numel is the elements of original
        parameters that fall in this rank's shard (``_shard_param_infos``), so neither world-size padding
        nor ``use_orig_params`` alignment padding counts as logical (nor, for the gradient, a frozen parameter's
        range). The unsharded padded buffer is reported
        as ``param_unsharded`` only while its storage is allocated. The parameter walk that follows yields the
        ``use_orig_params`` views, which the probe skips as lying inside the shards already counted; Adam's
        moments of a FlatParameter are padded like it and take its logical numel.
        """
        logical_of: dict[int, int] = {}
        for unit in FullyShardedDataParallel.fsdp_modules(model):
            flat = flat_param(unit)
            if flat is None:  # a unit without parameters of its own (e.g. the root of a Linear stack)
                continue
            logical = sum(info.numel_in_shard for info in shard_param_infos(flat) if info.in_shard)
            trains = _trains(flat)
            trained = sum(info.numel_in_shard for info, t in zip(shard_param_infos(flat), trains)
                          if info.in_shard and t)
            logical_of[id(flat)] = trained
            yield StateTensor("param", flat.detach(), logical)
            if flat.grad is not None:  # a frozen parameter's range of it is no gradient: physical, not logical
                yield StateTensor("grad", flat.grad, trained)
            full = full_param_padded(flat)
            if full is not None and full.untyped_storage().nbytes() > 0:
                yield StateTensor("param_unsharded", full, sum(numels(flat)))
        yield from parameter_state_tensors(model)
        yield from optimizer_state_tensors(optimizer, logical_of)

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """Each unit with parameters, children before parents (as FSDP wrapped them): its FlatParameter as laid out
        (the original parameters' element ranges, ``use_orig_params`` alignment padding between them) and padded to N
        [FSDP], gathered twice when FULL_SHARD reshards it after forward, which FSDP skips for the root unit
        (``_post_forward_reshard``: ``not state._is_root``); the prefetch mode changes the order only."""
        shards, grad_shards, units = [], [], []
        twice = self.sharding in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)  # resharded after forward
        for unit in post_order(model, lambda m: isinstance(m, FullyShardedDataParallel) and flat_param(m) is not None):
            flat = flat_param(unit)
            spans, offset = [], 0
            for numel, padding in zip(numels_with_padding(flat), is_padding_mask(flat)):
                if not padding:
                    spans.append((offset, offset + numel))
                offset += numel
            trains = _trains(flat)
            padded = padded_unsharded_numel(flat)
            shards.append(Shard(tuple(spans), padded))
            trained = tuple(sp for sp, t in zip(spans, trains) if t and sp[1] > sp[0])
            if trained and flat.grad is not None:  # read after a step: a unit forward never called has none
                grad_shards.append(Shard(trained, padded))
            calls, reached, after = self._trace.of(unit) or (1, True, True)
            units.append(LAYOUTS[self.layout].family.unit(padded, 2 if twice and not is_root(unit) else 1, calls,
                                                          reached, padded if flat.requires_grad else 0, after))
        n, shard_over = dist.get_world_size(), dist.get_world_size(model.process_group)  # hybrid: the shard group
        apart = bool(self._frozen) or len(grad_shards) < len(shards)
        return Groups(self.layout, n, self._numels, tuple(shards), tuple(units),
                      shard_size=shard_over if shard_over != n else 0, frozen=self._frozen,
                      grad_shards=tuple(grad_shards) if apart else None)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """All-gathers every unit (``summon_full_params``, ``writeback=False``): enter it on every rank.

        Inside the context FSDP restores the original parameters, named without its wrapper prefixes; the
        local shards are left untouched when the context exits.
        """
        with FullyShardedDataParallel.summon_full_params(model, writeback=False, with_grads=False), torch.no_grad():
            yield {name: p.detach() for name, p in model.named_parameters()}

    #: init=meta: each unit materialised just before FSDP flattens and shards it (``param_init_fn``), then the rank's
    #: shard filled with the full build's values (zeroexp.strategies._meta_init).
    meta_init = "shards"

    def wrap_meta(self, module: nn.Module, device: torch.device) -> nn.Module:
        from zeroexp.strategies._meta_init import fill_flat_shards, fsdp1_param_init_fn

        net = getattr(module, "net", module)
        names = {id(m): name for name, m in net.named_modules()}  # before FSDP wraps the units
        model = self._wrap(module, device, param_init_fn=fsdp1_param_init_fn(device))
        fill_flat_shards(model, names, self.policy)
        return model

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        return self._wrap(module, device)

    def _wrap(self, module: nn.Module, device: torch.device, **init: Any) -> nn.Module:
        self._numels = tuple(p.numel() for p in self.trainable(module.parameters()))  # before FSDP flattens them
        self._frozen = tuple(p.numel() for p in module.parameters() if not p.requires_grad)
        classes = {import_class(p) for p in self.policy.wrap}
        model = FullyShardedDataParallel(
            module,
            sharding_strategy=self.sharding,
            auto_wrap_policy=ModuleWrapPolicy(classes),
            backward_prefetch=self.backward_prefetch(),
            forward_prefetch=bool(self.config.forward_prefetch),
            limit_all_gathers=bool(self.config.limit_all_gathers),
            use_orig_params=bool(self.config.use_orig_params),
            device_id=device if device.type == "cpu" else device.index,
            mixed_precision=self.mixed_precision(),
            cpu_offload=CPUOffload(offload_params=True) if self.policy.offload == "full" else None,
            **self.process_groups(device),
            **init,
        )
        self._trace = UnitTrace(model, FullyShardedDataParallel.fsdp_modules(model))
        return model

    def process_groups(self, device: torch.device) -> dict[str, Any]:
        """FSDP's process-group arguments: none (the default group); hybrid sharding passes its 2-D device mesh."""
        return {}

    def mixed_precision(self) -> MixedPrecision | None:
        """``MixedPrecision`` with parameters, gradient reduction and buffers in the precision's dtype; None in fp32."""
        dtype = torch_dtype(self.policy.precision.param_dtype)
        if dtype == torch.float32:
            return None
        return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype, cast_forward_inputs=True)

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        """CellStrategy; for fp16, Lightning's mixed-precision plugin with a ``ShardedGradScaler``."""
        from zeroexp.strategies._amp import with_sharded_scaler

        return with_sharded_scaler(super().lightning_strategy(timeout_s, backend), self.policy.precision, backend)


@register
class FSDPGradOpAdapter(FSDPAdapter):
    name = "fsdp_grad_op"
    sharding = ShardingStrategy.SHARD_GRAD_OP
    semantics = (
        "FSDP SHARD_GRAD_OP: gradients and optimizer state sharded; parameters sharded outside computation "
        "(resharded after backward), so at the optimizer boundary the parameter factor is 1, unlike canonical "
        "ZeRO-2 which keeps parameters replicated."
    )


@register
class FSDPFullAdapter(FSDPAdapter):
    name = "fsdp_full"
    schema = FSDPFullConfig
    sharding = ShardingStrategy.FULL_SHARD
    semantics = (
        "FSDP FULL_SHARD (ZeRO-3 direction): parameters, gradients and optimizer state sharded; each unit is "
        "all-gathered before forward and again before backward."
    )

    def backward_prefetch(self) -> BackwardPrefetch | None:
        return PREFETCH[self.policy.prefetch]


def _trains(flat: nn.Parameter) -> list[bool]:
    """Per original parameter of a FlatParameter, whether it trains: each one's own flag with ``use_orig_params``
    (FSDP keeps them in ``_params``), else the FlatParameter's (one ``requires_grad`` for all)."""
    params = orig_params(flat)
    return [p.requires_grad for p in params] if params else [flat.requires_grad] * len(shard_param_infos(flat))
