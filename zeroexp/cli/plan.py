"""``python -m zeroexp.plan``: Hydra-configured like the runner (``conf/plan.yaml``), prints tables, JSON or a
self-contained HTML page of the answer as a picture (``zeroexp.report.plan_picture``).

Exit codes: 0 planned; 2 bad input (an unknown key, a bad value), with a message naming the key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from zeroexp.config.allocator import AllocatorConfig
from zeroexp.config.checkpointing import checked_option
from zeroexp.cell.resolved import units_ahead
from zeroexp.cell.strategy import DS_STAGE3_KEYS
from zeroexp.cli.planned_model import answer_store, model_shape, wrap_units
from zeroexp.errors import ConfigError
from zeroexp.formulas import (COMPUTE_ITEMSIZE, DS_PERSISTENCE_REFUSED, ModelShape, PlanKnobs, ds_persistent,
                              ds_stage3_limits)
from zeroexp.plan.knobs import ds_knobs, fsdp2_knobs
from zeroexp.plan.core import (HEADROOM, UNITS, Precision, check_headroom, checkpoint_peak_records, parse_bytes,
                               parse_count, plan, untraced)

__all__ = ["PlanConfig", "as_plan_keys", "main", "run"]

_STARTED = False
#: What ``format=`` prints on stdout: rich tables, the records as JSON, or the records drawn as one HTML page.
FORMATS = ("table", "json", "html")


@dataclass
class PlanConfig:
    """The planner's keys; ``model``, ``precision`` and ``offload`` are the runner's config groups."""

    model: Any = None  # model=<option of conf/model/>: planned from its shapes, built on the meta device
    precision: Any = MISSING
    offload: Any = MISSING  # none (conf/offload/), optimizer | full (planner-only options, see register)
    init: Any = MISSING  # full | meta (conf/init/): init_peak_bytes, and fits with meta (zeroexp.formulas.init)
    params: Any = None  # or a parameter count: 7.5e9, 7.5B
    largest_layer: Any = None  # with params=: the largest module's own parameters (DeepSpeed's largest_layer_params)
    world_size: Any = 8  # one value or a list
    strategies: Any = None  # null: every strategy the planner knows; or a list
    device_memory: Any = None  # 32GB, 80GiB, or bytes: adds the fits column
    headroom: Any = HEADROOM  # the fraction of device_memory fits leaves free (zeroexp.plan.core.HEADROOM)
    units: str = "GiB"  # GiB (2^30, as a run reports) | GB (1e9, the ZeRO paper's): tables only, JSON in bytes
    format: str = "table"  # table | json | html (the records drawn: zeroexp.report.plan_picture)
    wrap: Optional[List[str]] = None  # FSDP unit classes; null: the model's own (model.wrap)
    bucket_cap_mb: float = 25.0  # zero1 / zero2 buckets (MiB of compute-dtype parameters); DeepSpeed's reduce bucket
    batch_size: Optional[int] = None  # samples per rank: adds the activations one forward saves (traced; needs model=)
    shard_size: Optional[int] = None  # hybrid rows (fsdp_HYBRID_SHARD, fsdp2_hybrid...): ranks per shard group
    use_orig_params: bool = True  # the FSDP1 rows' strategy.use_orig_params (a cell's default: true)
    # network=<option of conf/network/>: adds step_ms, exposed_comm_ms, tokens_per_s (needs batch_size)
    network: Any = None
    # none | full | selective_layer | selective_op (the runner's group, with its keys: zeroexp.config.checkpointing)
    activation_checkpointing: Any = MISSING
    grad_accum: Any = 1  # micro-batches of batch_size per optimizer step: their collectives, the gradients held, time
    # FSDP and FSDP2 rows with grad_accum, as a cell's strategy.sync_each_microbatch: false (no_sync: gradients held
    # unsharded to the last micro-batch) | true (reduce-scatter every micro-batch, torchtitan's: the shards accumulate)
    sync_each_microbatch: bool = False
    # true: a model's shape, units and traced steps read from and written to outputs/cache/ (or $ZEROEXP_CACHE_DIR;
    # zeroexp.cell.store), answers of an earlier plan of the same model and code; false: every one computed afresh
    cache: bool = True
    # the CUDA caching allocator's mode, as a cell's allocator.expandable_segments: reserved_peak_bytes under it
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    device: Any = None  # cpu | cuda: the device semantics of the peak model (null: cuda with device_memory or a network
    # preset of GPUs, else cpu; zeroexp.formulas.device)
    compute_capability: Any = None  # cuda: the GPU's (7.0, 8.0, 9.0), its cuBLAS workspace size; null: the network's
    prefetch: Any = MISSING  # pre | post | none (the runner's group): fsdp_full's backward prefetch, as in a cell
    foreach: Any = None  # cuda: AdamW's foreach update (null, true: torch's CUDA default; false: single-tensor)
    # AdamW's update path on any device, as a run's optimizer.impl (which plans as this key): null (the device's),
    # single | foreach | fused (no temporaries)
    adamw_impl: Any = None
    # FSDP2 rows, as a cell's strategy.* keys: true | null (fsdp2_full: the root kept unsharded forward to backward)
    # | an int k dividing each world_size (fsdp2_full: each unit resharded to k ranks after forward, ZeRO++'s hpZ)
    reshard_after_forward: Any = True
    # fsdp2_full: torchtitan's reshard_after_forward per unit, as a cell's strategy.reshard_policy: null | always |
    # default (every unit but the last resharded, the root kept) | never (every unit kept: fsdp2_grad_op's state)
    reshard_policy: Any = None
    forward_prefetch: Any = 0  # units each unit's pre-forward all-gathers ahead (0: FSDP2's default, none)
    backward_prefetch: Any = None  # units each unit's pre-backward all-gathers ahead (null: FSDP2's implicit one)
    reduce_dtype: Any = None  # FSDP2 rows: MixedPrecisionPolicy's reduce dtype (null: precision.param_dtype)
    # deepspeed_stage3, as a cell's strategy.* keys (parameter elements; null: the default, ds_stage3_limits)
    stage3_prefetch_bucket_size: Any = None
    stage3_max_live_parameters: Any = None
    stage3_param_persistence_threshold: Any = None
    stage3_max_reuse_distance: Any = None
    # deepspeed_stage2 / _stage3, as a cell's strategy.overlap_comm: reductions overlapping backward (stage 2: a second
    # ipg buffer); the stage 0-1 rows are planned without it (a cell refuses it there)
    overlap_comm: Any = False
    # strategy=<a cell's strategy> (conf/strategy/): its row alone (strategy.layout), its strategy.* keys over the
    # flat aliases above (bucket_cap_mb, shard_size, use_orig_params, reshard_after_forward, ..., wrap)
    strategy: Any = None


#: The run's keys the planner reads nothing of (zeroexp.config.schemas.ZeroexpConfig's): a run's command line plans
#: as it is, each of these dropped from it with a note.
RUN_ONLY = ("logger", "launcher", "checkpoint", "optimizer", "timeout", "probes", "resources", "steps", "seed",
            "warmup_steps", "resume", "dry_run", "calibration")
#: A cell's strategy.* keys that the planner reads, as its flat keys of the same name.
STRATEGY_KEYS = ("bucket_cap_mb", "shard_size", "use_orig_params", "reshard_after_forward", "forward_prefetch",
                 "backward_prefetch", "reduce_dtype", "wrap", "reshard_policy", "sync_each_microbatch",
                 "overlap_comm", *DS_STAGE3_KEYS)
#: The overrides of this command line that only a run reads (:func:`split_run_only`), told in a note.
_IGNORED: tuple[str, ...] = ()


def split_run_only(argv: list[str]) -> tuple[list[str], list[str]]:
    """A command line's arguments less the overrides of the keys only a run reads (:data:`RUN_ONLY`), and those."""
    keep, dropped = [], []
    for a in argv:
        key = a.split("=", 1)[0].lstrip("+~") if "=" in a and not a.startswith("-") else ""
        (dropped if key.split(".")[0] in RUN_ONLY else keep).append(a)
    return keep, dropped


