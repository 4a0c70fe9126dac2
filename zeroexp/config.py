"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and up-front validation.

Every option YAML under ``conf/`` extends one of these schemas through its defaults list
(``- /schema/<group>@_here_: <schema>``), so a mistyped value (``model.width=abc``) or an unknown key
(``strategy.bucket_mb=3``) fails at composition time with the full key in Hydra's message.
:func:`validate` then checks what types cannot express (positive sizes, axes that do not apply to a
strategy, targets that must import) before any rank is started, and raises :class:`ConfigError`
naming the key, the value and what is accepted.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

__all__ = ["ConfigError", "register_schemas", "validate", "MODEL_RESERVED_KEYS"]


class ConfigError(ValueError):
    """A configuration that zeroexp refuses before any work starts.

    The message always names the offending key, the given value and what is accepted.
    """

    def __init__(self, key: str, value: Any, accepted: str, why: str = "") -> None:
        self.key, self.value, self.accepted = key, value, accepted
        msg = f"invalid config: {key}={value!r}: {why + '; ' if why else ''}accepted: {accepted}"
        super().__init__(msg)


class NotApplicableHere(ConfigError):
    """A cell of valid axis values that cannot run, on this machine (FSDP CPU offload with no accelerator) or in
    this combination (DeepSpeed offload at stage 0): refused up front in a single run; in a ``--multirun`` sweep
    the cell is ``skipped`` with this message and the sweep goes on (a sweep is a product of axes)."""


# --- model -------------------------------------------------------------------------------------------
# Keys of the model node that belong to zeroexp (data spec, loss, naming); everything else is passed
# to the ``_target_`` factory.
MODEL_RESERVED_KEYS = ("name", "input_shape", "dtype", "low", "high", "loss", "wrap")


@dataclass
class ModelConfig:
    """Any ``nn.Module`` factory plus the shape of one sample, so zeroexp can make synthetic batches."""

    _target_: str = MISSING
    name: str = MISSING
    input_shape: List[int] = MISSING  # one sample, without the batch dimension
    dtype: str = "float32"  # float32 | float16 | bfloat16 | long (token ids in [low, high))
    low: int = 0
    high: int = 2
    loss: str = "mean_square"  # see zeroexp.models.LOSSES
    # The model's natural FSDP unit (module classes by import path), used when strategy.wrap is null.
    wrap: Optional[List[str]] = None


@dataclass
class MLPConfig(ModelConfig):
    """The reference Linear stack: ``depth`` bias-free ``nn.Linear(width, width)`` layers."""

    _target_: str = "zeroexp.models.LinearStack"
    width: int = 256
    depth: int = 8
    wrap: Optional[List[str]] = field(default_factory=lambda: ["torch.nn.Linear"])


@dataclass
class GPTConfig(ModelConfig):
    """zeroexp's decoder-only transformer (``zeroexp.models.gpt.GPT``) on random token ids."""

    _target_: str = "zeroexp.models.gpt.GPT"
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True
    tie_weights: bool = True
    wrap: Optional[List[str]] = field(default_factory=lambda: ["zeroexp.models.gpt.Block"])


# --- strategies --------------------------------------------------------------------------------------
@dataclass
class StrategyConfig:
    name: str = MISSING


@dataclass
class DDPConfig(StrategyConfig):
    # Set explicitly, DDP also uses it as the first bucket's cap (otherwise 1 MiB), so buckets are even.
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False


@dataclass
class ZROConfig(DDPConfig):
    # False: one broadcast per parameter after the step (the reference experiment's fingerprint).
    parameters_as_bucket_view: bool = False


@dataclass
class ZeroConfig(StrategyConfig):
    """zeroexp's own ZeRO-1 / ZeRO-2 (``zeroexp.sharding``)."""

    # Flat buckets, in compute-dtype bytes of parameters: one reduce_scatter and one all_gather each per step.
    bucket_cap_mb: float = 25.0
    reduce: str = "reduce_scatter"  # reduce_scatter | allreduce (the naive ZeRO: all_reduce, keep the shard)
    clip_grad_norm: Optional[float] = None  # global-norm clipping: the max norm; null: no clipping


@dataclass
class DeepSpeedConfig(StrategyConfig):
    """DeepSpeed ZeRO through ``deepspeed.initialize`` (zeroexp.strategies.deepspeed); an optional extra."""

    stage: int = 2  # ZeRO stage 0 | 1 | 2 | 3 (a cell axis)
    bucket_cap_mb: float = 25.0  # reduce_bucket_size and allgather_bucket_size, in MiB of fp32 elements


