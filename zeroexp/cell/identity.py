"""A cell's identity: which axes apply to its strategy, its name, and its hash.

Two configs with the same identity are the same cell: a sweep runs it once. Axes that do not apply to the
strategy (``prefetch`` for ``ddp``) are not part of the identity, nor are logging and timeout knobs, nor the
``strategy.*`` keys its schema lacks (set in a sweep for other strategies) or marks as derived (``layout``).
The optional axes are the strategy's (its schema's ``axes``, zeroexp.cell.strategy): a top-level group
(``prefetch``) or one of its own keys (deepspeed's ``strategy.stage``, named ``stage<N>``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from omegaconf import DictConfig, OmegaConf

from zeroexp.cell.strategy import SCHEMAS, identity_keys, identity_when_set, schema_keys

__all__ = ["cell_axes", "cell_identity", "cell_id", "cell_name", "strategy_label", "init_of"]

_IDENTITY_KEYS = ("model", "strategy", "precision", "offload", "optimizer", "world_size", "steps",
                  "batch_size", "seed", "warmup_steps", "device")


def _schema(cfg: DictConfig) -> Any:
    """The strategy's schema (zeroexp.cell.strategy; torch-free: a cell is named before anything is built)."""
    return SCHEMAS.get(cfg.strategy.name)


def _own_keys(cfg: DictConfig) -> frozenset[str]:
    schema = _schema(cfg)
    return frozenset(schema_keys(schema)) if schema is not None else frozenset()


def _applicable(cfg: DictConfig) -> tuple[str, ...]:
    """The strategy's optional axes: top-level groups first, then its own keys (each group sorted)."""
    schema = _schema(cfg)
    axes, own = (schema.axes if schema is not None else frozenset()), _own_keys(cfg)
    return (*sorted(a for a in axes if a not in own), *sorted(a for a in axes if a in own))


def _axis_value(cfg: DictConfig, axis: str) -> Any:
    # a required key left unset (strategy.shard_size=???) reads None here: validate() refuses it, naming the key
    return OmegaConf.select(cfg.strategy, axis) if axis in _own_keys(cfg) else cfg[axis].name


def _axis_label(cfg: DictConfig, axis: str, value: Any) -> str:
    """In a cell name: a group's value (``pre``), a strategy key with its value (``stage2``)."""
    return f"{axis}{value}" if axis in _own_keys(cfg) else str(value)


def _strategy_identity(cfg: DictConfig) -> dict[str, Any]:
    """The resolved strategy node without keys its schema lacks or marks derived (``layout``)."""
    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    schema = _schema(cfg)
    if schema is None:  # unknown strategy: validate() refuses it; keep its name unique meanwhile
        return {k: v for k, v in node.items() if k != "layout"}
    keep, when_set = set(identity_keys(schema)), identity_when_set(schema)
    return {k: v for k, v in node.items() if k in keep and not (k in when_set and v == when_set[k])}


def cell_axes(cfg: DictConfig) -> dict[str, Any]:
    """The axes that name this cell: model, strategy, the optional axes that apply, precision, offload, N."""
    axes: dict[str, Any] = {"model": cfg.model.name, "strategy": cfg.strategy.name}
    for a in _applicable(cfg):
        axes[a] = _axis_value(cfg, a)
    axes.update(precision=cfg.precision.name, offload=cfg.offload.name, world_size=int(cfg.world_size))
    if _checkpoint(cfg) != "none":  # measured after training; absent for none, so those ids are unchanged
        axes["checkpoint"] = _checkpoint(cfg)
    if _grad_accum(cfg) != 1:  # absent for 1 (every cell before the axis): those ids are unchanged
        axes["grad_accum"] = _grad_accum(cfg)
    if _checkpointing(cfg) != "none":  # likewise absent for none
        axes["activation_checkpointing"] = _checkpointing(cfg)
    if init_of(cfg) != "full":  # likewise absent for full (every cell before the axis)
        axes["init"] = init_of(cfg)
    return axes


