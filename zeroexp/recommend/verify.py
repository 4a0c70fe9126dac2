"""``recommend.verify``: the recommended configurations mapped to cells of this machine, and what their measurement
says of the ranking (docs/planner.md, Recommend; the JSON's ``verify``, docs/results.md).

Nothing here runs a cell (``zeroexp.cli.verify`` does): the mapping of a recommendation's overrides to this
machine's world size, the DDP baseline beside them, each cell's predicted and measured step time and peak read from
its ``summary.json``, and the pairs whose measured medians are separated beyond their 95 % CIs, the prediction's
order on them (``zeroexp.report.step_time.order_agreement``) and Kendall's tau over them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroexp.recommend.space import strategy_of

__all__ = ["map_overrides", "baseline", "cell_record", "combine_rounds", "pair_order", "MappingRefused"]


class MappingRefused(ValueError):
    """A configuration that has no cell at this world size (a hybrid shard size that does not divide it)."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def map_overrides(overrides: list[str], world_size: int, model: list[str] | None = None,
                  batch_size: int | None = None) -> list[str]:
    """A recommendation's ``python -m zeroexp`` overrides as a cell of this machine: ``world_size`` replaced by
    ``world_size``, the model's overrides by ``model`` (when given), ``batch_size`` (the micro-batch) by
    ``batch_size`` (when given); every other override kept. A hybrid ``strategy.shard_size`` that is not a divisor
    of ``world_size`` strictly between 1 and it raises :class:`MappingRefused`."""
    out = []
    for o in overrides:
        key = _key(o)
        if key == "world_size":
            o = f"world_size={world_size}"
        elif model is not None and (key == "model" or key.startswith("model.")):
            continue
        elif batch_size is not None and key == "batch_size":
            o = f"batch_size={batch_size}"
        elif key == "strategy.shard_size":
            s = int(o.split("=", 1)[1])
            if not (1 < s < world_size and world_size % s == 0):
                raise MappingRefused(f"{o}: no hybrid mesh of {world_size} ranks has it (a divisor strictly "
                                     "between 1 and the world size)")
        out.append(o)
    if model is not None:
        at = next((i for i, o in enumerate(out) if _key(o) == "world_size"), len(out))
        out[at:at] = list(model)
    return out


def baseline(overrides: list[str]) -> list[str]:
    """The DDP baseline beside a configuration: its overrides with DDP's strategy in place of its own (every
    ``strategy``/``prefetch`` key dropped but those DDP has too, ``strategy.bucket_cap_mb``; ``offload=none``), its
    model, world size, precision, checkpointing, micro-batch and grad_accum kept."""
    option, selects, keys = strategy_of("ddp")
    out = [f"strategy={option}", *(f"strategy.{k}={v}" for k, v in selects.items())]
    for o in overrides:
        key = _key(o)
        if key == "strategy" or key == "prefetch" or (key.startswith("strategy.") and (
                key.split(".", 1)[1] not in keys or key.split(".", 1)[1] in selects)):
            continue
        out.append("offload=none" if key == "offload" else o)
    return out


