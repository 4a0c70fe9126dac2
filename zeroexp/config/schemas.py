"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore, and up-front validation.

Every option YAML under ``conf/`` extends one of these schemas through its defaults list
(``- /schema/<group>@_here_: <schema>``), so a mistyped value (``model.width=abc``) or an unknown top-level key
fails at composition time with the full key in Hydra's message. Each strategy's schema is its entry in
zeroexp.cell.strategy (``StrategyAdapter.schema``; torch-free, so composing needs no adapter) and is open to
the keys of other strategies, so that one sweep can set a key for the strategies that have it
(:func:`strategy_extras`). :func:`validate` then checks what types cannot express (a ``strategy.<key>`` the strategy
lacks, positive sizes, axes that do not apply to a strategy, targets that must import) before any rank is started,
and raises :class:`ConfigError` naming the key, the value and what is accepted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict, read_write

from zeroexp.config.known_keys import check_known_keys
from zeroexp.errors import ConfigError, InvalidCell, NotApplicableHere
from zeroexp.config.moves import check_load_from
from zeroexp.config.checkpointing import (ActivationCheckpointingConfig, check_checkpointing, check_checkpointing_units,
                                         check_save_ops)
from zeroexp.config.init_mode import INIT_OPTIONS, InitConfig, check_init
from zeroexp.config.model_check import check_model
from zeroexp.config.optimizer import OptimizerConfig, check_optimizer
from zeroexp.models.schemas import (MODEL_COUNTS, MODEL_RESERVED_KEYS, GPTConfig, HFConfig, LoRAGPTConfig, MLPConfig,
                                    ModelConfig)
from zeroexp.cell.strategy import SCHEMAS, schema_keys
from zeroexp.config.allocator import AllocatorConfig, check_allocator
from zeroexp.config.resources import ResourcesConfig, check_resources

if TYPE_CHECKING:
    from zeroexp.cell.resolved import Cell

__all__ = ["ConfigError", "InvalidCell", "NotApplicableHere", "register_schemas", "validate", "MODEL_RESERVED_KEYS",
           "strategy_extras", "without_strategy_extras"]


# --- model: zeroexp.models.schemas --------------------------------------------------------------------

# --- strategies --------------------------------------------------------------------------------------
# Each strategy's schema is its entry in zeroexp.cell.strategy.SCHEMAS, registered here (register_schemas).


# --- small axes --------------------------------------------------------------------------------------
@dataclass
class PrefetchConfig:
    name: str = MISSING  # pre | post | none (FSDP BackwardPrefetch)


@dataclass
class PrecisionConfig:
    """Dtypes of training; a strategy runs only the precisions its row lists (``StateLayout.precisions``)."""

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
    load_from: Optional[str] = None  # a kept checkpoint's directory the cell's training starts from (any strategy of
    # its layout, any world size; zeroexp.config.moves); null: from the seed's initial weights
    source: Optional[str] = None  # or the overrides of a cell that writes the checkpoint first, e.g. "strategy=ddp
    # world_size=2" (zeroexp.cell.written; experiment=checkpoint_moves sweeps it); null: none
    sources_dir: str = "outputs/checkpoint_sources"  # where source cells keep their checkpoints (reused when there)


@dataclass
class LoggerConfig:
    name: str = MISSING  # wandb | csv | none
    mode: str = "offline"  # wandb only: offline | online | disabled
    project: str = "zeroexp"
    entity: Optional[str] = None


@dataclass
class TimeoutConfig:
    collective_s: float = 300.0  # process-group timeout: a rank stuck in a collective fails after this
    cell_s: float = 3600.0  # whole cell, all ranks
    grace_s: float = 5.0  # after one rank fails, how long the others get to exit before they are killed


@dataclass
class ProbesConfig:
    """How many post-warm-up steps each measurement owns (see ``zeroexp.cell.schedule``)."""

    profile_steps: int = 2  # steps the collectives probe records with the torch profiler
    memory_steps: int = 2  # steps the memory probe tracks for the training peak
    # Replay to locate where training parts from the reference (zeroexp.probes.divergence): null on a FAIL
    trace_divergence: Optional[bool] = None


