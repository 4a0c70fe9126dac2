"""Which training steps each measurement owns, so that no measurement pollutes another.

Steps ``[0, warmup)`` are warm-up (DDP rebuilds its buckets, FSDP lazily initialises, Adam creates its
moments). The rest is assembled from what each registered probe declares (``Probe.steps``, a :class:`Steps`, in
``zeroexp.probes.registry`` order; :data:`PROBE_STEPS` below): first the windows of a configured length (the collectives
probe's profiled steps, ``probes.profile_steps``, then the memory probe's tracked steps, ``probes.memory_steps``), then
the steps left over (the timing probe's timed steps). A probe may instead read at the first step after warm-up
without owning it (the state probe, at the optimizer boundary, after that step's time has been taken).
Nothing is timed on a step where another probe ran.

A cell with too few ``steps`` for every window still runs (any ``steps >= 1``): the windows are placed in the same
order while they fit; a window that does not fit is empty and named in ``Schedule.skipped`` with the reason, and its
probe's section reads ``check: n/a`` (``zeroexp.rank.worker.finalize``). Where every window fits, the steps are
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable

__all__ = ["Schedule", "Steps", "PROBE_STEPS"]

#: Windows that cannot span the K micro-batches of ``grad_accum=K`` (one optimizer step), and why: their probe's
#: check reads n/a in such a cell. None today: the memory probe tracks every micro-batch of an optimizer step (it resets
#: MemTracker's module state between micro-batches, zeroexp.probes.memory).
SINGLE_MICRO_BATCH: dict[str, str] = {}


@dataclass(frozen=True)
class Steps:
    """The steps a probe needs, named ``window`` on the schedule (``schedule.<window>``).

    ``kind``: ``window`` (``key`` names the config key that gives how many consecutive steps; placed after
    warm-up and the windows of earlier probes), ``rest`` (every step after the windows, at least ``at_least``)
    or ``first`` (the first step after warm-up, an int, shared: the probe only reads there).
    """

    window: str
    kind: str = "window"
    key: str | None = None
    at_least: int = 1


#: ``Probe.name`` -> its :class:`Steps`, for each registered probe that needs steps, in ``zeroexp.probes.REGISTRY``
#: order. Declared here, and each probe class takes its own (``steps = PROBE_STEPS["<its name>"]``), so that the
#: launching process validates a cell's schedule without importing the probes: they are Lightning callbacks, and
#: Lightning's import (5 to 7 s on this 2-core host) was the launching process's longest step before its first rank,
#: beside the forkserver importing it for the ranks. tests/test_architecture.py: every registered probe's ``steps``
#: is its entry, in order. A probe outside the registry (a plug-in) declares its own :class:`Steps`.
PROBE_STEPS: dict[str, Steps] = {
    "state": Steps("state_step", kind="first"),  # reads at the first step after warm-up
    "collectives": Steps("profiled", key="probes.profile_steps"),
    "memory": Steps("memory_tracked", key="probes.memory_steps"),
    "timing": Steps("timed", kind="rest", at_least=2),  # every step after the others' windows
}


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
    needs: tuple[tuple[Steps, int], ...]  # (a probe's Steps, its length)
    grad_accum: int = 1  # micro-batches per step: a window in SINGLE_MICRO_BATCH is skipped when above 1

    @classmethod
    def from_cfg(cls, cfg: Any, probes: Iterable[Any] | None = None) -> "Schedule":
        """The schedule of ``cfg`` assembled from ``probes`` (default: every registered probe's, from
        :data:`PROBE_STEPS`, without importing the probes)."""
        if probes is None:
            declared = list(PROBE_STEPS.values())
        else:
            declared = [p.steps for p in probes if getattr(p, "steps", None) is not None]
        needs = tuple((s, int(_select(cfg, s.key)) if s.key else 0) for s in declared)
        steps, warmup = int(cfg.steps), int(cfg.warmup_steps)
        if cfg.get("dry_run"):  # a dry run plays warm-up and its probes' windows only: ``steps`` does not limit it
            steps = max(steps, warmup + sum(n for s, n in needs if s.kind == "window")
                        + max([s.at_least for s, _ in needs if s.kind == "rest"] or [0]))
        return cls(steps=steps, warmup=warmup, needs=needs, grad_accum=int(cfg.grad_accum))

    @cached_property
    def windows(self) -> dict[str, Any]:
        """Each declared window by name: a ``range`` of steps, or the step (``first``). A window that does not fit
        in ``steps`` is empty (``range(0)``; ``None`` for ``first``) and named in :attr:`skipped`; the windows
        that fit keep the steps they have when every window fits."""
        return self._assemble()[0]

    @cached_property
    def skipped(self) -> dict[str, str]:
        """``{window: reason}`` for each window that does not fit in ``steps`` (its probe's check reads n/a)."""
        return self._assemble()[1]

    def _assemble(self) -> tuple[dict[str, Any], dict[str, str]]:
        out: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        keyed = [(need, n) for need, n in self.needs if need.kind == "window"]
        rest = max([need.at_least for need, _ in self.needs if need.kind == "rest"] or [0])
        every = self.warmup + sum(n for _, n in keyed) + rest  # the fewest steps in which every probe fits
        have = f"steps={self.steps}, warmup_steps={self.warmup}; all probes fit in steps >= {every}"
        start = self.warmup
        for need, n in keyed:
            if self.grad_accum > 1 and need.window in SINGLE_MICRO_BATCH:
                out[need.window] = range(0)
                skipped[need.window] = SINGLE_MICRO_BATCH[need.window]
            elif start + n <= self.steps:
                out[need.window] = range(start, start + n)
                start += n
            else:
                out[need.window] = range(0)
                skipped[need.window] = f"too few steps: {need.key}={n} needs steps {start}-{start + n - 1} ({have})"
        for need, _ in self.needs:
            if need.kind == "rest":
                window = range(start, self.steps)
                if len(window) >= need.at_least:
                    out[need.window] = window
                else:
                    out[need.window] = range(0)
                    skipped[need.window] = (f"too few steps: fewer than {need.at_least} {need.window} steps left "
                                            f"after warm-up and the other probes' steps ({have})")
            elif need.kind == "first":
                if self.warmup < self.steps:
                    out[need.window] = self.warmup
                else:
                    out[need.window] = None
                    skipped[need.window] = f"too few steps: it reads step {self.warmup}, after warm-up ({have})"
        return out, skipped

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("steps", "warmup", "needs", "grad_accum", "windows", "skipped"):
            raise AttributeError(name)
        try:
            return self.windows[name]
        except KeyError:
            raise AttributeError(f"no probe declares the steps {name!r}") from None

    def problems(self) -> list[str]:
        """Why this schedule cannot run, as messages naming the keys (empty when fine): a window shorter than its
        probe needs. Too few ``steps`` is no problem: the windows that do not fit are :attr:`skipped`."""
        keyed = [(need, n) for need, n in self.needs if need.kind == "window"]
        if any(n < need.at_least for need, n in keyed):
            least = max(need.at_least for need, _ in keyed)
            return [" and ".join(str(need.key) for need, _ in keyed) + f" must be >= {least}"]
        return []
