"""``checkpoint.load_from``: a cell whose training starts from a kept checkpoint, checked before launch.

The checkpoint may have been written by another strategy, at another world size, micro-batch count or precision: its
state moves wherever the writing and the loading strategy write and read its kind in torch's state-dict layout
(``StrategyAdapter.moved_kinds``: DDP, FSDP1, FSDP2 and their hybrids both kinds, torch.distributed.checkpoint
resharding a sharded one to the loading strategy's shards; DeepSpeed at every stage, ZeroRedundancyOptimizer and
zeroexp's ZeRO-1/2 the full one). Refused by name,
before any rank starts: a directory that is not a whole zeroexp checkpoint (unfinished, a file missing, truncated or
altered: zeroexp.cell.source), one that records no cell, a dry run, a kind either strategy keeps in a layout of its
own (ZeroRedundancyOptimizer's per-owner files, DeepSpeed's sharded partitions; zeroexp's ZeRO-1/2 write no sharded
checkpoint), and a
model or optimizer other than the checkpoint's (the state would not fit it, or AdamW would resume other
hyper-parameters than the cell's).
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
    movable = ", ".join(f"{n} ({'|'.join(sorted(a.moved_kinds))})" for n, a in sorted(registered().items())
                        if a.moved_kinds)
    for whose, strategy, kinds in (("the checkpoint's", source.strategy, getattr(writer, "moved_kinds", ())),
                                   ("the cell's", cfg.strategy.name, adapter.moved_kinds)):
        if source.kind not in kinds:
            held = (f"reads and writes {' and '.join(sorted(kinds))} checkpoints in torch's state-dict layout, not "
                    f"{source.kind} ones (write the source with checkpoint={'|'.join(sorted(kinds))})" if kinds else
                    "keeps its state in a layout of its own (its checkpoints restore in its own round trip)")
            raise InvalidCell("checkpoint.load_from", where, ACCEPTED, why=(
                f"a {source.kind} checkpoint of {source.strategy}: {whose} strategy, {strategy}, {held}; the "
                f"strategies whose checkpoints move, by kind: {movable}"))
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
