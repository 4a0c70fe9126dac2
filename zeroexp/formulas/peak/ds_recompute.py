"""DeepSpeed stage 3's backward hooks beside the traced step, a checkpointed unit's recompute among them: which unit
each hook is, what it holds, and the recompute's moments inside the backward segment it falls in
(:func:`zeroexp.formulas.peak.deepspeed.ds_stage3_phase_peaks`)."""

from __future__ import annotations

from typing import NamedTuple

from zeroexp.formulas.deepspeed_fetch import ModuleCall
from zeroexp.formulas.peak.phases import Segment, StepTrace

__all__ = ["Hook", "unit_calls", "recompute_moments"]

#: A recompute hook's ``at`` starts with it (its pre-forward fetch, its post-forward release inside backward).
REDO = "redo-"


class Hook(NamedTuple):
    """A backward hook of a unit under a schedule that gathers again or holds a flat buffer past forward (the first:
    forward's end, no unit's): the unit's ``name``, ``at`` (start: its pre-backward fetch; end: its post-backward
    release; :data:`REDO` before either: the hook of its forward run again in backward, a checkpointed unit's
    recompute), the bytes held ``after`` it and at its ``peak`` (parameters, temporaries: the flat buffers)."""

    name: str
    at: str
    after: dict[str, int]
    peak: dict[str, int]


def unit_calls(trace: StepTrace, calls: tuple[ModuleCall, ...]) -> dict[int, str]:
    """The traced units' names by the module of their first call (the calls of modules holding parameters, first of
    each module, in order, are the trace's units)."""
    firsts: list[ModuleCall] = []
    for c in calls:
        if c.params and all(f.module != c.module for f in firsts):
            firsts.append(c)
    if [set(c.params) for c in firsts] != [set(u.params) for u in trace.units]:
        raise ValueError("the step's module calls are not the trace's units")
    return {c.module: u.name for c, u in zip(firsts, trace.units)}


def recompute_moments(trace: StepTrace, hooks: list[Hook] | None
                      ) -> dict[int, tuple[list[tuple[Segment, Hook | None]], Segment]]:
    """By backward segment (its index among ``trace``'s backward segments): the recompute inside it, each of its
    stretches (``trace.recomputes``) with the recompute hook ending it (None: none of the schedule's), and the stretch
    after the recompute's last hook (the segment's own peak once its recompute is cut out). Empty without a
    schedule's hooks or a traced recompute."""
    if not hooks or not trace.recomputes:
        return {}
    backward = [s for s in trace.segments if s.phase == "backward"]
    redo = [h for h in hooks if h.at.startswith(REDO)]
    out, pending, seg, at = {}, [], 0, 0
    for r in trace.recomputes:
        if r.phase == "recompute":
            j = next((j for j in range(at, len(redo)) if (redo[j].name, redo[j].at) == (r.unit, REDO + r.at)), None)
            pending.append((r, None if j is None else redo[j]))
            at = at if j is None else j + 1
            continue
        seg = next(k for k in range(seg, len(backward)) if (backward[k].unit, backward[k].at) == (r.unit, r.at))
        out[seg], pending = (pending, r), []
    return out
