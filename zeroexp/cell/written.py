"""``checkpoint.source``: a cell that starts from the checkpoint another cell writes first, named by that cell's
overrides (``"strategy=deepspeed strategy.stage=3 world_size=4"``), so that one sweep over sources and targets moves
every pair (``experiment=checkpoint_moves``).

The writing cell is the cell itself with the source's overrides applied (its strategy, world size and the other keys
:data:`SOURCE_KEYS` allows), ``checkpoint=<kind>`` (default ``full``: every strategy whose checkpoints move writes it)
and ``checkpoint.keep=true``; it trains the same model, optimizer, precision, data and steps. Its checkpoint lives in
``checkpoint.sources_dir`` under a directory named by the source and by what determines the checkpoint's tensors
(:func:`source_dir`: the model, optimizer, precision, batch, micro-batches, seed, steps and the writer's world size),
so that a sweep writes each source once and a later sweep of the same sources reuses them (zeroexp.launch.sources).
Torch-free: validation reads it before launch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroexp.errors import ConfigError

__all__ = ["SOURCE_KEYS", "KINDS", "SourceSpec", "parse_source", "source_dir", "source_pending", "load_dir"]

#: The keys a source may set otherwise than the cell that starts from it: what a checkpoint's writer may differ in
#: (its strategy and that strategy's own keys, its world size, the kind it writes, the precision and micro-batches
#: it trained in, the strategy's other axes). The model and the optimizer are the cell's: a move keeps them.
SOURCE_KEYS = ("strategy", "world_size", "checkpoint", "precision", "grad_accum", "prefetch", "offload", "init")
#: The kinds a source writes.
KINDS = ("full", "sharded")
#: What the cell's configuration contributes to the checkpoint's tensors (with the source's overrides).
_CONTENT_KEYS = ("model", "optimizer", "precision", "batch_size", "grad_accum", "seed", "steps")
ACCEPTED = ("null, or the overrides of the cell that writes the checkpoint first, space-separated, e.g. "
            "'strategy=deepspeed strategy.stage=3 world_size=4' (keys: strategy, strategy.<key>, "
            f"{', '.join(SOURCE_KEYS[1:])}; checkpoint={'|'.join(KINDS)}, default full)")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed ``checkpoint.source``: its overrides in their order (``key=value``), the writer's strategy, world size
    (None: the cell's) and kind."""

    overrides: tuple[str, ...]
    strategy: str
    world_size: int | None
    kind: str

    @property
    def text(self) -> str:
        return " ".join(self.overrides)

    @property
    def keys(self) -> frozenset[str]:
        """The top-level keys the source sets (``strategy.stage=3`` -> ``strategy``)."""
        return frozenset(o.split("=", 1)[0].split(".")[0] for o in self.overrides)


def parse_source(spec: Any) -> SourceSpec | None:
    """``checkpoint.source`` parsed; None when unset. A :class:`ConfigError` naming ``checkpoint.source`` for a token
    that is no ``key=value``, a key outside :data:`SOURCE_KEYS`, no ``strategy``, a world size that is no integer
    >= 1, or a kind outside :data:`KINDS`."""
    if spec is None:
        return None
    tokens = str(spec).split()
    found: dict[str, str] = {}
    for token in tokens:
        key, eq, value = token.partition("=")
        if not eq or not value or key.split(".")[0] not in SOURCE_KEYS or (key != "strategy" and "." in key
                                                                          and not key.startswith("strategy.")):
            raise ConfigError("checkpoint.source", spec, ACCEPTED, why=f"{token!r} is not one of these overrides")
        found[key] = value
    if "strategy" not in found:
        raise ConfigError("checkpoint.source", spec, ACCEPTED, why="it names no strategy=")
    n = found.get("world_size")
    if n is not None and not (n.isdigit() and int(n) >= 1):
        raise ConfigError("checkpoint.source", spec, ACCEPTED, why=f"world_size={n} is not an integer >= 1")
    kind = found.get("checkpoint", "full")
    if kind not in KINDS:
        raise ConfigError("checkpoint.source", spec, ACCEPTED, why=f"checkpoint={kind}: a source writes "
                          f"{' or '.join(KINDS)}")
    return SourceSpec(tuple(tokens), found["strategy"], None if n is None else int(n), kind)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def source_dir(cfg: Any) -> Path | None:
    """Where the checkpoint of ``cfg``'s ``checkpoint.source`` lives (absolute; None: no source):
    ``<checkpoint.sources_dir>/<the source, spelled>_<8 hex digits of what determines its tensors>``."""
    spec = parse_source(cfg.checkpoint.source)
    if spec is None:
        return None
    content = {k: _plain(cfg[k]) for k in _CONTENT_KEYS} | {"source": spec.overrides,
                                                            "world_size": spec.world_size or int(cfg.world_size)}
    digest = hashlib.sha1(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return Path(str(cfg.checkpoint.sources_dir)).expanduser().resolve() / f"{_spelled(spec)[:80]}_{digest}"


def _spelled(spec: SourceSpec) -> str:
    """``strategy=deepspeed strategy.stage=3 world_size=4`` -> ``deepspeed_stage3_n4``."""
    parts = []
    for token in spec.overrides:
        key, _, value = token.partition("=")
        parts.append(value if key == "strategy" else f"n{value}" if key == "world_size" else
                     f"{key.rsplit('.', 1)[-1]}{value}")
    return re.sub(r"[^A-Za-z0-9_]+", "-", "_".join(parts)).strip("-")


def source_pending(cfg: Any) -> bool:
    """Whether the cell's ``checkpoint.source`` has not written its checkpoint yet (a sweep's check of its jobs runs
    before a job writes it: zeroexp.launch.sources)."""
    from zeroexp.cell.source import META

    found = source_dir(cfg) if cfg.checkpoint.get("source") is not None else None
    return found is not None and not (found / "checkpoint" / META).is_file()


def load_dir(cfg: Any) -> str | None:
    """The checkpoint directory the cell starts from: ``checkpoint.load_from``, or its source's
    (:func:`source_dir` / ``checkpoint``); None when it starts from its seed."""
    where = cfg.checkpoint.get("load_from")
    if where is not None:
        return str(Path(str(where)).expanduser().resolve())
    found = source_dir(cfg) if cfg.checkpoint.get("source") is not None else None
    return None if found is None else str(found / "checkpoint")