@dataclass
class FSDPConfig(StrategyConfig):
    sharding: str = MISSING  # FULL_SHARD | SHARD_GRAD_OP
    # Module classes wrapped as their own FSDP unit (import paths); the root unit holds the rest.
    # null: the model's own unit (model.wrap: Linear for mlp, Block for gpt); [] wraps the model as one unit.
    wrap: Optional[List[str]] = None
    use_orig_params: bool = False
    limit_all_gathers: bool = True
    forward_prefetch: bool = False


@dataclass
class FSDP2Config(StrategyConfig):
    """FSDP2 (``fully_shard``); ``reshard_after_forward`` is fixed by the strategy (fsdp2_full / fsdp2_grad_op)."""

    # Module classes given their own fully_shard unit (import paths), as for FSDP1; the root takes the rest.
    wrap: Optional[List[str]] = None


# --- small axes --------------------------------------------------------------------------------------
@dataclass
class PrefetchConfig:
    name: str = MISSING  # pre | post | none (FSDP BackwardPrefetch)


@dataclass
class PrecisionConfig:
    """Dtypes of training; a strategy runs only the precisions its adapter lists (``StrategyAdapter.precisions``)."""

    name: str = MISSING  # fp32 | bf16 | fp16
    param_dtype: str = "float32"  # compute parameters, activations and gradients: float32 | bfloat16 | float16
    master_dtype: str = "float32"  # the optimizer's copy of the parameters and its moments: float32
    loss_scale: Optional[float] = None  # initial dynamic loss scale (fp16); null: no loss scaling
    growth_interval: int = 2000  # finite steps after which the loss scale doubles


@dataclass
class OffloadConfig:
    name: str = MISSING


@dataclass
class LauncherConfig:
    """Who starts the ranks (docs/cluster.md): zeroexp itself, torchrun, or SLURM through Hydra's submitit launcher."""

    name: str = MISSING  # local | torchrun | slurm
    nodes: Optional[int] = None  # slurm: nodes per cell (hydra.launcher.nodes); local: 1; torchrun: from its env
    ranks_per_node: Optional[int] = None  # slurm: tasks per node (hydra.launcher.tasks_per_node); torchrun: env


@dataclass
class CheckpointConfig:
    """After training: save, restore into a fresh model, continue one step (zeroexp.probes.checkpoint)."""

    name: str = MISSING  # none | full | sharded
    dir: Optional[str] = None  # where the checkpoint is written, seen by every rank; null: <cell>/checkpoint
    keep: bool = False  # keep the files once checked (else they are removed: the summary keeps their sizes)


@dataclass
class LoggerConfig:
    name: str = MISSING  # wandb | csv | none
    mode: str = "offline"  # wandb only: offline | online | disabled
    project: str = "zeroexp"
    entity: Optional[str] = None


@dataclass
class OptimizerConfig:
    """AdamW, the optimizer of the reference experiment (two fp32 moments per parameter)."""

    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class TimeoutConfig:
    collective_s: float = 300.0  # process-group timeout: a rank stuck in a collective fails after this
    cell_s: float = 3600.0  # whole cell, all ranks
    grace_s: float = 5.0  # after one rank fails, how long the others get to exit before they are killed


@dataclass
class ProbesConfig:
    """How many post-warm-up steps each measurement owns (see ``zeroexp.schedule``)."""

    profile_steps: int = 2  # steps the collectives probe records with the torch profiler
    memory_steps: int = 2  # steps the memory probe tracks for the training peak