@dataclass
class ZeroexpConfig:
    model: Any = MISSING
    strategy: Any = MISSING
    prefetch: Any = MISSING
    precision: Any = MISSING
    offload: Any = MISSING
    activation_checkpointing: Any = MISSING
    init: Any = MISSING  # full | meta (zeroexp.config.init_mode)
    logger: Any = MISSING
    launcher: Any = MISSING
    checkpoint: Any = MISSING
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    timeout: TimeoutConfig = field(default_factory=TimeoutConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    # zeroexp.config.resources: the check before launch
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    world_size: int = 4
    steps: int = 30
    batch_size: int = 8  # per rank and micro-batch; the global batch is batch_size * grad_accum * world_size
    grad_accum: int = 1  # micro-batches per optimizer step (zeroexp.rank.microbatches); steps counts optimizer steps
    seed: int = 0
    warmup_steps: int = 3  # steps excluded from steady measurements
    device: str = "auto"  # auto | cpu | cuda
    resume: bool = False  # --multirun into an existing sweep dir: re-run only cells missing or not ok
    # One process plays rank 0 of world_size ranks under a fake process group and FakeTensorMode: state table
    # and collectives without allocating the parameters (zeroexp.rank.dryrun); no time, memory or equivalence.
    dry_run: bool = False
    # plan.time's calibration file (python -m zeroexp.calibrate); null: the newest of this machine, backend and N
    calibration: Optional[str] = None


#: The strategies (name, schema) whose schemas this process's ConfigStore holds (``register_schemas``).
_REGISTERED: tuple = ()


def register_schemas() -> None:
    """Register the schemas under ``schema/<group>`` (options extend them) and the root schema; once per process
    (each call re-made ~40 structured configs, 0.06 to 0.4 s, and the CLI, the planner and every compose of the
    tests call it), again only if a strategy's schema was added since or Hydra's store was cleared."""
    global _REGISTERED
    cs = ConfigStore.instance()
    adapters = tuple(SCHEMAS.items())
    if adapters == _REGISTERED and "zeroexp_schema.yaml" in cs.repo:
        return
    cs.store(name="zeroexp_schema", node=ZeroexpConfig)
    # Open schema: the data-spec keys are typed, any other key is an argument of the `_target_` factory.
    cs.store(group="schema/model", name="model", node=OmegaConf.structured(ModelConfig, flags={"struct": False}))
    cs.store(group="schema/model", name="mlp", node=MLPConfig)
    cs.store(group="schema/model", name="gpt", node=GPTConfig)
    cs.store(group="schema/model", name="lora_gpt", node=LoRAGPTConfig)
    cs.store(group="schema/model", name="hf", node=HFConfig)
    # Each strategy's own schema (zeroexp.cell.strategy) as schema/strategy/<name>. Typed, and open to keys of
    # other strategies: in a sweep across strategies a key set for all (strategy.stage=2,3) stays in the jobs whose
    # strategy lacks it; it does not apply there (not in the cell's identity, removed before the cell runs), and
    # validate() refuses it where the user asked for it in a single run (strategy_extras).
    for name, schema in SCHEMAS.items():
        cs.store(group="schema/strategy", name=name, node=OmegaConf.structured(schema, flags={"struct": False}))
    cs.store(group="schema/prefetch", name="prefetch", node=PrefetchConfig)
    cs.store(group="schema/precision", name="precision", node=PrecisionConfig)
    cs.store(group="schema/offload", name="offload", node=OffloadConfig)
    cs.store(group="schema/activation_checkpointing", name="activation_checkpointing",
             node=ActivationCheckpointingConfig)
    cs.store(group="schema/init", name="init", node=InitConfig)
    cs.store(group="schema/logger", name="logger", node=LoggerConfig)
    cs.store(group="schema/launcher", name="launcher", node=LauncherConfig)
    cs.store(group="schema/checkpoint", name="checkpoint", node=CheckpointConfig)
    _REGISTERED = adapters


# --- validation --------------------------------------------------------------------------------------
_ACCEPTED = {
    "prefetch.name": ("pre", "post", "none"), "precision.name": ("fp32", "bf16", "fp16"),
    "precision.param_dtype": ("float32", "bfloat16", "float16"), "precision.master_dtype": ("float32",),
    "offload.name": ("none", "optimizer", "full"), "init.name": INIT_OPTIONS,
    "logger.name": ("wandb", "csv", "none"), "logger.mode": ("offline", "online", "disabled"),
    "device": ("auto", "cpu", "cuda"), "model.dtype": ("float32", "float16", "bfloat16", "long"),
    "launcher.name": ("local", "torchrun", "slurm"), "checkpoint.name": ("none", "full", "sharded")}


def strategy_extras(cfg: DictConfig) -> tuple[str, ...]:
    """The keys of ``cfg.strategy`` that its strategy's schema lacks (``stage`` for ``fsdp_full`` in
    ``--multirun strategy=deepspeed,fsdp_full strategy.stage=2,3``): they do not apply to this cell, are not part of
    its identity and are removed before it runs (:func:`without_strategy_extras`)."""
    schema = SCHEMAS.get(str(cfg.strategy.name))
    if schema is None:
        return ()
    own = set(schema_keys(schema))
    return tuple(str(k) for k in cfg.strategy if k not in own)


def without_strategy_extras(cfg: DictConfig) -> DictConfig:
    """``cfg`` without the :func:`strategy_extras` (a copy when there are any)."""
    extras = strategy_extras(cfg)
    if not extras:
        return cfg
    cfg = copy.deepcopy(cfg)
    with read_write(cfg), open_dict(cfg):
        for key in extras:
            del cfg.strategy[key]
    return cfg


def strategy_key(override_key: str) -> str | None:
    """``strategy.bucket_cap_mb`` -> ``bucket_cap_mb`` (also ``strategy.wrap[0]``, ``strategy.a.b``); else None."""
    if not override_key.startswith("strategy."):
        return None
    return override_key[len("strategy."):].split(".", 1)[0].split("[", 1)[0]


def owners_of(key: str) -> list[str]:
    """The registered strategies whose schema has ``strategy.<key>``."""
    return sorted(n for n, schema in SCHEMAS.items() if key in schema_keys(schema))


def _check_strategy_keys(cfg: DictConfig, explicit_overrides: tuple[str, ...]) -> None:
    """A ``strategy.<key>`` the strategy lacks: refused when the user set it (a single run) or when no strategy has
    it (a typo, in a preset too); otherwise it was set for other strategies and does not apply here."""
    name = str(cfg.strategy.name)
    asked = {strategy_key(k) for k in explicit_overrides}
    for key in strategy_extras(cfg):
        owners = owners_of(key)
        if key in asked or not owners:
            own = [k for k in schema_keys(SCHEMAS[name]) if k != "name"]
            raise ConfigError(f"strategy.{key}", OmegaConf.select(cfg, f"strategy.{key}"),
                              f"the keys of strategy={name}: {', '.join(own)}",
                              why=f"strategy={name} has no key {key!r}"
                                  + (f" (strategies that have it: {', '.join(owners)})" if owners else ""))


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> None:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")


#: Groups with a fixed set of keys (their schema's fields): any other key in them is read by nothing. The model is
#: open (its other keys are the factory's arguments), the strategy open to other strategies' keys
#: (_check_strategy_keys).
_FIXED_GROUPS = {"optimizer": OptimizerConfig, "timeout": TimeoutConfig, "probes": ProbesConfig,
                 "resources": ResourcesConfig,
                 "prefetch": PrefetchConfig, "precision": PrecisionConfig, "offload": OffloadConfig,
                 "activation_checkpointing": ActivationCheckpointingConfig,
                 "init": InitConfig,
                 "logger": LoggerConfig, "launcher": LauncherConfig, "checkpoint": CheckpointConfig}


def _check_unread_keys(cfg: DictConfig) -> None:
    """A key that nothing reads (``+stepz=10``, ``+optimizer.foo=1``) is refused, naming it."""
    check_known_keys(cfg, ZeroexpConfig, groups=_FIXED_GROUPS)


def _check_ranges(cfg: DictConfig) -> None:
    """Values that torch would refuse later (in a rank, with a C++ error): refused now, naming the key."""
    def number(key: str) -> Any:
        value = OmegaConf.select(cfg, key)
        return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value

    def at_least(key: str, low: float, accepted: str, strict: bool = False) -> None:
        v = number(key)
        if v is None or (v <= low if strict else v < low):
            raise ConfigError(key, OmegaConf.select(cfg, key), accepted)

    check_optimizer(cfg)
    seed = OmegaConf.select(cfg, "seed")
    if not 0 <= seed < 2**32:
        raise ConfigError("seed", seed, "an integer in [0, 2**32)")
    if "bucket_cap_mb" in cfg.strategy:  # ddp, zro, zero1/2, deepspeed: torch fails on a cap <= 0 in C++
        at_least("strategy.bucket_cap_mb", 0, "a positive number of MiB", strict=True)
    if cfg.strategy.get("clip_grad_norm") is not None:  # every strategy's schema has it (StrategyConfig)
        at_least("strategy.clip_grad_norm", 0, "null or a positive max norm", strict=True)
    if cfg.precision.get("loss_scale") is not None:
        at_least("precision.loss_scale", 0, "null or a positive initial loss scale", strict=True)
    _positive_int(cfg, "precision.growth_interval")
    if cfg.launcher.name == "local":
        for key, want in (("launcher.nodes", 1), ("launcher.ranks_per_node", cfg.world_size)):
            if OmegaConf.select(cfg, key) not in (None, want):
                raise ConfigError(key, OmegaConf.select(cfg, key), f"{want} (or null)",
                                  why="a local cell runs its world_size ranks on this machine")


def validate(cfg: DictConfig, explicit_overrides: tuple[str, ...] = (), before_torch: Any = None) -> Cell:
    """Check a composed cell config; raise :class:`ConfigError` on the first problem; return the cell, resolved
    (:class:`zeroexp.cell.resolved.Cell`, its model's shape read once here).

    ``before_torch``: called once the config's own keys passed, before the model check imports torch.
    ``explicit_overrides`` are the keys the user set on the command line (``prefetch``,
    ``strategy.bucket_cap_mb``...): an axis or a ``strategy.<key>`` that does not apply to the strategy is an error
    only when the user asked for it explicitly in a single run (sweeps de-duplicate such cells instead).

    Two stages, which a ``--multirun`` sweep treats apart (``zeroexp.cli.sweep.check_jobs``). The config's own: the
    strategy's name, every key, option, size and range (:func:`_check_knobs`), the model's keys and the model itself
    (it imports, builds and runs a forward): a refusal here is a plain :class:`ConfigError` and stops a whole sweep
    before its first cell (a typo, a model that does not build, a bad value). Then the cell's: what the strategy
    implements for this model, precision, offload, axes, init, checkpoint and launcher, and whether the cell fits this
    machine: a refusal here is an :class:`InvalidCell` (a :class:`NotApplicableHere` stays one), and a sweep records
    that job ``refused`` and runs its others.
    """
    name = cfg.strategy.name
    if name not in SCHEMAS:  # up to the model check, nothing here imports torch: a bad key is refused at once
        raise ConfigError("strategy", name, ", ".join(sorted(SCHEMAS)))
    _check_knobs(cfg, explicit_overrides)
    _check_model_keys(cfg)
    if before_torch is not None:  # the caller's imports that are cheaper before torch's (a refusal above pays none)
        before_torch()
    check_save_ops(cfg)
    check_model(cfg)  # zeroexp.config.model_check: importable, builds on the meta device, one forward and the loss
    shape = _shape_of(cfg)
    try:
        _check_what_the_strategy_runs(cfg, explicit_overrides, shape)
        check_allocator(cfg)
        check_resources(cfg, shape)  # last: a local cell whose ranks cannot fit this machine (memory, processes, files)
    except (InvalidCell, NotApplicableHere):
        raise
    except ConfigError as e:  # the strategy's and the adapters' refusals are plain ConfigErrors: this cell's own
        raise InvalidCell.of(e) from e
    from zeroexp.cell.resolved import Cell

    return Cell.of(cfg, shape)


def _shape_of(cfg: DictConfig) -> Any:
    """The model's shape (zeroexp.plan.shape.model_shape), once the model check passed; None where it cannot be read
    on the meta device (a model the forward check skipped): the plan reads it then, and says why it cannot."""
    from zeroexp.models import wrap_paths
    from zeroexp.plan.shape import model_shape

    try:
        return model_shape(cfg.model, wrap_paths(cfg))
    except Exception:  # noqa: BLE001 - the model check decided what is refused; the plan reports this one
        return None


def _check_source(cfg: DictConfig) -> None:
    """``checkpoint.source`` reads as overrides of a strategy zeroexp has (zeroexp.cell.written): a typo stops a
    sweep before its first cell; what the cell's strategy reads is its own (zeroexp.config.moves)."""
    from zeroexp.cell.written import ACCEPTED, parse_source

    spec = parse_source(cfg.checkpoint.get("source"))
    if spec is not None and spec.strategy not in SCHEMAS:
        raise ConfigError("checkpoint.source", spec.text, ACCEPTED,
                          why=f"strategy={spec.strategy} is none of {', '.join(sorted(SCHEMAS))}")


def _check_knobs(cfg: DictConfig, explicit_overrides: tuple[str, ...]) -> None:
    """The keys, options, sizes, windows and timeouts of the cell, from the config alone (no torch)."""
    if cfg.get("calibration"):  # plan.time's calibration: readable before any rank starts
        from zeroexp.results.calibration import load_calibration

        try:
            load_calibration(cfg.calibration)
        except ValueError as e:
            raise ConfigError("calibration", cfg.calibration, "null or a file python -m zeroexp.calibrate wrote",
                              why=str(e)) from e
    _check_unread_keys(cfg)
    _check_strategy_keys(cfg, explicit_overrides)
    check_checkpointing(cfg, explicit_overrides)
    for key, accepted in _ACCEPTED.items():
        value = OmegaConf.select(cfg, key)
        if value not in accepted:
            raise ConfigError(key, value, ", ".join(accepted))
    _positive_int(cfg, "world_size")
    _check_source(cfg)
    _positive_int(cfg, "steps")
    _positive_int(cfg, "batch_size")
    _positive_int(cfg, "grad_accum")
    _positive_int(cfg, "warmup_steps", minimum=0)
    from zeroexp.cell.schedule import Schedule

    for key in ("probes.profile_steps", "probes.memory_steps"):
        _positive_int(cfg, key)
    for problem in Schedule.from_cfg(cfg).problems():  # a window shorter than its probe needs; too few `steps`
        raise ConfigError("probes", OmegaConf.select(cfg, "probes"), "windows of at least one step", why=problem)
    for key in ("timeout.collective_s", "timeout.cell_s", "timeout.grace_s"):
        if not OmegaConf.select(cfg, key) > 0:
            raise ConfigError(key, OmegaConf.select(cfg, key), "a positive number of seconds")
    _check_ranges(cfg)


def _check_model_keys(cfg: DictConfig) -> None:
    """The model node's own keys: what ``model=custom`` leaves to the user, sizes, the input's shape, the loss."""
    model = cfg.model
    for key in ("_target_", "input_shape"):  # model=custom leaves them to the user
        if OmegaConf.is_missing(model, key):
            raise ConfigError(f"model.{key}", "???", "a class or factory by import path (model._target_=pkg.Module)"
                              if key == "_target_" else "a non-empty list of positive integers ('model.input_shape="
                              "[16]')", why=f"model={model.get('name')} needs it")
    for key in MODEL_COUNTS:
        if model.get(key) is not None:
            _positive_int(cfg, f"model.{key}")
    if "n_head" in model and model.n_embd % model.n_head:
        raise ConfigError("model.n_head", model.n_head, f"a divisor of model.n_embd={model.n_embd}")
    if model.dtype == "long" and model.high is not None and not 0 <= model.low < model.high:
        raise ConfigError("model.high", model.high, f"an integer above model.low={model.low} >= 0")
    shape = list(model.input_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ConfigError("model.input_shape", shape, "a non-empty list of positive integers")
    from zeroexp.models import LOSSES

    if model.loss not in LOSSES:
        raise ConfigError("model.loss", model.loss, ", ".join(sorted(LOSSES)))


def _check_what_the_strategy_runs(cfg: DictConfig, explicit_overrides: tuple[str, ...], shape: Any = None) -> None:
    """What the strategy implements (its row's precisions, its adapter's offloads, axes, warm-up, checkpoints,
    init), then the adapter's own refusals."""
    from zeroexp.formulas.rows import row_of  # the expectation model: not for --help or a refused override
    from zeroexp.strategies import get_adapter_class, registered

    name = cfg.strategy.name
    adapter = get_adapter_class(name)
    row = row_of(str(cfg.strategy.layout))  # what the strategy runs and the expectation model covers: one fact
    if cfg.precision.name not in row.precisions:
        raise ConfigError("precision", cfg.precision.name, ", ".join(sorted(row.precisions)),
                          why=f"strategy={name} (row {cfg.strategy.layout}) does not implement it")
    offloads = getattr(adapter, "offloads", frozenset({"none"}))
    if cfg.offload.name not in offloads:
        supported = sorted(n for n, a in registered().items() if cfg.offload.name in getattr(a, "offloads", ()))
        raise ConfigError("offload", cfg.offload.name, ", ".join(sorted(offloads)),
                          why=f"strategy={name} does not implement it; strategies that do: "
                              f"{', '.join(supported) or 'none'}")
    for axis in ("prefetch",):
        if axis in explicit_overrides and axis not in SCHEMAS[name].axes:
            value = OmegaConf.select(cfg, f"{axis}.name")
            users = ", ".join(sorted(n for n, schema in SCHEMAS.items() if axis in schema.axes))
            raise ConfigError(axis, value, f"strategies that use it: {users}",
                              why=f"{axis} does not apply to strategy={name}")
    if cfg.warmup_steps < adapter.min_warmup_steps:  # the collectives probe records the first step after it
        raise ConfigError("warmup_steps", cfg.warmup_steps, f"an integer >= {adapter.min_warmup_steps}",
                          why=f"strategy={name} issues its steady per-step collectives only from step "
                              f"{adapter.min_warmup_steps} on")
    from zeroexp.models import wrap_paths

    check_checkpointing_units(cfg, wrap_paths(cfg))
    _validate_launcher_and_checkpoint(cfg, adapter)
    check_load_from(cfg, adapter)
    check_init(cfg, adapter)
    adapter.validate(cfg)
    adapter.validate_model(cfg, shape)


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
