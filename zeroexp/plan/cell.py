"""``summary.json["plan"]``: the planner's per-rank prediction for a cell that ran, beside what it measured.

Rank 0 calls :func:`plan_section` in ``zeroexp.worker.finalize`` after the probes' sections are written: the
prediction uses the cell's own model (built again on the meta device), N, precision, offload and strategy
settings; the measurement is the state probe's ``rank_state.csv`` and the collectives probe's payloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroexp.formulas import STATE_KINDS, PlanKnobs, rank_state_bytes
from zeroexp.plan.core import Precision, plan_record, strategy_table
from zeroexp.plan.shape import model_shape

__all__ = ["plan_section", "knobs_of", "row_of"]

#: What a measured kind the planner leaves out of the model state is, when it is explained.
RESIDUALS = {"optim_scalar": "Adam's 4-byte step scalar per optimizer tensor"}


def knobs_of(cfg: Any) -> PlanKnobs:
    """The byte-relevant strategy settings of a cell config (absent keys take the defaults)."""
    s, default = cfg.strategy, PlanKnobs()
    cap = s.get("bucket_cap_mb")
    return PlanKnobs(
        bucket_cap_bytes=default.bucket_cap_bytes if cap is None else int(float(cap) * 2**20),
        reduce=str(s.get("reduce") or default.reduce),
        norm_allreduce=s.get("clip_grad_norm") is not None or cfg.precision.get("loss_scale") is not None,
        use_orig_params=bool(s.get("use_orig_params", False)),
        loss_scaling=cfg.precision.get("loss_scale") is not None,
    )


def row_of(cfg: Any) -> str:
    """The planner's row for a cell: the strategy's own (``strategy.name``), else, for a strategy whose ZeRO stage is
    a knob (``strategy.stage``, e.g. ``deepspeed``), the row ``<name>_stage<k>`` (``deepspeed_stage2``)."""
    name, stage = str(cfg.strategy.name), cfg.strategy.get("stage")
    table = strategy_table()
    if name not in table and stage is not None and f"{name}_stage{int(stage)}" in table:
        return f"{name}_stage{int(stage)}"
    return name


def plan_section(cfg: Any, cell: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured bytes per state kind (largest rank, physical) and per rank (logical and physical),
    and the payload per collective; ``check`` PASS when every state kind matches exactly on every rank and the
    only other measured kinds are explained residuals. Never raises: a failure becomes ``check: ERROR``."""
    try:
        return _section(cfg, Path(cell), summary)
    except Exception as e:  # noqa: BLE001 - the plan must never fail a cell that ran
        return {"check": "ERROR", "reasons": [f"{type(e).__name__}: {e}"]}


def _measured(cell: Path) -> dict[str, list[tuple[int, int]]] | None:
    import pandas as pd

    path = cell / "rank_state.csv"
    if not path.exists():
        return None
    frame = pd.read_csv(path).sort_values("rank")
    return {str(kind): list(zip(rows.logical_bytes.astype(int), rows.physical_bytes.astype(int)))
            for kind, rows in frame.groupby("kind", sort=False)}


def _section(cfg: Any, cell: Path, summary: dict[str, Any]) -> dict[str, Any]:
    from zeroexp.strategies.fsdp import wrap_paths

    name, n = row_of(cfg), int(cfg.world_size)
    precision, offload = Precision(str(cfg.precision.name), str(cfg.precision.param_dtype)), str(cfg.offload.name)
    layout = strategy_table().get(name)
    if layout is None or precision.name not in layout.precisions or offload not in layout.offloads:
        return {"check": "n/a", "reasons": [f"no byte model for strategy={name} precision={precision.name} "
                                             f"offload={offload} (zeroexp.formulas.LAYOUTS)"]}
    measured = _measured(cell)
    if measured is None:
        return {"check": "n/a", "reasons": ["no rank_state.csv: the state probe did not run"]}
    shape, knobs = model_shape(cfg.model, wrap_paths(cfg)), knobs_of(cfg)
    record = plan_record(name, layout, shape, n, precision, offload, knobs, model=str(cfg.model.name))
    predicted = rank_state_bytes(layout, shape, n, precision.itemsize, knobs, offload)
    kinds = [k for k in STATE_KINDS if k in predicted]
    reasons, ranks = [], []
    for kind in dict.fromkeys([*predicted, *measured]):
        want, got = predicted.get(kind), measured.get(kind)
        if want is None:
            if kind not in RESIDUALS and any(ph for _, ph in got):
                reasons.append(f"{kind}: {max(ph for _, ph in got)} B measured on the largest rank, not planned")
            continue
        got = got or [(0, 0)] * n
        ranks += [{"rank": r, "kind": kind, "predicted_logical_bytes": w[0], "predicted_physical_bytes": w[1],
                   "measured_logical_bytes": int(g[0]), "measured_physical_bytes": int(g[1])}
                  for r, (w, g) in enumerate(zip(want, got))]
        reasons += [f"rank {r} {kind}: measured {g[0]} B logical / {g[1]} B physical, planned {w[0]} / {w[1]}"
                    for r, (w, g) in enumerate(zip(want, got)) if tuple(map(int, g)) != tuple(w)]

    def largest(table: dict[str, list[tuple[int, int]]], ks: list[str]) -> int:
        ranks_held = min([n, *(len(table[k]) for k in ks if k in table)])  # a dry run measures rank 0 only
        return max(sum(int(table[k][r][1]) for k in ks if k in table) for r in range(ranks_held))

    pred = {k: largest(predicted, [k]) for k in kinds} | {"total": record["total_bytes"]}
    meas = {k: largest(measured, [k]) if k in measured else 0 for k in kinds} | {"total": largest(measured, kinds)}
    measured_payload = summary.get("collectives", {}).get("payload_bytes")
    payload_reasons = [] if layout.payload_limits is None else \
        layout.payload_limits(shape, knobs, precision.name, offload)
    if measured_payload is None:
        payload_reasons.append("no collectives section: the collectives probe did not run")
    payload = None if payload_reasons else _payload(record["payload_bytes"], measured_payload)
    return {
        "layout": record["label"],
        "row": name,
        "predicted_bytes": pred,
        "measured_bytes": meas,
        "difference_bytes": {k: meas[k] - pred[k] for k in pred},
        "residual_bytes": {k: largest(measured, [k]) for k in RESIDUALS if k in measured},
        "ranks": ranks,
        "payload": payload,
        "payload_check": "n/a" if payload is None else
                         "PASS" if all(p["difference_bytes"] == 0 for p in payload) else "FAIL",
        "payload_reasons": payload_reasons,
        "check": "FAIL" if reasons else "PASS",
        "reasons": reasons,
    }


def _payload(predicted: dict[str, int], measured: dict[str, int]) -> list[dict[str, Any]]:
    """Per collective op, the planned and the measured per-step payload S (the collectives probe's)."""
    return [{"op": op, "predicted_bytes": predicted.get(op, 0), "measured_bytes": int(measured.get(op, 0)),
             "difference_bytes": int(measured.get(op, 0)) - predicted.get(op, 0)}
            for op in dict.fromkeys([*predicted, *measured])]
