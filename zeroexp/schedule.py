"""Which training steps each measurement owns, so that no measurement pollutes another.

Steps ``[0, warmup)`` are warm-up (DDP rebuilds its buckets, FSDP lazily initialises, Adam creates its
moments). The rest is assembled from what each registered probe declares (``Probe.steps``, a
``zeroexp.probes.base.Steps``, in ``zeroexp.probes.registry`` order): first the windows of a configured length (the collectives probe's profiled
steps, ``probes.profile_steps``, then the memory probe's tracked steps, ``probes.memory_steps``), then the
steps left over (the timing probe's timed steps). A probe may instead read at the first step after warm-up
without owning it (the state probe, at the optimizer boundary, after that step's time has been taken).
Nothing is timed on a step where another probe ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

__all__ = ["Schedule"]


def _select(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


@dataclass(frozen=True)
class Schedule:
    """The steps of one cell: ``steps`` in all, ``warmup`` first, then each probe's ``Steps`` with its
    resolved length (``needs``). Each window is an attribute: ``schedule.profiled``, ``schedule.timed``, ..."""

    steps: int
    warmup: int
    needs: tuple[tuple[Any, int], ...]  # (zeroexp.probes.base.Steps, its length)

    @classmethod
    def from_cfg(cls, cfg: Any, probes: Iterable[Any] | None = None) -> "Schedule":
        """The schedule of ``cfg`` assembled from ``probes`` (default: every registered probe)."""
        if probes is None:
            from zeroexp.probes import registry

            probes = registry()
        needs = tuple((p.steps, int(_select(cfg, p.steps.key)) if p.steps.key else 0)
                      for p in probes if getattr(p, "steps", None) is not None)
        return cls(steps=int(cfg.steps), warmup=int(cfg.warmup_steps), needs=needs)

    @cached_property
    def windows(self) -> dict[str, Any]:
        """Each declared window by name: a ``range`` of steps, or the step (``first``)."""
        out: dict[str, Any] = {}
        start = self.warmup
        for need, n in self.needs:
            if need.kind == "window":
                out[need.window] = range(start, start + n)
                start += n
        for need, _ in self.needs:
            if need.kind == "rest":
                out[need.window] = range(start, self.steps)
            elif need.kind == "first":
                out[need.window] = self.warmup
        return out

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("steps", "warmup", "needs"):
            raise AttributeError(name)
        try:
            return self.windows[name]
        except KeyError:
            raise AttributeError(f"no probe declares the steps {name!r}") from None

    def problems(self) -> list[str]:
        """Why this schedule cannot run, as messages naming the keys (empty when fine)."""
        keyed = [(need, n) for need, n in self.needs if need.kind == "window"]
        if any(n < need.at_least for need, n in keyed):
            least = max(need.at_least for need, _ in keyed)
            return [" and ".join(str(need.key) for need, _ in keyed) + f" must be >= {least}"]
        windows = self.windows
        for need, _ in self.needs:
            if need.kind == "rest" and len(windows[need.window]) < need.at_least:
                used = sum(n for _, n in keyed)
                sizes = "".join(f", {need.key}={n}" for need, n in keyed)
                return [f"steps={self.steps} leaves fewer than {need.at_least} {need.window} steps after "
                        f"warmup_steps={self.warmup}{sizes}; use steps >= {self.warmup + used + need.at_least}"]
        return []
