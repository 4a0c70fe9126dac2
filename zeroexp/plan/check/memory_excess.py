"""Memory above the plan, explained: a phase whose measured peak exceeds the peak model's, broken down at the peak's
moment into what the step made and kept alive there (the memory probe's ``born_at_peak_by_rank``: each storage with
the op that allocated it and the innermost module it was made in, CPU cells), beside the prediction's own terms for
the same moment (its bytes by category); the residual is named: of the categories measured above their prediction,
the storages made by the ops the step used least often in that category (the prediction's terms are kinds of
tensor the step makes per unit or layer, again and again), then the fewest storages, then the largest, until they
cover the excess; each with its op, its module and the known cause its category and op match. The choice of the
residual is a likelihood, not a proof: ``groups`` holds every candidate."""

from __future__ import annotations

from typing import Any, Mapping

from zeroexp.plan.check.judge import ABS_TOLERANCE

__all__ = ["explain_excess", "excess_sentence", "KNOWN_CAUSES"]

#: Known causes of memory above a plan, by the category a storage is counted in (and, for copies, its op): what the
#: category means at a peak the model did not predict. Issues seen in the field: pytorch#151030 (HSDP), accelerate#3844
#: (an upcast of a LoRA module), DeepSpeed#5305, torchtitan#735.
KNOWN_CAUSES = {
    "unsharded": "a unit held gathered beyond the plan: a prefetch deeper than planned, or a root left unsharded",
    "gradients": "a gradient held beyond the plan: a unit's gradient kept under no_sync, or freed late",
    "comm": "a collective's buffer held beyond the plan: a late free on a side stream or by gloo's worker thread",
    "optimizer_state": "optimizer state made in the step beyond the plan",
    "upcast": "an upcast copy kept alive (a module's output or parameters cast to a wider dtype)",
    "copy": "a copy kept alive outside the step's own tensors (a hook's or a cache's)",
}
_UPCASTS = ("aten::_to_copy", "aten::to", "aten::type_as", "aten::double", "aten::float")
_COPIES = ("aten::clone", "aten::copy", "aten::detach_copy")


def _cause(group: Mapping[str, Any]) -> tuple[str, str]:
    """``(code, sentence)``: the known cause a group's op or category matches (a key of :data:`KNOWN_CAUSES`), else
    ``unexpected``."""
    op, category = group["op"], group["category"]
    if op in _UPCASTS:
        return "upcast", KNOWN_CAUSES["upcast"]
    if category in KNOWN_CAUSES:
        return category, KNOWN_CAUSES[category]
    if op in _COPIES:
        return "copy", KNOWN_CAUSES["copy"]
    return "unexpected", f"not in the prediction: {category} made by {op} in {group['module']}"


def explain_excess(record: Mapping[str, Any], born: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """For a phase ``record`` of plan.memory (``predicted_by_category``, ``measured_by_category`` above steady) and
    that rank's ``born_at_peak`` of the phase: ``excess_by_category`` (each category measured above its prediction,
    bytes), ``residual`` (the module doc's choice: ``category``, ``op``, ``module``, ``count``, ``bytes``, ``cause``
    (a code: ``upcast``, ``copy``, a category of :data:`KNOWN_CAUSES`, ``unexpected``) and ``why``),
    ``groups`` (every group of those categories alive at the peak), ``by_module`` (what the step made alive at the
    peak, by module); None without a measurement of the storages (a CUDA cell: the allocator keeps no per-tensor record
    here)."""
    if not born:
        return None
    predicted, measured = record.get("predicted_by_category") or {}, record.get("measured_by_category") or {}
    excess = {c: int(measured.get(c, 0)) - int(predicted.get(c, 0)) for c in {*predicted, *measured}}
    excess = {c: b for c, b in sorted(excess.items(), key=lambda kv: -kv[1]) if b > 0}
    groups = [g for g in born.get("groups", []) if g["category"] in excess]
    # a scalar (the loss, a step count) is within the judge's band: never the residual's
    candidates = [g for g in groups if g["bytes"] > ABS_TOLERANCE]
    often: dict[tuple[str, str], int] = {}  # how many storages of a category the step made by each op
    for g in candidates:
        often[g["category"], g["op"]] = often.get((g["category"], g["op"]), 0) + g["count"]
    residual, left = [], dict(excess)
    for g in sorted(candidates, key=lambda g: (often[g["category"], g["op"]], g["count"], -g["bytes"])):
        if left[g["category"]] > 0:  # until the excess is covered (the last may be larger than what is left)
            code, why = _cause(g)
            residual.append({**g, "cause": code, "why": why})
            left[g["category"]] -= g["bytes"]
    return {"excess_by_category": excess, "residual": residual, "groups": groups,
            "by_module": dict(born.get("by_module", {}))}


def excess_sentence(explained: Mapping[str, Any]) -> str:
    """The residual in words: its first group (the rarest op's), its op, module and cause."""
    if not explained.get("residual"):
        return "above the plan: no storage the step made is alive at the peak in the categories above their prediction"
    s = explained["residual"][0]
    return (f"above the plan: {s['bytes']} B of {s['category']} made by {s['op']} in {s['module']}"
            + (f" ({s['count']} tensors)" if s["count"] > 1 else "") + f" ({s['why']})"
            + (f", and {len(explained['residual']) - 1} more" if len(explained["residual"]) > 1 else ""))