@dataclass
class ZeroexpConfig:
    model: Any = MISSING
    strategy: Any = MISSING
    prefetch: Any = MISSING
    precision: Any = MISSING
    offload: Any = MISSING
    logger: Any = MISSING
    launcher: Any = MISSING
    checkpoint: Any = MISSING
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    timeout: TimeoutConfig = field(default_factory=TimeoutConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    world_size: int = 4
    steps: int = 30
    batch_size: int = 8  # per rank; the global batch is batch_size * world_size
    seed: int = 0
    warmup_steps: int = 3  # steps excluded from steady measurements
    device: str = "auto"  # auto | cpu | cuda
    resume: bool = False  # --multirun into an existing sweep dir: re-run only cells missing or not ok
    ddp_bucket_cap_mb: float = 25.0  # shared default of strategy.bucket_cap_mb for ddp and zro
    # One process plays rank 0 of world_size ranks under a fake process group and FakeTensorMode: state table
    # and collectives without allocating the parameters (zeroexp.dryrun); no time, memory or equivalence.
    dry_run: bool = False


def register_schemas() -> None:
    """Register the schemas under ``schema/<group>`` (options extend them) and the root schema."""
    cs = ConfigStore.instance()
    cs.store(name="zeroexp_schema", node=ZeroexpConfig)
    # Open schema: the data-spec keys are typed, any other key is an argument of the `_target_` factory.
    cs.store(group="schema/model", name="model", node=OmegaConf.structured(ModelConfig, flags={"struct": False}))
    cs.store(group="schema/model", name="mlp", node=MLPConfig)
    cs.store(group="schema/model", name="gpt", node=GPTConfig)
    cs.store(group="schema/strategy", name="ddp", node=DDPConfig)
    cs.store(group="schema/strategy", name="zro", node=ZROConfig)
    cs.store(group="schema/strategy", name="zero", node=ZeroConfig)
    cs.store(group="schema/strategy", name="deepspeed", node=DeepSpeedConfig)
    cs.store(group="schema/strategy", name="fsdp", node=FSDPConfig)
    cs.store(group="schema/strategy", name="fsdp2", node=FSDP2Config)
    cs.store(group="schema/prefetch", name="prefetch", node=PrefetchConfig)
    cs.store(group="schema/precision", name="precision", node=PrecisionConfig)
    cs.store(group="schema/offload", name="offload", node=OffloadConfig)
    cs.store(group="schema/logger", name="logger", node=LoggerConfig)
    cs.store(group="schema/launcher", name="launcher", node=LauncherConfig)
    cs.store(group="schema/checkpoint", name="checkpoint", node=CheckpointConfig)


# --- validation --------------------------------------------------------------------------------------
_ACCEPTED = {
    "prefetch.name": ("pre", "post", "none"),
    "precision.name": ("fp32", "bf16", "fp16"),
    "precision.param_dtype": ("float32", "bfloat16", "float16"),
    "precision.master_dtype": ("float32",),
    "offload.name": ("none", "optimizer", "full"),
    "logger.name": ("wandb", "csv", "none"),
    "logger.mode": ("offline", "online", "disabled"),
    "device": ("auto", "cpu", "cuda"),
    "model.dtype": ("float32", "float16", "bfloat16", "long"),
    "launcher.name": ("local", "torchrun", "slurm"),
    "checkpoint.name": ("none", "full", "sharded"),
}


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")


def validate(cfg: DictConfig, explicit_overrides: tuple[str, ...] = ()) -> None:
    """Check a composed cell config; raise :class:`ConfigError` on the first problem.

    ``explicit_overrides`` are the keys the user set on the command line (``prefetch``,
    ``strategy.bucket_cap_mb``...): an axis that does not apply to the strategy is an error only when the
    user asked for it explicitly in a single run (sweeps de-duplicate such cells instead).
    """
    from zeroexp.models import LOSSES
    from zeroexp.strategies import get_adapter_class, registered

    name = cfg.strategy.name
    if name not in registered():
        raise ConfigError("strategy", name, ", ".join(sorted(registered())))
    for key, accepted in _ACCEPTED.items():
        value = OmegaConf.select(cfg, key)
        if value not in accepted:
            raise ConfigError(key, value, ", ".join(accepted))
    _positive_int(cfg, "world_size")
    _positive_int(cfg, "steps")
    _positive_int(cfg, "batch_size")
    _positive_int(cfg, "warmup_steps", minimum=0)
    from zeroexp.schedule import Schedule

    for problem in Schedule.from_cfg(cfg).problems():
        raise ConfigError("steps", cfg.steps, "enough steps for warm-up, every probe and timing", why=problem)
    for key in ("timeout.collective_s", "timeout.cell_s", "timeout.grace_s"):
        if not OmegaConf.select(cfg, key) > 0:
            raise ConfigError(key, OmegaConf.select(cfg, key), "a positive number of seconds")

    model = cfg.model
    for key in ("width", "depth", "vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
        if key in model:
            _positive_int(cfg, f"model.{key}")
    if "n_head" in model and model.n_embd % model.n_head:
        raise ConfigError("model.n_head", model.n_head, f"a divisor of model.n_embd={model.n_embd}")
    if model.dtype == "long" and not 0 <= model.low < model.high:
        raise ConfigError("model.high", model.high, f"an integer above model.low={model.low} >= 0")
    shape = list(model.input_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ConfigError("model.input_shape", shape, "a non-empty list of positive integers")
    if model.loss not in LOSSES:
        raise ConfigError("model.loss", model.loss, ", ".join(sorted(LOSSES)))
    _check_target(str(model._target_))
    _check_model_builds(cfg)

    adapter = get_adapter_class(name)
    if cfg.precision.name not in adapter.precisions:
        supported = sorted(n for n, a in registered().items() if cfg.precision.name in a.precisions)
        raise ConfigError("precision", cfg.precision.name, ", ".join(sorted(adapter.precisions)),
                          why=f"strategy={name} does not implement it; strategies that do: "
                              f"{', '.join(supported) or 'none'}")
    offloads = getattr(adapter, "offloads", frozenset({"none"}))
    if cfg.offload.name not in offloads:
        supported = sorted(n for n, a in registered().items() if cfg.offload.name in getattr(a, "offloads", ()))
        raise ConfigError("offload", cfg.offload.name, ", ".join(sorted(offloads)),
                          why=f"strategy={name} does not implement it; strategies that do: "
                              f"{', '.join(supported) or 'none'}")
    for axis in ("prefetch",):
        if axis in explicit_overrides and axis not in adapter.axes:
            value = OmegaConf.select(cfg, f"{axis}.name")
            raise ConfigError(
                axis,
                value,
                f"strategies that use it: {', '.join(sorted(n for n in registered() if axis in get_adapter_class(n).axes))}",
                why=f"{axis} does not apply to strategy={name}",
            )
    if cfg.warmup_steps < adapter.min_warmup_steps:  # the collectives probe records the first step after it
        raise ConfigError("warmup_steps", cfg.warmup_steps, f"an integer >= {adapter.min_warmup_steps}",
                          why=f"strategy={name} issues its steady per-step collectives only from step "
                              f"{adapter.min_warmup_steps} on")
    _validate_launcher_and_checkpoint(cfg, adapter)
    adapter.validate(cfg)


def _validate_launcher_and_checkpoint(cfg: DictConfig, adapter: Any) -> None:
    """The launcher's node layout adds up to ``world_size``; the strategy implements the checkpoint kind."""
    from zeroexp.strategies import registered

    launcher, kind = cfg.launcher, cfg.checkpoint.name
    if cfg.get("dry_run") and (launcher.name != "local" or kind != "none"):
        key, value = ("launcher", launcher.name) if launcher.name != "local" else ("checkpoint", kind)
        raise ConfigError(key, value, "local" if key == "launcher" else "none",
                          why="a dry run is one process with fake tensors")
    if launcher.name == "slurm":
        _positive_int(cfg, "launcher.nodes")
        _positive_int(cfg, "launcher.ranks_per_node")
        if launcher.nodes * launcher.ranks_per_node != cfg.world_size:
            raise ConfigError("launcher.ranks_per_node", launcher.ranks_per_node,
                              f"world_size / launcher.nodes = {cfg.world_size} / {launcher.nodes}",
                              why=f"launcher.nodes * launcher.ranks_per_node = {launcher.nodes} * "
                                  f"{launcher.ranks_per_node} != world_size = {cfg.world_size}")
    if kind != "none" and kind not in adapter.checkpoint_kinds:
        supported = sorted(n for n, a in registered().items() if kind in a.checkpoint_kinds)
        raise ConfigError("checkpoint", kind, ", ".join(["none", *sorted(adapter.checkpoint_kinds)]),
                          why=f"strategy={cfg.strategy.name} does not implement it; strategies that do: "
                              f"{', '.join(supported) or 'none'}")


def _check_model_builds(cfg: DictConfig) -> None:
    """Build the model on the meta device (no memory, any size) so bad factory arguments fail now."""
    import torch

    from zeroexp.models import build_model

    try:
        with torch.device("meta"):
            build_model(cfg.model)
    except Exception as e:  # noqa: BLE001 - any failure of the user's factory is a config error
        cause = e.__cause__ or e
        raise ConfigError("model._target_", cfg.model._target_, "a factory that builds an nn.Module from the "
                          "model config's other keys", why=f"{type(cause).__name__}: {cause}") from e


#: Optional dependencies and the extra that installs them.
OPTIONAL_EXTRAS = {"transformers": "hf", "deepspeed": "deepspeed"}


def _check_target(target: str) -> None:
    module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        why = str(e)
        top = module_name.split(".")[0]
        if isinstance(e, ImportError) and top in OPTIONAL_EXTRAS:
            why = f"{top} is not installed; install it with: pip install -e '.[{OPTIONAL_EXTRAS[top]}]'"
        raise ConfigError("model._target_", target, "an importable nn.Module class or factory", why=why) from e
    if not callable(obj):
        raise ConfigError("model._target_", target, "an importable nn.Module class or factory", why="not callable")