def _phase_peak(memory_plan: dict[str, Any], which: str) -> int | None:
    """The largest ``{which}_peak_bytes`` over the peak model's phases (``plan.memory.phases``): the predicted or
    the measured peak of the rank the model covers."""
    values = [p.get(f"{which}_peak_bytes") for p in (memory_plan.get("phases") or {}).values() if isinstance(p, dict)]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def cell_record(label: str, recommended: dict[str, Any] | None, overrides: list[str], cell_dir: Path | None,
                summary: dict[str, Any] | None, status: str, why: str | None = None) -> dict[str, Any]:
    """One cell of the verify: the recommendation's own prediction (``recommended``: its ``step_ms``, ``peak_bytes``
    on the user's problem; None for the baseline when no recommendation is it), and the cell's on this machine: its
    predicted step (``plan.time.predicted_step_ms``, computed on this machine's calibration) and measured median with
    its 95 % CI, its predicted peak (the peak model's, ``plan.memory``) and measured (``memory.peak_bytes_max``)."""
    plan = (summary or {}).get("plan") or {}
    t, m = plan.get("time") or {}, plan.get("memory") or {}
    memory = (summary or {}).get("memory") or {}
    return {
        "cell": label, "overrides": overrides, "dir": None if cell_dir is None else str(cell_dir), "status": status,
        "why": why,
        "recommended_step_ms": None if recommended is None else recommended.get("step_ms"),
        "recommended_peak_bytes": None if recommended is None else recommended.get("peak_bytes"),
        "predicted_step_ms": t.get("predicted_step_ms"), "measured_median_ms": t.get("measured_median_ms"),
        "median_ci95_ms": t.get("median_ci95_ms"), "time_check": t.get("check"),
        "predicted_peak_bytes": _phase_peak(m, "predicted"), "measured_peak_bytes": memory.get("peak_bytes_max"),
        "peak_check": m.get("check"),
    }


def combine_rounds(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's records of its rounds (:func:`cell_record`, one per run of the same overrides) as one: the first
    round's record (its directory, the predictions, the peaks), ok only when every round is ok (else the first round
    that is not, with its why), the measured median the median of the rounds' medians and ``median_ci95_ms`` the
    hull of their 95 % CIs: what :func:`pair_order` separates on, as a run of a cell on a shared host can land
    outside another run's CI. Each round's directory, status, median and CI in ``rounds``."""
    import statistics

    out = {**records[0], "rounds": [{k: r[k] for k in ("dir", "status", "measured_median_ms", "median_ci95_ms")}
                                    for r in records]}
    bad = next((r for r in records if r["status"] != "ok"), None)
    if bad is not None:
        out["status"], out["why"] = bad["status"], bad["why"]
        return out
    medians, cis = [r["measured_median_ms"] for r in records], [r["median_ci95_ms"] for r in records]
    if any(m is None for m in medians) or not all(cis):
        out["measured_median_ms"], out["median_ci95_ms"] = None, None
        return out
    out["measured_median_ms"] = statistics.median(medians)
    out["median_ci95_ms"] = [min(c[0] for c in cis), max(c[1] for c in cis)]
    return out


def pair_order(cells: list[dict[str, Any]], tie: float = 0.0) -> dict[str, Any]:
    """Over the cells with a predicted step, a measured median and its CI: the pairs whose measured CIs do not
    overlap (``pairs_separable``, as ``fast < slow``, ``zeroexp.report.step_time.order_agreement``); of those, the pairs
    whose predicted steps are within ``tie`` of each other (a fraction of the faster: the recommender's ties, closer
    than the model's own error; equal at 0) order neither way (``pairs_tied``), and the rest the prediction orders
    the other way (``pairs_flipped``); Kendall's tau over the separable pairs: (concordant - flipped) / separable, a
    tied pair counting 0; None when no pair is separable."""
    from zeroexp.report.step_time import order_agreement

    rows = [(c["cell"], c["measured_median_ms"], tuple(c["median_ci95_ms"]), c["predicted_step_ms"]) for c in cells
            if c.get("predicted_step_ms") is not None and c.get("measured_median_ms") is not None
            and c.get("median_ci95_ms")]
    agree, disagree = order_agreement(rows)
    predicted = {r[0]: r[3] for r in rows}

    def tied(pair: str) -> bool:
        a, b = (predicted[x] for x in pair.split(" < "))
        return abs(a - b) <= tie * min(a, b)
    separable = agree + disagree
    ties = [p for p in separable if tied(p)]
    flipped = [p for p in disagree if p not in ties]
    concordant = len(agree) - len([p for p in agree if p in ties])
    tau = None if not separable else (concordant - len(flipped)) / len(separable)
    return {"pairs_compared": len(rows) * (len(rows) - 1) // 2, "pairs_separable": sorted(separable),
            "pairs_tied": sorted(ties), "pairs_flipped": sorted(flipped), "tie_tolerance": tie, "kendall_tau": tau}
