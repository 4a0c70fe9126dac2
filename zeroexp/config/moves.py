"""``checkpoint.load_from``: a cell whose training starts from a kept checkpoint, checked before launch.

The checkpoint may have been written by another strategy, at another world size, micro-batch count or precision: its
state moves wherever the writing and the loading strategy share a layout (``StrategyAdapter.moved_layout``: torch's
state-dict API for DDP, FSDP1, FSDP2 and their hybrids, where torch.distributed.checkpoint reshards a sharded
checkpoint to the loading strategy's shards). Refused by name, before any rank starts: a directory that is not a
whole zeroexp checkpoint (unfinished, a file missing, truncated or altered: zeroexp.cell.source), one that records no
cell, a dry run, a strategy whose state has no shared layout yet (ZeroRedundancyOptimizer's per-owner state,
zeroexp's ZeRO-1/2 buckets, DeepSpeed's partitions), and a model or optimizer other than the checkpoint's (the state
would not fit it, or AdamW would resume other hyper-parameters than the cell's).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from zeroexp.cell.source import CELL_KEYS, CheckpointError, Source
from zeroexp.errors import ConfigError, InvalidCell

__all__ = ["check_load_from", "MODEL_KEYS_FREE", "OPTIMIZER_KEYS_FREE"]

#: Model keys a cell may set otherwise than the checkpoint's cell: they cut the model into units, they add no tensor.
MODEL_KEYS_FREE = ("wrap",)
#: Optimizer keys likewise: AdamW's path (single, foreach, fused) computes the same update from the same state.
OPTIMIZER_KEYS_FREE = ("impl",)
ACCEPTED = "null, or the directory of a checkpoint a zeroexp cell kept (checkpoint=full|sharded checkpoint.keep=true)"


def check_load_from(cfg: Any, adapter: Any) -> Source | None:
    """The checkpoint ``cfg`` starts from (None: none), every file checked, or the ConfigError that names why the cell
    cannot start from it (``adapter``: the cell's adapter class)."""
    where = cfg.checkpoint.load_from
    if where is None:
        return None
    if cfg.dry_run:
        raise ConfigError("checkpoint.load_from", where, "null", why="a dry run holds no tensor values to load")
    try:
        source = Source.read(where)
    except CheckpointError as e:
        raise ConfigError("checkpoint.load_from", where, ACCEPTED, why=str(e)) from None
    from zeroexp.strategies import registered

    writer = registered().get(source.strategy)
    ours, theirs = adapter.moved_layout, getattr(writer, "moved_layout", None)
    movable = sorted(n for n, a in registered().items() if a.moved_layout is not None)
    for whose, strategy, layout in (("the cell's", cfg.strategy.name, ours),
                                    ("the checkpoint's", source.strategy, theirs)):
        if layout is None:
            raise InvalidCell("checkpoint.load_from", where, ACCEPTED, why=(
                f"{whose} strategy, {strategy}, keeps its state in a layout no other strategy reads yet (its "
                f"checkpoints restore in its own round trip, checkpoint=full|sharded); the strategies whose "
                f"checkpoints move: {', '.join(movable)}"))
    if ours != theirs:
        raise InvalidCell("checkpoint.load_from", where, ACCEPTED, why=(
            f"written by {source.strategy} (layout {theirs}), read by {cfg.strategy.name} (layout {ours}): "
            "no layout in common"))
    mine = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in CELL_KEYS}
    for key, free in (("model", MODEL_KEYS_FREE), ("optimizer", OPTIMIZER_KEYS_FREE)):
        theirs, ours = dict(source.cell[key]), dict(mine[key])
        differ = sorted(k for k in set(theirs) | set(ours) if k not in free and theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(f"{key}.{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ[:4])
            raise InvalidCell("checkpoint.load_from", where, ACCEPTED, why=(
                f"the checkpoint's cell trained another {key} ({said}): set the checkpoint's values"))
    return source