def as_plan_keys(argv: list[str]) -> list[str]:
    """A command line's arguments with a run's ``optimizer.impl`` (AdamW's update path) as the planner's
    ``adamw_impl``; the rest of ``optimizer.*`` is a run's alone (:data:`RUN_ONLY`)."""
    return [f"adamw_impl={a.split('=', 1)[1]}" if a.split("=", 1)[0] == "optimizer.impl" else a for a in argv]


def with_strategy(cfg: DictConfig) -> tuple[DictConfig, list[str] | None]:
    """``strategy=<a cell's strategy>``: its row alone (``strategy.layout``) and its ``strategy.*`` keys over the
    planner's flat keys of the same name (:data:`STRATEGY_KEYS`); without it the config and ``strategies=`` as given.
    Both at once is refused (one row, or a list of rows)."""
    strategies = cfg.strategies
    if strategies is not None:
        strategies = [str(s) for s in (strategies if isinstance(strategies, ListConfig) else [strategies])]
    if cfg.get("strategy") is None:
        return cfg, strategies
    if strategies is not None:
        raise ConfigError("strategies", strategies, "null with strategy= (which plans its own row), or drop strategy=",
                          why=f"both strategy={cfg.strategy.name} and strategies= given")
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key in STRATEGY_KEYS:
        if key in cfg.strategy and (cfg.strategy[key] is not None or key == "reshard_after_forward"):
            out[key] = cfg.strategy[key]
    if isinstance(out.forward_prefetch, bool):  # FSDP1's: the next unit's all-gather or none, as a cell plans it
        out.forward_prefetch = units_ahead(out.forward_prefetch)
    return out, [str(cfg.strategy.layout)]


