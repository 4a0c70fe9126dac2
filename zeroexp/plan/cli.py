"""``python -m zeroexp.plan``: Hydra-configured like the runner (``conf/plan.yaml``), prints tables or JSON.

Exit codes: 0 planned; 2 bad input (an unknown key, a bad value), with a message naming the key.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from zeroexp.errors import ConfigError
from zeroexp.formulas import COMPUTE_ITEMSIZE, ModelShape, PlanKnobs
from zeroexp.plan.core import UNITS, Precision, parse_bytes, parse_count, plan

__all__ = ["PlanConfig", "main", "run"]

_STARTED = False


@dataclass
class PlanConfig:
    """The planner's keys; ``model``, ``precision`` and ``offload`` are the runner's config groups."""

    model: Any = None  # model=<option of conf/model/>: planned from its shapes, built on the meta device
    precision: Any = MISSING
    offload: Any = MISSING  # none (conf/offload/), optimizer | full (planner-only options, see register)
    params: Any = None  # or a parameter count: 7.5e9, 7.5B
    world_size: Any = 8  # one value or a list
    strategies: Any = None  # null: every strategy the planner knows; or a list
    device_memory: Any = None  # 32GB, 80GiB, or bytes: adds the fits column
    units: str = "GB"  # GB (1e9) | GiB (2^30): tables only, JSON is in bytes
    format: str = "table"  # table | json
    wrap: Optional[List[str]] = None  # FSDP unit classes; null: the model's own (model.wrap)
    bucket_cap_mb: float = 25.0  # zero1 / zero2 buckets (MiB of compute-dtype parameters); DeepSpeed's reduce bucket


def register() -> None:
    """Register the runner's schemas (model, precision and offload options extend them) and the planner's."""
    from zeroexp.config import register_schemas

    register_schemas()
    ConfigStore.instance().store(name="plan_schema", node=PlanConfig)


def _world_sizes(value: Any) -> list[int]:
    sizes = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError("world_size", OmegaConf.to_object(value) if isinstance(value, ListConfig) else value,
                          "an integer >= 1 or a list of them, e.g. [8,64,1024]")
    return sizes


def _shape(cfg: DictConfig) -> tuple[ModelShape, str]:
    import torch

    from zeroexp.models import build_model, import_class, wrap_paths
    from zeroexp.plan.shape import ready_order, shape_of

    if (cfg.model is None) == (cfg.params is None):
        raise ConfigError("params", cfg.params, "either a parameter count (params=7.5e9) or a model (model=mlp, "
                          "conf/model/), not both", why="both given" if cfg.model is not None else "neither given")
    if cfg.model is None:
        try:
            return ModelShape.from_count(parse_count(cfg.params)), "params"
        except ValueError as e:
            raise ConfigError("params", cfg.params, "a positive count: 7.5e9, 7.5B, 350M, 1T", why=str(e)) from e
    wrap = wrap_paths(OmegaConf.create({"strategy": {"wrap": cfg.wrap}, "model": cfg.model}))
    try:
        classes = [import_class(p) for p in wrap]
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        key = "wrap" if cfg.wrap is not None else "model.wrap"
        raise ConfigError(key, wrap, "import paths of nn.Module classes", why=f"{type(e).__name__}: {e}") from e
    try:
        with torch.device("meta"):
            net = build_model(cfg.model)
    except Exception as e:  # noqa: BLE001 - any failure of the user's factory is a config error
        cause = e.__cause__ or e
        raise ConfigError("model._target_", cfg.model.get("_target_"), "a factory that builds an nn.Module from "
                          "the model config's other keys", why=f"{type(cause).__name__}: {cause}") from e
    shape = shape_of(net, classes, ready_order(net, cfg.model))
    if not shape.numel:
        raise ConfigError("model", cfg.model.name, "a model with parameters", why="it has none")
    return shape, str(cfg.model.name)


def run(cfg: DictConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Validate a composed plan config and plan it; raises :class:`ConfigError` on bad input."""
    for key, accepted in (("units", tuple(UNITS)), ("format", ("table", "json"))):
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
    strategies = cfg.strategies
    if strategies is not None:
        strategies = [str(s) for s in (strategies if isinstance(strategies, ListConfig) else [strategies])]
    shape, model = _shape(cfg)
    return plan(shape, _world_sizes(cfg.world_size), Precision(cfg.precision.name, cfg.precision.param_dtype),
                cfg.offload.name, strategies,
                PlanKnobs(bucket_cap_bytes=int(float(cfg.bucket_cap_mb) * 2**20),
                          loss_scaling=cfg.precision.get("loss_scale") is not None), memory, model)


def task(cfg: DictConfig) -> None:
    """Hydra's task: plan and print (tables on stdout; with JSON, the notes on stderr)."""
    from rich.console import Console

    from zeroexp.plan.render import render_json, render_tables

    global _STARTED
    _STARTED = True
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    try:
        records, notes = run(cfg)
    except ConfigError as e:
        Console(stderr=True, highlight=False).print(f"[red]error:[/] {e}")
        sys.exit(2)
    if cfg.format == "json":
        print(render_json(records))
        for note in notes:
            print(f"not planned: {note}", file=sys.stderr)
    else:
        render_tables(records, notes, cfg.units, console)


def main() -> None:
    """``python -m zeroexp.plan``."""
    from zeroexp.hydra_app import run_hydra_app

    register()
    run_hydra_app("plan", task, lambda: _STARTED)
