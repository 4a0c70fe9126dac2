"""The configurations a search walks: strategy x prefetch x precision x offload x activation checkpointing x
micro-batch / grad_accum x bucket size x hybrid shard size x DeepSpeed's overlap_comm (FSDP2's
``reshard_after_forward`` and FSDP's sharding are rows of their own), each an axis only where the row has the knob,
and the overrides that run each one.

Which strategy runs a row, and with which key, is read from the strategies' YAML files (``conf/strategy/*.yaml``:
``layout`` names the row, ``deepspeed_stage${.stage}`` through a key): nothing here names a strategy.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from zeroexp.cell.strategy import SCHEMAS
from zeroexp.config.checkpointing import overrides_of
from zeroexp.formulas.peak.checkpointing import Checkpointing
from zeroexp.formulas import LAYOUTS

__all__ = ["Config", "Axes", "configurations", "strategy_of", "run_overrides", "divisors", "CONF_DIR"]

#: The config groups, beside the package (as ``zeroexp.cli.hydra_app.CONF_DIR``, which this layer may not import).
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True, order=True)
class Config:
    """One configuration: a row of ``zeroexp.formulas.LAYOUTS`` and its axes. ``bucket_cap_mb``, ``prefetch`` and
    ``shard_size`` are None where the row has no such knob."""

    row: str
    precision: str
    offload: str
    checkpointing: Checkpointing
    micro_batch: int
    grad_accum: int
    bucket_cap_mb: float | None = None
    prefetch: str | None = None
    shard_size: int | None = None
    sync_each_microbatch: bool | None = None  # FSDP's and FSDP2's with grad_accum > 1; None elsewhere
    overlap_comm: bool | None = None  # DeepSpeed's stages 2-3 (Family.reads_overlap_comm); None elsewhere


@dataclass(frozen=True)
class Axes:
    """The values each axis may take (the search's space); ``rows`` the rows, ``samples`` per rank per step."""

    rows: tuple[str, ...]
    precisions: tuple[str, ...]
    offloads: tuple[str, ...]
    checkpointing: tuple[Checkpointing, ...]
    samples: int
    micro_batches: tuple[int, ...] | None  # None: every divisor of samples
    bucket_caps_mb: tuple[float, ...]
    prefetches: tuple[str, ...]
    shard_sizes: tuple[int, ...] | None  # None: every divisor of the world size strictly between 1 and it
    syncs: tuple[bool, ...] = (False, True)  # strategy.sync_each_microbatch where a row has it and grad_accum > 1
    overlaps: tuple[bool, ...] = (False, True)  # strategy.overlap_comm where a row reads it

    def relaxed(self, **changes: Any) -> "Axes":
        return replace(self, **changes)


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def reads_prefetch(row: str) -> bool:
    """Whether the row's backward prefetch is a knob: FSDP1 resharding after forward (the peak model and the step's
    slots read ``prefetch`` there; ``zeroexp.plan.check.memory``: ``prefetch if full_shard else "none"``)."""
    layout = LAYOUTS[row]
    return layout.family.follows_prefetch(layout)


def configurations(axes: Axes, world_size: int) -> Iterator[Config]:
    """Every configuration of ``axes`` a row runs at ``world_size``: its precisions and offloads, a bucket size
    where its strategy has ``bucket_cap_mb``, a prefetch where it reads one, a shard size where it is hybrid, and
    with more than one micro-batch ``strategy.sync_each_microbatch`` where the strategy has it, ``overlap_comm`` where
    the row reads it."""
    micro = [m for m in (axes.micro_batches or divisors(axes.samples)) if axes.samples % m == 0]
    shards = [s for s in (axes.shard_sizes or divisors(world_size)) if 1 < s < world_size and world_size % s == 0]
    for row in axes.rows:
        layout = LAYOUTS[row]
        strategy = strategy_of(row)
        if layout.reference or strategy is None or world_size < layout.min_world_size:
            continue
        buckets = axes.bucket_caps_mb if "bucket_cap_mb" in strategy[2] else (None,)
        prefetches = axes.prefetches if reads_prefetch(row) else (None,)
        sizes = shards if layout.hybrid else [None]
        syncs = axes.syncs if "sync_each_microbatch" in strategy[2] else (None,)
        overlaps = axes.overlaps if layout.family.reads_overlap_comm(layout) else (None,)
        for precision in axes.precisions:
            if precision not in layout.precisions:
                continue
            for offload in axes.offloads:
                if offload not in layout.offloads:
                    continue
                for ac in axes.checkpointing:
                    for m in micro:
                        k = axes.samples // m
                        for cap in buckets:
                            for pf in prefetches:
                                for s in sizes:
                                    for each in (syncs if k > 1 else (None,)):
                                        for oc in overlaps:
                                            yield Config(row, precision, offload, ac, m, k, cap, pf, s, each, oc)


@lru_cache(maxsize=None)
def _strategies() -> dict[str, tuple[str, dict[str, str], frozenset[str]]]:
    """Row -> (strategy option, the strategy keys that select the row, every key the strategy has), from
    ``conf/strategy/*.yaml`` and the strategy's schema (zeroexp.cell.strategy): a ``layout`` with ``${.key}`` in it
    selects the row whose name matches with the key set (``deepspeed_stage${.stage}``: ``deepspeed_stage3`` is
    ``strategy=deepspeed strategy.stage=3``)."""
    from omegaconf import OmegaConf

    found: dict[str, tuple[str, dict[str, str], frozenset[str]]] = {}
    for path in sorted((CONF_DIR / "strategy").glob("*.yaml")):
        node = OmegaConf.load(path)
        template = str(OmegaConf.to_container(node)["layout"])
        schema = SCHEMAS.get(path.stem)  # its keys: the schema's (defaults there, as bucket_cap_mb's) and the YAML's
        keys = frozenset(k for k in node if k != "defaults") | frozenset(
            f.name for f in (dataclasses.fields(schema) if schema is not None else ()))
        fields = re.findall(r"\$\{\.(\w+)\}", template)
        pattern = re.escape(template)
        for key in fields:
            pattern = pattern.replace(re.escape(f"${{.{key}}}"), f"(?P<{key}>.+)")
        for row in LAYOUTS:
            m = re.fullmatch(pattern, row)
            if m and (row not in found or not m.groupdict()):  # a plain layout wins over a template's match
                found[row] = (path.stem, m.groupdict(), keys)
    return found


def strategy_of(row: str) -> tuple[str, dict[str, str], frozenset[str]] | None:
    """The strategy option that runs ``row``, the keys that select it and its keys; None: no strategy runs it."""
    return _strategies().get(row)


def run_overrides(config: Config, model: list[str], world_size: int) -> list[str]:
    """The ``python -m zeroexp`` overrides that run ``config`` (``model``: the model's own overrides)."""
    strategy, selects, _ = strategy_of(config.row)
    out = [f"strategy={strategy}", *(f"strategy.{k}={v}" for k, v in selects.items()), *model,
           f"world_size={world_size}", f"precision={config.precision}", f"offload={config.offload}",
           *overrides_of(config.checkpointing), f"batch_size={config.micro_batch}", f"grad_accum={config.grad_accum}"]
    if config.bucket_cap_mb is not None:
        out.append(f"strategy.bucket_cap_mb={config.bucket_cap_mb:g}")
    if config.prefetch is not None:
        out.append(f"prefetch={config.prefetch}")
    if config.shard_size is not None:
        out.append(f"strategy.shard_size={config.shard_size}")
    if config.sync_each_microbatch is not None:
        out.append(f"strategy.sync_each_microbatch={str(config.sync_each_microbatch).lower()}")
    if config.overlap_comm is not None:
        out.append(f"strategy.overlap_comm={str(config.overlap_comm).lower()}")
    return out
