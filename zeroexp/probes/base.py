"""The probe interface and the one result schema every probe writes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from zeroexp.schedule import Schedule


@dataclass(frozen=True)
class RunContext:
    """What a probe may know about the cell besides the model: config, rank, device, the adapter."""

    cfg: DictConfig
    rank: int
    world_size: int
    device: torch.device
    adapter: Any  # zeroexp.strategies.StrategyAdapter; typed loosely so probes do not import adapters
    schedule: Schedule


@dataclass
class ProbeReport:
    """A probe's contribution to the cell directory.

    ``section`` becomes ``summary.json[<probe name>]`` (omitted when empty); ``tables`` maps a file name in
    the cell directory to a pandas DataFrame with one row per rank (and per step or kind); ``top_level``
    holds the few fields that ``summary.json`` carries at its top level (``final_loss``).
    """

    section: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, Any] = field(default_factory=dict)


class Probe(pl.Callback):
    """Base class: a Lightning callback with a rank-local result and an all-rank aggregation."""

    name: ClassVar[str]

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def sync_device(self) -> None:
        """Wait for the rank's device (CUDA kernels are asynchronous) before reading a clock; no-op on CPU."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    def rank_result(self) -> dict[str, Any]:
        """This rank's records, JSON-able; written to ``.ranks/rank<r>.json`` under the probe's name."""
        raise NotImplementedError

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cfg: DictConfig) -> ProbeReport:
        """Combine the ``rank_result`` of every rank (index = rank) into the cell's report."""
        raise NotImplementedError
