"""A cell's identity: which axes apply to its strategy, its name, and its hash.

Two configs with the same identity are the same cell: a sweep runs it once. Axes that do not apply to the
strategy (``prefetch`` for ``ddp``) are not part of the identity, nor are logging and timeout knobs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["cell_axes", "cell_identity", "cell_id", "cell_name"]

#: Optional axes; each applies only to strategies whose adapter lists it in ``axes``. ``stage`` is a strategy
#: knob (``strategy.stage``, DeepSpeed's ZeRO stage) named like an axis: it is the cell's ``stage``.
OPTIONAL_AXES = ("prefetch", "stage")
_IDENTITY_KEYS = ("model", "strategy", "precision", "offload", "optimizer", "world_size", "steps",
                  "batch_size", "seed", "warmup_steps", "device")


def _applicable(cfg: DictConfig) -> tuple[str, ...]:
    from zeroexp.strategies import registered

    adapter = registered().get(cfg.strategy.name)
    axes = adapter.axes if adapter is not None else frozenset()
    return tuple(a for a in OPTIONAL_AXES if a in axes)


def _axis_value(cfg: DictConfig, axis: str) -> Any:
    return int(cfg.strategy.stage) if axis == "stage" else cfg[axis].name


def cell_axes(cfg: DictConfig) -> dict[str, Any]:
    """The axes that name this cell: model, strategy, the optional axes that apply, precision, offload, N."""
    axes: dict[str, Any] = {"model": cfg.model.name, "strategy": cfg.strategy.name}
    for a in _applicable(cfg):
        axes[a] = _axis_value(cfg, a)
    axes.update(precision=cfg.precision.name, offload=cfg.offload.name, world_size=int(cfg.world_size))
    if _checkpoint(cfg) != "none":  # measured after training; absent for none, so those ids are unchanged
        axes["checkpoint"] = _checkpoint(cfg)
    return axes


def _checkpoint(cfg: DictConfig) -> str:
    return str(cfg.checkpoint.name) if cfg.get("checkpoint") is not None else "none"


def cell_identity(cfg: DictConfig) -> dict[str, Any]:
    """Everything that determines what the cell computes and measures, resolved."""
    ident = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
             for k in _IDENTITY_KEYS}
    for a in _applicable(cfg):
        ident[a] = _axis_value(cfg, a)
    if cfg.get("dry_run"):  # a dry run is another cell than the real run of the same axes (absent: ids unchanged)
        ident["dry_run"] = True
    if _checkpoint(cfg) != "none":
        ident["checkpoint"] = _checkpoint(cfg)
    return ident


def cell_id(cfg: DictConfig) -> str:
    """8 hex digits of the SHA-1 of the identity: equal for equal cells."""
    blob = json.dumps(cell_identity(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:8]


def cell_name(cfg: DictConfig) -> str:
    """A readable, unique directory name, e.g. ``fsdp_full-pre_mlp_fp32_n4_1a2b3c4d``."""
    ax = cell_axes(cfg)
    strategy = "-".join([ax["strategy"], *(f"stage{ax[a]}" if a == "stage" else str(ax[a])
                                          for a in OPTIONAL_AXES if a in ax)])
    parts = [strategy, ax["model"], ax["precision"]]
    if ax["offload"] != "none":
        parts.append(f"off-{ax['offload']}")
    if "checkpoint" in ax:
        parts.append(f"ckpt-{ax['checkpoint']}")
    parts += [f"n{ax['world_size']}", *(["dry"] if cfg.get("dry_run") else []), cell_id(cfg)]
    return "_".join(parts)
