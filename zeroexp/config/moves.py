"""``checkpoint.load_from``: a cell whose training starts from a kept checkpoint, checked before launch.

The checkpoint may have been written by another strategy, at another world size, micro-batch count or precision: its
state moves wherever the writing and the loading strategy write and read its kind in torch's state-dict layout
(``StrategyAdapter.moved_kinds``: DDP, FSDP1, FSDP2 and their hybrids both kinds, torch.distributed.checkpoint
resharding a sharded one to the loading strategy's shards, zeroexp's ZeRO-1/2 both kinds too; DeepSpeed at every stage
and ZeroRedundancyOptimizer the full one). Refused by name,
before any rank starts: a directory that is not a whole zeroexp checkpoint (unfinished, a file missing, truncated or
altered: zeroexp.cell.source), one that records no cell, a dry run, a kind either strategy keeps in a layout of its
own (ZeroRedundancyOptimizer's per-owner files, DeepSpeed's sharded partitions), and a
model or optimizer other than the checkpoint's (the state would not fit it, or AdamW would resume other
hyper-parameters than the cell's).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from pathlib import Path

from zeroexp.cell.source import CELL_KEYS, CheckpointError, Source
from zeroexp.cell.written import ACCEPTED as SOURCE_ACCEPTED
from zeroexp.cell.written import load_dir, parse_source, source_pending
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
    spec = parse_source(cfg.checkpoint.get("source"))
    key = "checkpoint.load_from" if spec is None else "checkpoint.source"
    where = cfg.checkpoint.load_from if spec is None else spec.text
    if spec is not None and cfg.checkpoint.load_from is not None:
        raise ConfigError("checkpoint.source", where, "null when checkpoint.load_from is set",
                          why="a cell starts from one checkpoint: an existing one (load_from) or one its source "
                              "cell writes first (source)")
    if where is None:
        return None
    if cfg.dry_run:
        raise ConfigError(key, where, "null", why="a dry run holds no tensor values to load")
    from zeroexp.strategies import registered

    if spec is not None:
        if cfg.launcher.name != "local":
            raise ConfigError(key, where, "null with launcher=torchrun|slurm", why=(
                "the source cell is run by this process before the cell: on a cluster, run it first with "
                "checkpoint.keep=true and start from it with checkpoint.load_from=<its checkpoint>"))
        if source_pending(cfg):  # not written yet (zeroexp.launch.sources writes it first): its kind only
            source = None
            strategy, kind = spec.strategy, spec.kind
        else:
            source = _read(key, where, Path(str(load_dir(cfg))))
            strategy, kind = source.strategy, source.kind
    else:
        source = _read(key, where, Path(str(where)))
        strategy, kind = source.strategy, source.kind
    writer = registered().get(strategy)
    movable = movable_kinds()
    for whose, name, kinds in (("the checkpoint's", strategy, getattr(writer, "moved_kinds", ())),
                               ("the cell's", cfg.strategy.name, adapter.moved_kinds)):
        if kind not in kinds:
            held = (f"reads and writes {' and '.join(sorted(kinds))} checkpoints in torch's state-dict layout, not "
                    f"{kind} ones (write the source with checkpoint={'|'.join(sorted(kinds))})" if kinds else
                    "keeps its state in a layout of its own (its checkpoints restore in its own round trip)")
            readable = (source is not None and writer is not None and whose == "the checkpoint's"
                        and writer.unreadable(kind, Path(source.dir)) is None)
            convert = (f"; `python -m zeroexp.checkpoint convert {source.dir} {source.dir}_full` turns it into a "
                       "full one in that layout, which moves" if readable else "")
            raise InvalidCell(key, where, ACCEPTED if spec is None else SOURCE_ACCEPTED, why=(
                f"a {kind} checkpoint of {strategy}: {whose} strategy, {name}, {held}; the "
                f"strategies whose checkpoints move, by kind: {movable}{convert}"))
    if source is None:
        return None
    mine = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in CELL_KEYS}
    for part, free in (("model", MODEL_KEYS_FREE), ("optimizer", OPTIMIZER_KEYS_FREE)):
        theirs, ours = dict(source.cell[part]), dict(mine[part])
        differ = sorted(k for k in set(theirs) | set(ours) if k not in free and theirs.get(k) != ours.get(k))
        if differ:
            said = ", ".join(f"{part}.{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ[:4])
            raise InvalidCell(key, where, ACCEPTED if spec is None else SOURCE_ACCEPTED, why=(
                f"the checkpoint's cell trained another {part} ({said}): set the checkpoint's values"))
    return source


def movable_kinds() -> str:
    """The strategies whose checkpoints move, with their kinds (``ddp (full|sharded), ...``): what a refusal names."""
    from zeroexp.strategies import registered

    return ", ".join(f"{n} ({'|'.join(sorted(a.moved_kinds))})" for n, a in sorted(registered().items())
                     if a.moved_kinds)


def _read(key: str, where: Any, path: Path) -> Source:
    """The checkpoint at ``path``, every file checked, or the ConfigError naming ``key``."""
    try:
        return Source.read(path)
    except CheckpointError as e:
        raise ConfigError(key, where, ACCEPTED if key == "checkpoint.load_from" else SOURCE_ACCEPTED,
                          why=str(e)) from None
