"""DeepSpeed ZeRO stages 0-3 (``deepspeed.initialize``) through zeroexp's own Lightning strategy, on CPU and CUDA.

Lightning's ``DeepSpeedStrategy`` refuses a CPU accelerator, so the adapter builds the engine itself in
:meth:`DeepSpeedAdapter.wrap` (the client optimizer is ``torch.optim.AdamW`` with the cell's hyper-parameters;
DeepSpeed wraps it in its ZeRO optimizer) and hands Lightning the engine as the model and ``engine.optimizer``
as the optimizer. A precision plugin routes Lightning's backward to ``engine.backward`` and its optimizer step
to ``engine.step`` (the minimal part of lightning/pytorch/plugins/precision/deepspeed.py). With no GPU
DeepSpeed picks its CPU accelerator and runs over the gloo group zeroexp already made.

Where the state lives (DeepSpeed 0.19, runtime/zero/stage_1_and_2.py, stage3.py, fp16/):
- stage 0: the module's parameters and their ``.grad``; mixed precision adds the fp32 copies of the
  FP16 optimizer (``fp32_groups`` / ``fp32_groups_flat``, full on every rank) as ``master``.
- stage 1/2: ``bit16_groups_flat`` (the compute-dtype parameters, replicated, padded), the rank's fp32
  partition ``single_partition_of_fp32_groups`` (``master``, even in fp32 training), the gradient partition
  ``averaged_gradients`` (or its fp32 host copy with optimizer offload). Stage 1 too frees the full
  gradients once they are reduced into the partition, so at the optimizer boundary its gradient factor is 1.
- stage 3: each parameter's partition ``ds_tensor`` (views into ``fp16_partitioned_groups_flat``), the fp32
  partition ``fp32_partitioned_groups_flat`` (``master``), ``grad_partitions_flat_buffer``.
Frozen parameters (``requires_grad=False``): zeroexp hands DeepSpeed an AdamW over the trainable ones alone, and its
optimizer would drop any other (``is_optimized_parameter``); stages 0-2 leave them as plain module parameters on every
rank, stage 3 partitions them and fetches them with their modules.
A trainable parameter a step gives no gradient (a branch forward never calls): DeepSpeed fills its gradient with zeros
(stage 0 before the all_reduce; stages 1-3 in the gradient partition, reducing none for it) and its optimizer steps it,
so AdamW's weight decay moves it where torch's AdamW, which skips a parameter whose gradient is None, leaves it
(:meth:`DeepSpeedAdapter.known_divergence`); stage 3 never fetches the parameters of a module forward never calls.
Gradients exist only between backward and ``engine.step`` (which frees them): at ``schedule.state_step`` the
adapter takes references to them right before the step and hands them to the state probe once.

Checkpoints at every stage: :mod:`zeroexp.strategies._deepspeed_checkpoint`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zeroexp._lib.parallel import after_closure
from zeroexp.devices import ranks_get_a_gpu
from zeroexp.errors import ConfigError, InvalidCell, NotApplicableHere
from zeroexp.formulas import (Groups, Shard, Unit, deepspeed_buckets, deepspeed_gathers, deepspeed_reduce_bucket_numel,
                              deepspeed_stage3_gathers, ds_persistent, ds_stage3_limits, DS_PERSISTENCE_REFUSED)
from zeroexp.formulas.rows import row_of
from zeroexp.models import torch_dtype
from zeroexp.strategies import _deepspeed_checkpoint as _ckpt, register
from zeroexp.strategies._deepspeed_use import StepUse
from zeroexp.strategies._deepspeed_checkpoint import DS_FULL_FILE, DS_TAG  # noqa: F401 - re-exported
from zeroexp.strategies.base import (StateTensor, StrategyAdapter, buffer_state_tensors,
                                    optimizer_state_tensors, post_order)
from zeroexp.cell.policy import CellPolicy
from zeroexp.cell.strategy import DeepSpeedConfig, check_ds_cell


#: The kinds DeepSpeed keeps beyond the canonical fp32 formula (param, grad, 2 moments), and in which tensors.
_MASTER_TENSORS = {0: "FP16 optimizer fp32_groups (full fp32 copy on every rank)",
                   1: "single_partition_of_fp32_groups (the rank's fp32 partition)",
                   2: "single_partition_of_fp32_groups (the rank's fp32 partition)",
                   3: "fp32_partitioned_groups_flat (the rank's fp32 partition)"}


#: Why ``strategy.hpz_size`` is refused (measured with DeepSpeed 0.19 on CPU/gloo, N=4, hpz 2, 8 Linear(64, 64)).
_HPZ_REFUSED = (
    "DeepSpeed 0.19 runs ZeRO++ hpZ here (CPU, gloo), but under zeroexp's stage-3 settings no parameter is released "
    "between forward and backward (stage3_max_live_parameters and stage3_max_reuse_distance exceed the model), so "
    "hpZ's secondary partition is never made or read: the cell is plain stage 3 (measured: the same 1 all_gather, "
    "1 reduce_scatter, 1 all_reduce). It acts only when parameters are released and re-fetched in backward "
    "(measured with max_live_parameters=0: per Linear, a forward all_gather over all N ranks and a backward one over "
    "the hpz group), which the stage-3 model of zeroexp.formulas.deepspeed does not cover")


#: The oldest DeepSpeed the expectation model follows: 0.19.2 keeps fp32 buffers under bf16 / fp16 (PR #8066;
#: zeroexp.formulas.families.deepspeed), where earlier releases cast them with the parameters.
MIN_DEEPSPEED = "0.19.2"


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` would work (checked without importing it: it is slow)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def ds_config(policy: Any, device_type: str) -> dict[str, Any]:
    """The DeepSpeed config of a cell (its CellPolicy): ZeRO stage, precision, offload; nothing DeepSpeed would add on
    its own.

    Stage 3's limits from ``strategy.stage3_*`` (:func:`ds_stage3_limits`, the planner's too): the persistence threshold
    0 unless set, so every parameter is partitioned (DeepSpeed keeps parameters under 1e5 elements whole on every rank
    by default, which is not ZeRO-3). ``zero_force_ds_cpu_optimizer: false``: offload keeps torch's AdamW (the
    reference's), not DeepSpeedCPUAdam (a compiled op).
    """
    s, p, off = policy.strategy, policy.precision, policy.offload
    bucket = deepspeed_reduce_bucket_numel(int(float(s.bucket_cap_mb) * 2**20))  # the expectation model's too
    limits = ds_stage3_limits(s.stage3_prefetch_bucket_size, s.stage3_max_live_parameters,
                              s.stage3_param_persistence_threshold, s.stage3_max_reuse_distance)
    zero: dict[str, Any] = {"stage": int(s.stage), **limits.ds_config(),
                            "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                            "overlap_comm": bool(s.overlap_comm), "contiguous_gradients": True}
    pin = device_type == "cuda"
    if off in ("optimizer", "full"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if off == "full":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    conf: dict[str, Any] = {"train_micro_batch_size_per_gpu": policy.batch_size,
                            "gradient_accumulation_steps": policy.grad_accum,
                            "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False,
                            "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
                            "gradient_clipping": float(s.clip_grad_norm or 0.0)}  # 0: DeepSpeed's "none"
    if p.name == "bf16":
        conf["bf16"] = {"enabled": True}
    elif p.name == "fp16":
        conf["fp16"] = {"enabled": True, "initial_scale_power": int(math.log2(float(p.loss_scale))),
                        "loss_scale_window": int(p.growth_interval), "loss_scale": 0}
    return conf


#: DeepSpeed's shared-memory all_reduce op (``deepspeed_shm_comm``): built (JIT, C++) when its comm backend starts,
#: used only by ``inference_all_reduce``; training's collectives go through torch.distributed, which the probes count.
SHM_COMM_OP = "deepspeed_shm_comm"


def _no_shm_comm(deepspeed: Any) -> None:
    """Tell DeepSpeed the shared-memory comm op is not to be built, through the table of compatible ops it consults
    (``deepspeed.comm.torch.build_shm_op``) before its backend starts: a zeroexp cell never calls it, and its JIT
    build took ~40 s (and needs a C++ compiler) at the first DeepSpeed cell of each fresh install."""
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def _cast_inputs(dtype: torch.dtype) -> Any:
    """A forward pre-hook casting floating-point tensor arguments to the engine's compute dtype."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


