"""Which training steps each measurement owns, so that no measurement pollutes another.

Steps ``[0, warmup)`` are warm-up (DDP rebuilds its buckets, FSDP lazily initialises, Adam creates its
moments). Then come the steps the collectives probe profiles, then the steps the memory probe tracks; every
later step is timed. The state probe reads tensors at the optimizer boundary of the first step after warm-up,
after that step's time has been taken. Nothing is timed on a step where another probe ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    steps: int
    warmup: int
    profile_steps: int
    memory_steps: int

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Schedule":
        return cls(steps=int(cfg.steps), warmup=int(cfg.warmup_steps),
                   profile_steps=int(cfg.probes.profile_steps), memory_steps=int(cfg.probes.memory_steps))

    @property
    def state_step(self) -> int:
        """The step after whose optimizer step the state probe counts tensors."""
        return self.warmup

    @property
    def profiled(self) -> range:
        """Steps recorded by the collectives probe (torch profiler)."""
        return range(self.warmup, self.warmup + self.profile_steps)

    @property
    def memory_tracked(self) -> range:
        """Steps during which the memory probe tracks allocations (peak)."""
        start = self.profiled.stop
        return range(start, start + self.memory_steps)

    @property
    def timed(self) -> range:
        """Steps whose wall time enters the timing statistics."""
        return range(self.memory_tracked.stop, self.steps)

    def problems(self) -> list[str]:
        """Why this schedule cannot run, as messages naming the keys (empty when fine)."""
        if self.profile_steps < 1 or self.memory_steps < 1:
            return ["probes.profile_steps and probes.memory_steps must be >= 1"]
        if self.timed.stop - self.timed.start < 2:
            need = self.warmup + self.profile_steps + self.memory_steps + 2
            return [f"steps={self.steps} leaves fewer than 2 timed steps after warmup_steps={self.warmup}, "
                    f"probes.profile_steps={self.profile_steps}, probes.memory_steps={self.memory_steps}; "
                    f"use steps >= {need}"]
        return []
