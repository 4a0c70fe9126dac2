"""``recommend``: the search's answer as the contract of ``python -m zeroexp.recommend format=json``
(docs/results.md), with the nearest changes when nothing fits."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from zeroexp.formulas.peak.checkpointing import FULL
from zeroexp.recommend.answer import command, label, mark_ties, notes_of, picture_fields, recommendation
from zeroexp.recommend.search import Evaluator, Problem, search
from zeroexp.recommend.space import Axes, run_overrides

__all__ = ["recommend", "MORE_GPUS"]

#: The world sizes tried as a change when nothing fits: N times each.
MORE_GPUS = (2, 4, 8)


def recommend(problem: Problem, axes: Axes, top_k: int, tie: float, model_overrides: list[str],
              ranks_per_node: int | None, problem_at: Callable[[int], Problem] | None = None) -> dict[str, Any]:
    """The answer (docs/results.md): ``recommendations`` (the ``top_k`` fastest that fit, ranked, ties within
    ``tie`` marked), ``searched``, ``timed``, ``judged``, ``fastest`` (fitting or not), and when none fits
    ``nearest_changes``: for each change the search's axes leave out (activation checkpointing, offload, a smaller
    micro-batch) and for more GPUs (``problem_at(N')``, the global batch kept), the fastest configuration it makes
    fit, its cost in step time against the fastest configuration."""
    ev = Evaluator(problem)
    result = search(problem, axes, top_k, ev)
    records = [recommendation(ev, s, model_overrides, ranks_per_node) for s in result.fitting]
    mark_ties(records, tie)
    fastest = result.fastest
    answer: dict[str, Any] = {
        "world_size": problem.world_size, "device_memory_bytes": problem.memory, "headroom": problem.headroom,
        "budget_bytes": problem.budget, "searched": result.searched, "timed": result.timed,
        "judged": result.judged,
        "tie_tolerance": tie, "recommendations": records,
        "fastest": None if fastest is None else {"config": label(fastest.config), "step_ms": fastest.step_ms},
        "nearest_changes": None, "notes": [],
    }
    if not records and fastest is not None:
        changes = nearest_changes(problem, axes, fastest.step_ms, model_overrides, ranks_per_node, problem_at, ev)
        for count in ("searched", "timed"):
            answer[count] += sum(ch.pop(count) for ch in changes)
        answer["nearest_changes"] = [ch for ch in changes if ch.pop("fits")]
    return answer


def nearest_changes(problem: Problem, axes: Axes, fastest_ms: float, model_overrides: list[str],
                    ranks_per_node: int | None, problem_at: Callable[[int], Problem] | None,
                    evaluator: Evaluator | None = None) -> list[dict[str, Any]]:
    """The changes that make a configuration fit, one at a time, then all of the axes' together, then more GPUs
    with the axes as given (2, 4, 8 x N, the global batch kept, until one fits): each the fastest configuration it
    makes fit. ``evaluator``: ``problem``'s (its figures computed once for every change at this world size; the
    search's, when given)."""
    ev = evaluator or Evaluator(problem)
    opened = {}
    if FULL not in axes.checkpointing:
        opened["activation_checkpointing=full"] = {"checkpointing": axes.checkpointing + (FULL,)}
    more = tuple(o for o in ("optimizer", "full") if o not in axes.offloads)
    if more:
        opened[f"offload={'|'.join(more)}"] = {"offloads": axes.offloads + more}
    if axes.micro_batches is not None and 1 not in axes.micro_batches:
        opened["a smaller micro-batch (batch_size=1 ...)"] = {"micro_batches": None}
    changes = []
    for what, change in opened.items():
        changes += _fits(what, problem, axes.relaxed(**change), fastest_ms, model_overrides, ranks_per_node, ev)
    every = {k: v for change in opened.values() for k, v in change.items()}
    if len(opened) > 1 and not any(ch["fits"] for ch in changes):
        changes += _fits(" and ".join(opened), problem, axes.relaxed(**every), fastest_ms, model_overrides,
                         ranks_per_node, ev)
    if problem_at is not None:
        for times in MORE_GPUS:
            n = problem.world_size * times
            global_batch = axes.samples * problem.world_size
            if global_batch % n:
                break
            found = _fits(f"more GPUs: world_size={n}", problem_at(n), axes.relaxed(samples=global_batch // n),
                          fastest_ms, model_overrides, ranks_per_node)
            changes += found
            if found[0]["fits"]:
                break
    return changes


def _fits(what: str, problem: Problem, axes: Axes, fastest_ms: float, model_overrides: list[str],
          ranks_per_node: int | None, evaluator: Evaluator | None = None) -> list[dict[str, Any]]:
    """The fastest configuration of ``axes`` that fits, as a change with ``fits`` true; a change that makes nothing
    fit as ``fits`` false (left out of the answer, its configurations still counted as searched). ``evaluator``:
    ``problem``'s, shared across changes (None: a fresh one)."""
    result = search(problem, axes, 1, evaluator)
    if not result.fitting:
        return [{"change": what, "fits": False, "searched": result.searched, "timed": result.timed}]
    s = result.fitting[0]
    overrides = run_overrides(s.config, model_overrides, problem.world_size)
    return [{"change": what, "fits": True, "config": label(s.config), "overrides": overrides,
             "peak_bytes": s.peak.get("peak_bytes"), "fits_bytes": s.peak.get("fits_bytes"),
             "fits_on": s.peak.get("fits_on"), "step_ms": s.step_ms, "cost_ms": s.step_ms - fastest_ms,
             "command": command(overrides, problem.world_size, ranks_per_node),
             "notes": notes_of(s.config, s.step) + ([s.peak["peak_note"]] if s.peak.get("peak_note") else []),
             "reserved_peak_bytes": s.peak.get("reserved_peak_bytes"), "nccl_bytes": s.peak.get("nccl_bytes"),
             "context_bytes": s.peak.get("context_bytes"), "peak_phase": s.peak.get("peak_phase"),
             "peak_note": s.peak.get("peak_note"), "comm_ms": 1e3 * s.step.comm_s,
             "exposed_comm_ms": 1e3 * s.step.exposed_comm_s, **picture_fields(problem, s),
             "searched": result.searched, "timed": result.timed}]


def with_world_size(problem: Problem, n: int) -> Problem:
    """The same problem at ``n`` ranks (the network presets and calibrations time any N)."""
    return replace(problem, world_size=n)