def _engine_precision(adapter: "DeepSpeedAdapter") -> Any:
    """Lightning precision plugin: backward is ``engine.backward``, the optimizer step is ``engine.step``."""
    from lightning.pytorch.plugins.precision import Precision

    class EnginePrecision(Precision):
        def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            """``engine.backward``: the loss comes scaled by 1/grad_accum from Lightning already (not again:
            ``scale_wrt_gas=False``). The engine owns the accumulation boundary (``gradient_accumulation_steps``):
            before it, ``engine.step`` only counts the micro-batch (Lightning steps on the boundary's alone)."""
            engine = adapter.engine
            boundary, use = engine.is_gradient_accumulation_boundary(), adapter._use or StepUse()
            use.backward_begins()
            engine.backward(tensor, scale_wrt_gas=False)
            use.backward_ends()
            if not boundary:
                engine.step()

        def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
            closure()
            after_closure(self, model, optimizer)  # on_before_optimizer_step (the memory probe's mark)
            adapter.before_step()
            return adapter.engine.step()

    return EnginePrecision()


@register
class DeepSpeedAdapter(_ckpt.DeepSpeedCheckpoints, StrategyAdapter):
    name = "deepspeed"
    schema = DeepSpeedConfig
    offloads = frozenset({"none", "optimizer", "full"})
    checkpoint_kinds = frozenset({"full", "sharded"})  # every stage; files and collectives differ by stage
    moved_kinds = frozenset({"full"})  # the consolidated fp32 state by name; sharded: DeepSpeed's own partitions
    semantics = ("DeepSpeed ZeRO (runtime): stage 0 replicates everything; 1 partitions the fp32 master and Adam "
                 "moments; 2 also the gradients; 3 also the parameters. Mixed precision: compute-dtype parameters "
                 "and gradients, fp32 master and moments; DeepSpeed keeps the fp32 master partition in fp32 "
                 "training too (reported as beyond the canonical formula).")

    #: init=meta is refused (zeroexp.config.init_mode): DeepSpeed's sharded initialisation is ``deepspeed.zero.Init``
    # around
    #: the model's constructor (stage 3), which partitions each module as it is built; the GPT's GPT-2 init, run by
    #: its constructor after every module exists, would then draw into partitions, not the full build's tensors.
    meta_init = None

    def __init__(self, policy: CellPolicy) -> None:
        super().__init__(policy)
        self.stage = int(self.config.stage)
        self.dtype = torch_dtype(self.policy.precision.param_dtype)
        self.engine: Any = None
        self._steps = 0
        self._capture_at = self.policy.warmup_steps  # schedule.state_step
        self._grads: list[StateTensor] = []
        self._use: StepUse | None = None

    @classmethod
    def validate(cls, cfg: Any) -> None:
        s, off = cfg.strategy, str(cfg.offload.name)
        if not deepspeed_available():
            raise ConfigError("strategy", s.name, "any other strategy, or install DeepSpeed",
                              why="deepspeed is not installed; install it with: pip install -e '.[deepspeed]'")
        from importlib.metadata import version

        from packaging.version import Version
        if Version(version("deepspeed")) < Version(MIN_DEEPSPEED):
            raise ConfigError("strategy", s.name, f"DeepSpeed >= {MIN_DEEPSPEED}",
                              why=f"deepspeed {version('deepspeed')} is installed; its buffers' dtype, state and "
                                  f"buffers are modelled from {MIN_DEEPSPEED} on: pip install -e '.[deepspeed]'")
        if s.stage not in (0, 1, 2, 3):
            raise ConfigError("strategy.stage", s.stage, "0, 1, 2, 3")
        check_ds_cell(s, int(cfg.world_size), row_of(str(s.layout)))
        if s.get("hpz_size") not in (None, 1):
            raise ConfigError("strategy.hpz_size", s.hpz_size, "null (or 1: no secondary partition)", why=_HPZ_REFUSED)
        if not s.bucket_cap_mb > 0:
            raise ConfigError("strategy.bucket_cap_mb", s.bucket_cap_mb, "a positive number of MiB")
        if off != "none" and s.stage == 0:
            raise NotApplicableHere("offload", off, "none", why="DeepSpeed offloads ZeRO partitions: stage 0 has none")
        if off == "full" and s.stage != 3:
            raise NotApplicableHere("offload", off, "none, optimizer",
                              why=f"offload_param needs ZeRO stage 3 (strategy.stage={s.stage})")
        if cfg.precision.name == "fp16" and not _cuda_for(cfg):
            raise ConfigError("precision", "fp16", "fp32, bf16",
                              why="DeepSpeed's CPU accelerator does not support fp16 (no GPU for each rank here)")

    @classmethod
    def validate_model(cls, cfg: Any, shape: Any = None) -> None:
        """Stage 3 with a parameter DeepSpeed keeps persistent (``strategy.stage3_param_persistence_threshold``)."""
        s = cfg.strategy
        limits = ds_stage3_limits(persistence=s.get("stage3_param_persistence_threshold"))
        if s.stage == 3 and shape is not None and ds_persistent(shape.numels, limits):
            raise InvalidCell("strategy.stage3_param_persistence_threshold", limits.persistence,
                              f"below {min(shape.numels)} (the smallest parameter's elements), or null",
                              why=DS_PERSISTENCE_REFUSED)

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``deepspeed.initialize`` over the LightningModule with AdamW; returns the engine (converts the module
        to the compute dtype; stage 3 partitions its parameters)."""
        import deepspeed

        _no_shm_comm(deepspeed)
        self._use = StepUse(module)
        client = torch.optim.AdamW(self.trainable(module.parameters()), **self.optimizer_kwargs())
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client, dist_init_required=False,
                                                    config=ds_config(self.policy, device.type))
        if self.dtype != torch.float32:
            for child in module.children():  # the user's net: its inputs in the compute dtype
                child.register_forward_pre_hook(_cast_inputs(self.dtype), with_kwargs=True)
        opt = self.engine.optimizer
        if not hasattr(opt, "defaults"):  # Lightning's Optimizable protocol; DeepSpeed's ZeRO optimizers lack it
            opt.defaults = dict(client.defaults)
        return self.engine

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> Any:
        """The engine's optimizer (DeepSpeed's ZeRO or FP16 optimizer around AdamW), built in :meth:`wrap`."""
        return self.engine.optimizer

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        strategy = super().lightning_strategy(timeout_s, backend)
        strategy.precision_plugin = _engine_precision(self)
        return strategy

    # --- state -------------------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Called between backward and ``engine.step``: at ``schedule.state_step``, keep the gradients; close the
        step's record of the parameters it used."""
        if self._steps == self._capture_at:
            self._grads = list(self._gradient_tensors())
        if self._use is not None:
            self._use.close()
        self._steps += 1

    def _gradient_tensors(self) -> Iterator[StateTensor]:
        """The gradients as DeepSpeed holds them before its step, each with its elements of real parameters."""
        opt = self.engine.optimizer
        if self.stage == 0:
            yield from (StateTensor("grad", p.grad, p.numel()) for p in self.engine.module.parameters()
                        if p.grad is not None)
            return
        real = self._partition_real()
        if self.stage == 3:
            buf = getattr(opt, "grad_partitions_flat_buffer", None)
            if buf is not None:
                yield StateTensor("grad", buf, sum(real))
        else:
            for i, group in getattr(opt, "averaged_gradients", {}).items():  # None with optimizer offload
                left = real[i]  # the pieces: views of the gradients, then a zeros tensor for the padding
                for g in (g for g in group or () if g is not None):
                    yield StateTensor("grad", g, min(g.numel(), left))
                    left -= min(g.numel(), left)
        for master, k in zip(self._masters(), real):  # optimizer offload: the fp32 gradient partition on the host
            if master.grad is not None:
                yield StateTensor("grad", master.grad, k)

    def _partition_real(self) -> list[int]:
        """Per fp32 partition (stages 1-2: per flat group, less ``groups_padding``; stage 3: per sub-group, each
        parameter's partition less its padding), the elements of real parameters it holds."""
        opt = self.engine.optimizer
        if self.stage == 3:
            return [sum(_ds_real(p) for p in group) for group in opt.fp16_groups]
        return [int(size) - int(pad) for size, pad in zip(opt.partition_size, opt.groups_padding)]

    def _masters(self) -> list[torch.Tensor]:
        opt = self.engine.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat"):
            if hasattr(opt, attr):
                return list(getattr(opt, attr))
        if hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer (stage 0, bf16 / fp16 unfused)
            return [t for group in opt.fp32_groups for t in group]
        return []

    def state_tensors(self, model: nn.Module, optimizer: Any) -> Iterator[StateTensor]:
        """Parameters (stage 3: the partitions, frozen ones too; stages 1-2: the flat groups and the frozen parameters
        beside them), gradients kept at the boundary, fp32 master, Adam's state, the module's buffers.

        Logical numel: the model's elements a tensor holds, padding excluded: the replicated flat groups' parameters;
        a partition's elements less its padding (stages 1-2: ``groups_padding``, at the end of the flat group; stage
        3: each parameter's, on the ranks past its ``ds_numel``), which its master, moments and gradient pieces share.
        """
        opt = self.engine.optimizer
        params = list(self.engine.module.parameters())
        if self.stage == 3:
            for p in params:
                yield StateTensor("param", p.ds_tensor, _ds_real(p))
                if p.data.untyped_storage().nbytes() > 0 and p.data.numel() > 0:
                    yield StateTensor("param_unsharded", p.data, p.ds_numel)
        elif self.stage in (1, 2):
            flat = {id(p) for group in opt.bit16_groups for p in group}
            for buffer, group in zip(opt.bit16_groups_flat, opt.bit16_groups):
                yield StateTensor("param", buffer, sum(p.numel() for p in group))
            for p in params:  # frozen: plain module parameters, outside the flat groups
                if id(p) not in flat:
                    yield StateTensor("param", p.detach(), p.numel())
        else:
            for p in params:
                yield StateTensor("param", p.detach(), p.numel())
        yield from self._grads
        self._grads = []  # handed over once: the probe counts them, nothing keeps them alive after
        masters = self._masters()
        real = dict(zip(map(id, masters), self._partition_real())) if self.stage else {}
        for m in masters:
            yield StateTensor("master", m, real.get(id(m), m.numel()))
        base = getattr(opt, "optimizer", opt)  # the client AdamW inside DeepSpeed's wrapper
        yield from optimizer_state_tensors(base, real)
        yield from buffer_state_tensors(self.engine.module)

    def clip_gradients(self, model: nn.Module) -> None:
        """Nothing here: the engine clips in ``engine.step`` (ds config ``gradient_clipping``), by the global norm its
        ZeRO optimizer all-reduces at every step anyway (stages 1-3), as ``max_norm / (norm + 1e-6)``."""

    @property
    def computes_grad_norm(self) -> bool:
        """The ZeRO optimizer (stages 1-3) takes the global norm at every ``engine.step``, clipping or not."""
        return self.stage > 0

    def step_grad_norm(self, model: nn.Module, optimizer: Any) -> Any:
        """``engine.get_global_grad_norm()``: the unscaled norm the ZeRO optimizer took in the last step."""
        return self.engine.get_global_grad_norm() if self.computes_grad_norm else None

    #: (stage 0: :meth:`grad_norm` is not to be taken; stages 1-3 take their own)
    grad_norm_unavailable = ("DeepSpeed stage 0 reduces the gradients in engine.step, after Lightning's hooks; its "
                             "bf16 / fp16 optimizer's norm is not the step's total norm (5.7-8.1 % above)")

    def current_loss_scale(self) -> float | None:
        """fp16: the FP16 / ZeRO optimizer's dynamic loss scale (``cur_scale``); None otherwise."""
        return float(self.engine.optimizer.cur_scale) if self.policy.precision.name == "fp16" else None

    def beyond_canonical(self) -> dict[str, str]:
        """The kinds DeepSpeed keeps beyond the canonical fp32 formula [ZeRO 5.1], and in which tensors."""
        if self.stage == 0 and self.dtype == torch.float32:
            return {}
        return {"master": _MASTER_TENSORS[self.stage]}

    def groups(self, model: nn.Module, optimizer: Any) -> Groups:
        """DeepSpeed's partitions and buckets, read off the built engine and its ZeRO optimizer (they come from the
        cell's ds config): stage 0 its all_reduce chunks; stages 1-2 the flat groups (``bit16_groups_flat``, padded to
        2N) and the ``ipg`` buckets of the parameters in reduce order (stage 1 group order at the step, stage 2 the
        order its gradient hooks fired in the last step, :class:`StepUse`'s; before the first, a stack's); stage 3
        every parameter's partition (``ds_numel`` padded to N, frozen ones too: ``grad_shards`` are the trainable
        ones'), the buckets in the order the hooks fired and the fetches (DeepSpeed's coordinator replayed over the
        last step's module calls, recorded live by :class:`StepUse`; before the first step, the root's own
        parameters, then one prefetch of the rest).
        DeepSpeed's optimizer holds the trainable parameters alone (``is_optimized_parameter``); stages 0-2 leave the
        frozen ones as plain module parameters (``frozen``). A trainable parameter the last step gave no gradient
        (:class:`StepUse`): stage 0 all-reduces a zero gradient for it; stages 1-3 reduce none (``ungraded``, out of
        the buckets); stage 3 fetches no parameter of a module forward did not call. Offloaded (optimizer, or stage
        3's full), the partitions, buckets and fetches are the same (the host holds copies of the partitions). Not
        modelled (the check reads n/a with the reason): DeepSpeed's reduce (not all_reduce) gradient path."""
        eng, opt, n = self.engine, self.engine.optimizer, dist.get_world_size()
        every = list(eng.module.parameters())
        params = self.trainable(every)
        numel = (lambda p: p.ds_numel) if self.stage == 3 else (lambda p: p.numel())
        frozen = tuple(numel(p) for p in every if not p.requires_grad)
        if self.stage == 0:
            numels = [p.numel() for p in params]
            return Groups(self.layout, n, tuple(numels), buckets=deepspeed_buckets(0, numels, 0), frozen=frozen)
        bucket, use = int(opt.reduce_bucket_size), self._use or StepUse()  # none recorded: every one used
        if self.stage in (1, 2):
            import deepspeed.comm as ds_comm

            if not (opt.reduce_scatter and opt.use_multi_rank_bucket_allreduce
                    and ds_comm.has_all_gather_into_tensor()):
                raise NotImplementedError("strategy 'deepspeed': only the all_reduce bucket path and one "
                                          "all_gather_into_tensor per group are modelled")
            flat = [p for group in opt.bit16_groups for p in group]  # stage 1: reduce_gradients, group order
            ungraded = use.ungraded(flat)
            hooks = _hook_order(use, flat, ungraded) if self.stage == 2 else ()
            order = [flat[i].numel() for i in (hooks or [i for i in range(len(flat)) if i not in ungraded])]
            shards = []
            for buffer, group in zip(opt.bit16_groups_flat, opt.bit16_groups):
                spans, offset = [], 0
                for p in group:
                    spans.append((offset, offset + p.numel()))
                    offset += p.numel()
                shards.append(Shard(tuple(spans), buffer.numel()))
            return Groups(self.layout, n, tuple(p.numel() for p in flat), tuple(shards), frozen=frozen,
                          buckets=deepspeed_buckets(self.stage, order, bucket), ungraded=ungraded,
                          reduce_order=tuple(i for i in hooks if flat[i].numel()))
        ungraded = use.ungraded(params)
        numels, hooks = [p.ds_numel for p in params], _hook_order(use, params, ungraded)
        own = {id(p) for p in eng.module.parameters(recurse=False)}
        # the root's own parameters are fetched with it, then those of the modules forward called
        first = sorted((p for p in every if id(p) in own or use.called(p)), key=lambda p: id(p) not in own)
        s = self.config
        limits = ds_stage3_limits(s.stage3_prefetch_bucket_size, s.stage3_max_live_parameters,
                                  s.stage3_param_persistence_threshold, s.stage3_max_reuse_distance)
        gathers = deepspeed_gathers([p.ds_numel for p in first], own=len(own)) if not use.calls() else \
            deepspeed_stage3_gathers(use.calls(), tuple(p.ds_numel for p in every), limits,
                                     use.recomputed() if self.policy.activation_checkpointing else
                                     frozenset())
        fetched = post_order(eng.module, lambda m: any(True for _ in m.parameters(recurse=False)))
        units = tuple(Unit(sum(p.partition_numel() * n for p in m.parameters(recurse=False)), 1) for m in fetched)

        def shard(p: nn.Parameter) -> Shard:
            return Shard(((0, p.ds_numel),), p.partition_numel() * n)

        return Groups(self.layout, n, tuple(numels), tuple(shard(p) for p in every), units,
                      buckets=deepspeed_buckets(3, [numels[i] for i in hooks], bucket),
                      gathers=gathers, frozen=frozen, reduce_order=tuple(i for i in hooks if numels[i]),
                      grad_shards=tuple(shard(p) for p in params) if frozen else None, ungraded=ungraded)

    def known_divergence(self, ungraded: list[str]) -> tuple[str, str] | None:
        """With weight decay, the trainable parameters the reference gives no gradient (``ungraded``, by name):
        DeepSpeed fills their gradient with zeros and its optimizer steps them, AdamW's decay moving them, where
        torch's AdamW skips a parameter whose gradient is None (torch/optim/adamw.py ``_init_group``: ``if p.grad is
        None: continue``)."""
        if not ungraded or not float(self.policy.optimizer.weight_decay) > 0:
            return None
        return DECAYS_UNGRADED, (
            f"DeepSpeed fills the missing gradient of {', '.join(ungraded)} (no gradient in the step: forward never "
            f"uses it) with zeros and its optimizer steps it, so weight_decay={self.policy.optimizer.weight_decay:g} "
            "moves it; the reference's torch.optim.AdamW skips a parameter whose gradient is None and leaves it "
            "(optimizer.weight_decay=0 removes the difference)")

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """The fp32 master all-gathered would be DeepSpeed's ``zero_to_fp32``; here the trained compute parameters:
        stage 3 gathers them with ``deepspeed.zero.GatheredParameters`` (a collective: enter on every rank)."""
        module = getattr(model, "module", self.engine.module)  # the engine given (the probe compares two)
        params = list(module.parameters())
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None), torch.no_grad():
                yield {name: p.detach() for name, p in module.named_parameters()}
        else:
            with torch.no_grad():
                yield {name: p.detach() for name, p in module.named_parameters()}

    # --- checkpoints (stages 0-3): zeroexp.strategies._deepspeed_checkpoint ------------------------------
    def train_step(self, model: nn.Module, loss_fn: Any, optimizer: Any, batch: torch.Tensor) -> None:
        """The engine's step: ``engine.backward`` (reduce-scatters the gradients) and ``engine.step``."""
        with torch.enable_grad():
            loss = loss_fn(model(batch), batch)
            model.backward(loss)
        model.step()


#: The equivalence section's ``cause`` when weight decay moves the parameters a step gives no gradient
#: (:meth:`DeepSpeedAdapter.known_divergence`).
DECAYS_UNGRADED = "weight_decay_on_ungraded"


def _ds_real(p: nn.Parameter) -> int:
    """The elements of ``p`` in this rank's stage-3 partition (``ds_tensor``): the partition less the padding that
    takes ``ds_numel`` to N x ``partition_numel()``, which the last ranks hold (partition_parameters.py
    ``_partition_param``)."""
    size = p.partition_numel()
    return max(0, min(size, p.ds_numel - dist.get_rank(group=p.ds_process_group) * size))


_cuda_for = ranks_get_a_gpu  # one rule for every adapter (zeroexp.devices)


def _hook_order(use: StepUse, params: list[nn.Parameter], ungraded: tuple[int, ...]) -> list[int]:
    """Stages 2-3: the indices into ``params`` in the order their gradients' hooks fired in the last step (the order
    DeepSpeed fills its buckets); before the first step, the reverse of ``params``' (a stack's backward)."""
    ready = use.ready(params)
    return ready if ready is not None else [i for i in range(len(params))[::-1] if i not in ungraded]