def register() -> None:
    """Register the runner's schemas (model, precision and offload options extend them) and the planner's."""
    from zeroexp.config.schemas import register_schemas

    register_schemas()
    ConfigStore.instance().store(name="plan_schema", node=PlanConfig)


def _world_sizes(value: Any) -> list[int]:
    sizes = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError("world_size", OmegaConf.to_object(value) if isinstance(value, ListConfig) else value,
                          "an integer >= 1 or a list of them, e.g. [8,64,1024]")
    return sizes


def run(cfg: DictConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Validate a composed plan config and plan it; raises :class:`ConfigError` on bad input. A model's shape, units
    and traces are read from and written to the store on disk (:func:`answer_store`)."""
    from zeroexp.config.known_keys import check_known_keys

    check_known_keys(cfg, PlanConfig)
    stored: list[str] = []
    with answer_store(cfg, stored):
        records, notes = _run(cfg)
    return records, notes + stored


def _run(cfg: DictConfig) -> tuple[list[dict[str, Any]], list[str]]:
    for key, accepted in (("units", tuple(UNITS)), ("format", FORMATS)):
        if cfg[key] not in accepted:
            raise ConfigError(key, cfg[key], ", ".join(accepted))
    if cfg.precision.param_dtype not in COMPUTE_ITEMSIZE:
        raise ConfigError("precision.param_dtype", cfg.precision.param_dtype, ", ".join(COMPUTE_ITEMSIZE))
    if not cfg.bucket_cap_mb > 0:
        raise ConfigError("bucket_cap_mb", cfg.bucket_cap_mb, "a positive number of MiB")
    try:
        memory = None if cfg.device_memory is None else parse_bytes(cfg.device_memory)
    except ValueError as e:
        raise ConfigError("device_memory", cfg.device_memory, "a size: 32GB, 80GiB, or bytes", why=str(e)) from e
    headroom = check_headroom(cfg.headroom, "headroom")
    cfg, strategies = with_strategy(cfg)
    batch = cfg.get("batch_size")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ConfigError("batch_size", batch, "null or an integer >= 1 (samples per rank)")
    shard = cfg.get("shard_size")
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 2):
        raise ConfigError("shard_size", shard, "null or an integer >= 2 (ranks per shard group of the hybrid rows)")
    accum = cfg.grad_accum
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        raise ConfigError("grad_accum", accum, "an integer >= 1 (micro-batches of batch_size per optimizer step)")
    mode = checked_option(cfg)
    shape, model = model_shape(cfg)
    persistent = ds_persistent(shape.numels, ds_stage3_limits(persistence=cfg.stage3_param_persistence_threshold))
    if persistent and (strategies is None or "deepspeed_stage3" in strategies):
        raise ConfigError("stage3_param_persistence_threshold", cfg.stage3_param_persistence_threshold,
                          f"below {min(shape.numels)} (the smallest parameter's elements), or null",
                          why=DS_PERSISTENCE_REFUSED)
    network = _network(cfg, batch)
    if network is not None and memory is None and network.device_memory is not None:
        memory = parse_bytes(network.device_memory)
    device = _device(cfg, memory)  # its keys refused before anything is traced
    knobs = PlanKnobs(bucket_cap_bytes=int(float(cfg.bucket_cap_mb) * 2**20),
                      loss_scaling=cfg.precision.get("loss_scale") is not None, shard_size=shard or 0,
                      micro_batches=accum, use_orig_params=bool(cfg.use_orig_params),
                      sync_each_microbatch=bool(cfg.sync_each_microbatch),
                      **fsdp2_knobs(cfg, _world_sizes(cfg.world_size)), recompute=mode.mode != "none",
                      recompute_mode=mode.mode.replace("none", ""),
                      recompute_every=mode.every, offload=str(cfg.offload.name), **ds_knobs(cfg))
    with untraced(cfg.model.get("name") if cfg.model is not None else None):  # a step fake tensors cannot run: exit 2
        ac = mode.label
        precision = Precision(cfg.precision.name, cfg.precision.param_dtype)
        records, notes = plan(shape, _world_sizes(cfg.world_size), precision, cfg.offload.name, strategies, knobs,
                              memory, model, headroom)
        activations = _activations(cfg, batch, mode) if batch is not None else None
        if batch is not None and activations is None:
            notes.append(f"activations at batch_size={batch}: unknown for a parameter count (no shapes to trace; give "
                         "model=)")
        for r in records:
            r.update(batch_size=batch, grad_accum=accum, activation_checkpointing=ac,
                     sync_each_microbatch=bool(cfg.sync_each_microbatch))
            r.update(activations or {"activation_bytes": None, "activation_cast_bytes": None,
                                     "activation_unit_bytes": None, "korthikanti_bytes": None})
        notes += [f"device=cuda: not modelled: {', '.join(device.not_modelled)}"] if device.name == "cuda" else []
        _peaks(cfg, records, shape, batch, knobs, mode, device)
        _ds_terms(records, shape, _largest_layer(cfg, shape), precision, str(cfg.offload.name), knobs, device)
        _init_peaks(str(cfg.init.name), records, shape, memory, bool(cfg.use_orig_params))
        if shape.exact:  # each parameter's shape: what a checkpoint's save and load hold per rank
            checkpoint_peak_records(records, shape, precision, knobs, device)
        if network is not None:  # after the peaks: "the fastest that fits" reads fits
            from zeroexp.plan.network import add_step_times, model_ops

            add_step_times(records, shape, network, precision.itemsize, knobs, batch, _tokens(cfg), mode,
                           model_ops(network, cfg.model, batch), _recompute_share(cfg, batch, mode, notes),
                           cfg.model)
            if cfg.model is None and network.rate.counts_ops:
                notes.append("step_ms: a parameter count has no operators to count: each forward's and backward's cost "
                             "per operator left out (give model= for it)")
            if cfg.model is None:
                notes.append("tokens_per_s: a parameter count has no input shape, one token a sample assumed")
        return records, notes


def _device(cfg: DictConfig, memory: int | None) -> Any:
    """The peak model's device semantics (zeroexp.formulas.device): ``device=``, else cuda where a device memory or
    a GPU network preset is given, else cpu; on cuda the GPU's ``compute_capability`` (else the network preset's),
    the allocator's mode (``allocator.expandable_segments``), NCCL's topology and settings and the CUDA context (the
    network preset's ``nccl`` and ``context_bytes``: :func:`zeroexp.plan.network.nccl_of`)."""
    from zeroexp.config.optimizer import ADAMW_IMPLS
    from zeroexp.formulas.device import CPU, cuda

    network = cfg.network or {}
    name = cfg.device or ("cuda" if memory is not None or network.get("device") == "cuda" else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError("device", name, "cpu, cuda (null: cuda with device_memory or a GPU network, else cpu)")
    capability = cfg.get("compute_capability")
    if capability is None:
        capability = network.get("compute_capability")
    if capability is not None and (isinstance(capability, bool) or not isinstance(capability, (int, float))):
        raise ConfigError("compute_capability", capability, "a number: 7.0 (V100), 8.0 (A100), 9.0 (H100)")
    foreach, impl = cfg.get("foreach"), cfg.get("adamw_impl")
    if foreach is not None and (not isinstance(foreach, bool) or name != "cuda"):
        raise ConfigError("foreach", foreach, "null, true or false with device=cuda (AdamW's foreach update; the CPU "
                          "steps single-tensor)")
    if impl is not None and (impl not in ADAMW_IMPLS or foreach is not None):
        raise ConfigError("adamw_impl", impl, "null (the device's AdamW update) or " + ", ".join(ADAMW_IMPLS)
                          + " (a run's optimizer.impl), without foreach=", why="foreach= given too"
                          if foreach is not None and impl in ADAMW_IMPLS else "")
    expandable = bool(OmegaConf.select(cfg, "allocator.expandable_segments", default=False))
    if name == "cpu":
        if expandable:
            raise ConfigError("allocator.expandable_segments", True, "false with device=cpu (the CUDA caching "
                              "allocator's mode: true needs device=cuda, a device_memory or a GPU network)")
        return CPU.with_adamw(impl)
    from zeroexp.plan.network import nccl_of

    topology, settings, context = nccl_of(network)
    semantics = cuda(None if capability is None else float(capability), expandable, topology, settings,
                     context).with_adamw(impl)
    return semantics if foreach is None else replace(semantics, foreach=foreach)


def _peaks(cfg: DictConfig, records: list[dict[str, Any]], shape: ModelShape, batch: int | None,
           knobs: PlanKnobs, checkpointing: Any = False, device: Any = None) -> None:
    """The peak model (``zeroexp.plan.check.memory``, docs/planner.md) on every row it covers, in the precision the row
    computes in (the step traced in its dtypes, ``cell_precision_terms``): ``peak_bytes`` (model state + its steady
    buffers + the largest phase above steady, the largest rank), ``peak_phase``, ``phase_bytes``; ``peak_note`` where
    it does not cover the row. Then ``fits`` of every row (``core.judge_fits``: on the peak where there is one).
    ``init_peak_bytes``: every rank builds the whole model before wrapping it (fp32, as the runner does).
    ``checkpointing``: the option whose wrap units the traced step checkpoints; ``knobs.micro_batches``: each phase
    the highest over the micro-batches, and ``accum_grad_bytes``, the gradients held between them. ``device``: the
    semantics (zeroexp.formulas.device: AdamW's update, the backend's copies, the cuBLAS workspaces in
    ``steady_bytes``);
    on cuda ``reserved_peak_bytes``, the caching allocator's segments for the same live bytes
    (zeroexp.formulas.peak.allocator), on which ``fits`` is then judged."""
    from zeroexp.formulas.device import CPU
    from zeroexp.plan.row_peak import row_peak

    wrap = []
    if batch is not None and cfg.model is not None:  # a parameter count traces nothing: no torch
        from zeroexp.plan.check.memory import trace_units_wanted

        wrap = wrap_units(cfg)
        trace_units_wanted([(r["strategy"], str(cfg.precision.name), str(cfg.precision.param_dtype),
                             knobs.micro_batches) for r in records])  # every row's view of a step from one run
    for r in records:
        peak = row_peak(r, shape, cfg.precision, knobs, cfg.model, batch, wrap, checkpointing,
                        str(cfg.prefetch.name), device or CPU, r["device_memory_bytes"], r["headroom"])
        del peak["by_category"]
        r.update(peak, init_peak_bytes=4 * r["numel"])


def _largest_layer(cfg: DictConfig, shape: ModelShape) -> int | None:
    """``largest_layer=``: a parameter count no larger than ``params=`` (a model's shapes give their own)."""
    value = cfg.get("largest_layer")
    if value is None:
        return None
    accepted = "with params=, a parameter count up to params (the largest module's own parameters: 32.9M)"
    if cfg.model is not None:
        raise ConfigError("largest_layer", value, accepted, why="model= given: its modules give the largest layer")
    try:
        count = parse_count(value)
    except ValueError as e:
        raise ConfigError("largest_layer", value, accepted, why=str(e)) from e
    if count > shape.numel:
        raise ConfigError("largest_layer", value, accepted, why=f"{count:,} > params={shape.numel:,}")
    return count


def _ds_terms(records: list[dict[str, Any]], shape: ModelShape, largest: int | None, precision: Precision,
              offload: str, knobs: PlanKnobs, device: Any) -> None:
    """``ds_peak`` of every DeepSpeed row (``zeroexp.plan.deepspeed_terms.ds_term_record``: the model-state peak term
    by term beside DeepSpeed's estimator; null for the other rows)."""
    from zeroexp.plan.deepspeed_terms import ds_term_record

    for r in records:
        r["ds_peak"] = ds_term_record(r["strategy"], shape, r["world_size"], precision.itemsize, offload,
                                      knobs.bucket_cap_bytes, largest, device.foreach, precision.name == "fp16", knobs)


def _init_peaks(init: str, records: list[dict[str, Any]], shape: ModelShape, memory: int | None,
                use_orig_params: bool = True) -> None:
    """``init_peak_bytes`` of every row (computed, zeroexp.formulas.init, fp32 as the model is built): ``init=full``
    the whole model on every rank and FSDP's flattening of the first unit (``fits`` judges training only);
    ``init=meta`` the rank's shards and the largest unit or module materialised at once, and ``fits`` also needs it
    to fit. ``init_note``: why a row has none (a parameter count has no units; a row whose init=meta is not
    modelled)."""
    from zeroexp.formulas import LAYOUTS
    from zeroexp.formulas.init import init_peak_bytes

    for r in records:
        r["init"] = init
        row = LAYOUTS.get(r["strategy"])
        modelled = row is not None and row.init_modelled
        if init == "full":  # the whole model (4 bytes a parameter), and what wrapping adds where it is modelled
            if modelled and shape.exact:
                r["init_peak_bytes"] = init_peak_bytes(shape, row, "full", r["world_size"], 4, use_orig_params)
            continue
        note = ("init=meta: not modelled for this row (DeepSpeed refuses it; paper and hybrid rows have no model)"
                if not modelled else None if shape.exact else
                "init=meta: a parameter count has no units or modules to materialise (give model=)")
        r.update(init_peak_bytes=None if note else init_peak_bytes(shape, row, "meta", r["world_size"], 4,
                                                                       use_orig_params))
        if note:
            r["init_note"] = note
        elif memory is not None and r.get("fits") is not None:
            r["fits"] = r["fits"] and r["init_peak_bytes"] <= r["usable_memory_bytes"]


def _tokens(cfg: DictConfig) -> int:
    from zeroexp.plan.network import tokens_per_sample

    return 1 if cfg.model is None else tokens_per_sample(cfg.model)


def _network(cfg: DictConfig, batch: int | None):
    """The ``network`` option as a :class:`zeroexp.plan.network.Network`, or None."""
    if cfg.get("network") is None:
        return None
    from zeroexp.plan.network import network_of

    if batch is None:
        raise ConfigError("batch_size", None, "an integer >= 1 (samples per rank)", why=f"network={cfg.network.name} "
                          "times a step, which computes batch_size samples per rank")
    return network_of(cfg.network, str(cfg.precision.name), _tokens(cfg))


def _recompute_share(cfg: DictConfig, batch: int, mode: Any, notes: list[str]) -> float:
    """``selective_op``'s recomputed share of its units' forward (``zeroexp.plan.flops.recompute_share``, counted on
    the model); 1 otherwise, and for a parameter count (no ops to count: said in a note)."""
    if not mode.policy:
        return 1.0
    if cfg.model is None:
        notes.append(f"activation_checkpointing={mode.label}: recompute timed as full's (a parameter count has no ops "
                     "to count which the policy saves; give model=)")
        return 1.0
    from zeroexp.plan.flops import recompute_share

    return recompute_share(cfg.model, batch, tuple(wrap_units(cfg)), mode)


def _activations(cfg: DictConfig, batch: int, checkpointing: Any = None) -> dict[str, Any] | None:
    """One forward of the model at ``batch`` samples per rank, traced under FakeTensorMode in the compute dtype
    (``zeroexp.plan.activations``): the bytes autograd saves, per unit, plus the output and the loss; and for a
    GPT-shaped config, Korthikanti et al.'s closed form beside it. None without a model. ``checkpointing`` (a
    ``Checkpointing`` other than none): ``activation_bytes`` is what the checkpointed forward keeps and
    ``recompute_bytes`` the largest checkpointed unit's recompute (``zeroexp.formulas.peak.checkpointing``, from the
    same per-unit figures, ``selective_op``'s policy counted in the trace); ``activation_unit_bytes`` stays each
    unit's own activations. Below fp32, ``activation_cast_bytes``: the same forward with the module cast to the
    compute dtype instead of autocast (None in fp32)."""
    from zeroexp.formulas.peak.checkpointing import mode_of, recompute_bytes
    from zeroexp.models import torch_dtype
    from zeroexp.plan.activations import korthikanti_layer_bytes
    from zeroexp.plan.row_peak import checkpointed_kept, forward_trace

    if cfg.model is None:
        return None
    mode = mode_of(checkpointing)
    wrap = wrap_units(cfg)
    dtype = torch_dtype(str(cfg.precision.param_dtype))
    trace = forward_trace(cfg.model, batch, wrap, dtype=dtype, policy=mode)
    cast = forward_trace(cfg.model, batch, wrap, module_dtype=dtype, policy=mode) if dtype.itemsize < 4 else None
    m = cfg.model
    gpt = all(k in m for k in ("n_layer", "n_embd", "n_head", "seq_len"))
    return {"activation_bytes": checkpointed_kept(trace, mode),
            "activation_cast_bytes": checkpointed_kept(cast, mode) if cast else None,
            "activation_unit_bytes": trace.unit_bytes,
            "recompute_bytes": recompute_bytes(trace.unit_bytes, mode, trace.unit_policy_bytes,
                                               list(trace.unit_input_bytes)) if mode else None,
            "korthikanti_bytes": int(m.n_layer) * korthikanti_layer_bytes(
                int(m.seq_len), batch, int(m.n_embd), int(m.n_head), dtype.itemsize) if gpt else None}


def task(cfg: DictConfig) -> None:
    """Hydra's task: plan and print (tables on stdout; with JSON, the notes on stderr; with HTML, the page on stdout,
    its notes in it)."""
    from rich.console import Console

    from zeroexp.plan.output import render_json, render_tables

    global _STARTED
    _STARTED = True
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    errors = Console(stderr=True, highlight=False)
    try:  # a spinner with the elapsed time on a terminal (building a large model on the meta device, tracing)
        with errors.status("planning: building the model on the meta device, deriving each strategy's groups"
                           + (", tracing activations" if cfg.get("batch_size") else "")):
            records, notes = run(cfg)
    except ConfigError as e:
        Console(stderr=True, highlight=False).print(f"[red]error:[/] {e}")
        sys.exit(2)
    notes += [f"ignored: {a} (a run's key: the plan reads none of it)" for a in _IGNORED]
    if cfg.format == "json":
        print(render_json(records))
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    elif cfg.format == "html":
        from zeroexp.report.plan_picture import plan_page

        sys.stdout.write(plan_page(records, notes))
    else:
        render_tables(records, notes, cfg.units, console)


def main() -> None:
    """``python -m zeroexp.plan``."""
    from zeroexp.cli.hydra_app import run_hydra_app

    global _IGNORED
    register()
    sys.argv[1:], dropped = split_run_only(as_plan_keys(sys.argv[1:]))
    _IGNORED = tuple(dropped)
    run_hydra_app("plan", task, lambda: _STARTED)