def _checkpointing(cfg: DictConfig) -> str:
    """The option with its keys where they are not the defaults (``selective_layer-every2``; ``none`` when absent)."""
    from zeroexp.formulas.peak.checkpointing import checkpointing_of

    return checkpointing_of(cfg.get("activation_checkpointing")).label


def _grad_accum(cfg: DictConfig) -> int:
    return int(cfg.grad_accum)


def _checkpoint(cfg: DictConfig) -> str:
    return str(cfg.checkpoint.name) if cfg.get("checkpoint") is not None else "none"


def _load_from(cfg: DictConfig) -> str | None:
    """The checkpoint directory the cell starts from, absolute (``checkpoint.load_from``, or the one its
    ``checkpoint.source`` writes: zeroexp.cell.written); None when it starts from its seed."""
    from zeroexp.cell.written import load_dir

    return load_dir(cfg) if cfg.get("checkpoint") is not None else None


def cell_identity(cfg: DictConfig) -> dict[str, Any]:
    """Everything that determines what the cell computes and measures, resolved."""
    ident = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], DictConfig) else cfg[k]
             for k in _IDENTITY_KEYS if k != "strategy"}
    ident["strategy"] = _strategy_identity(cfg)
    if isinstance(ident.get("optimizer"), dict) and ident["optimizer"].get("impl") is None:
        ident["optimizer"].pop("impl", None)  # AdamW's path enters only when set: the ids of every other cell unchanged
    for a in _applicable(cfg):
        ident[a] = _axis_value(cfg, a)
    if cfg.get("dry_run"):  # a dry run is another cell than the real run of the same axes (absent: ids unchanged)
        ident["dry_run"] = True
    if _checkpoint(cfg) != "none":
        ident["checkpoint"] = _checkpoint(cfg)
    if _load_from(cfg) is not None:  # a cell that starts from a checkpoint (absent: every other id unchanged)
        ident["load_from"] = _load_from(cfg)
    if _grad_accum(cfg) != 1:
        ident["grad_accum"] = _grad_accum(cfg)
    if _checkpointing(cfg) != "none":
        ident["activation_checkpointing"] = _checkpointing(cfg)
    if init_of(cfg) != "full":
        ident["init"] = init_of(cfg)
    if OmegaConf.select(cfg, "allocator.expandable_segments"):  # absent when false: every other id unchanged
        ident["allocator"] = {"expandable_segments": True}
    return ident


def cell_id(cfg: DictConfig) -> str:
    """8 hex digits of the SHA-1 of the identity: equal for equal cells."""
    blob = json.dumps(cell_identity(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:8]


def strategy_label(cfg: DictConfig) -> str:
    """The strategy with its applicable axes, as a cell's name begins: ``deepspeed-stage3``, ``fsdp_full-pre``."""
    ax = cell_axes(cfg)
    return "-".join([ax["strategy"], *(_axis_label(cfg, a, ax[a]) for a in _applicable(cfg))])


def cell_name(cfg: DictConfig) -> str:
    """A readable, unique directory name, e.g. ``fsdp_full-pre_mlp_fp32_n4_1a2b3c4d``."""
    ax = cell_axes(cfg)
    strategy = strategy_label(cfg)
    parts = [strategy, ax["model"], ax["precision"]]
    if ax["offload"] != "none":
        parts.append(f"off-{ax['offload']}")
    if "checkpoint" in ax:
        parts.append(f"ckpt-{ax['checkpoint']}")
    if _load_from(cfg) is not None:
        parts.append("resumed")
    if "grad_accum" in ax:
        parts.append(f"ga{ax['grad_accum']}")
    if "activation_checkpointing" in ax:
        parts.append(f"ac-{ax['activation_checkpointing']}")
    if "init" in ax:
        parts.append(f"init-{ax['init']}")
    parts += [f"n{ax['world_size']}", *(["dry"] if cfg.get("dry_run") else []), cell_id(cfg)]
    return "_".join(parts)


def init_of(cfg: Any) -> str:
    """The cell's ``init`` (conf/init/): ``full`` or ``meta``; a config from before the axis:
    full."""
    node = cfg.get("init")
    return str(node.name) if node is not None else "full"
