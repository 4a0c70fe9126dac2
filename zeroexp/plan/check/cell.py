"""``summary.json["plan"]``: the planner's per-rank prediction for a cell that ran, beside what it measured.

The launching process calls :func:`plan_section` once the ranks are done (zeroexp.launch.epilogue): the prediction uses
the cell's own model (its shape, read by validation: ``Cell.shape``), N, precision, offload and strategy settings,
through the groups its row derives from the shapes (:func:`cell_groups`); the measurement is the state probe's
``rank_state.csv`` and the collectives probe's counts and payloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroexp.cell.resolved import Cell
from zeroexp.formulas import STATE_KINDS, Groups, PlanKnobs, StateLayout, derive_groups, rank_state_bytes
from zeroexp.plan.check.expect import groups_record
from zeroexp.plan.core import Precision, plan_record
from zeroexp.plan.shape import cell_shape
from zeroexp.results.verdict import Check, Code, Reason, Verdict, reasons as coded

__all__ = ["plan_section", "cell_groups", "collective_rows"]

#: What a measured kind the planner leaves out of the model state is, when it is explained.
RESIDUALS = {"optim_scalar": "Adam's 4-byte step scalar per optimizer tensor"}


def cell_groups(cell: Cell) -> Groups:
    """The groups the cell's row (``strategy.layout``) derives from its model's shapes on the meta device: what the
    strategy's adapter reads off its live structure when the cell runs."""
    return derive_groups(cell.row_name, cell.row, cell_shape(cell), cell.world_size, cell.itemsize, cell.knobs)


def no_byte_model(cell: Cell) -> str | None:
    """Why the formulas have no byte model for the cell's row in its precision and offload; None where they have."""
    name, layout, precision, offload = cell.row_name, cell.row, cell.precision, cell.offload
    if precision in layout.precisions and offload in layout.offloads:
        return None
    return (f"no byte model for strategy.layout={name} precision={precision} offload={offload} "
            "(zeroexp.formulas.LAYOUTS)")


def rank_state_of(cell: Cell) -> dict[str, list[tuple[int, int]]] | None:
    """The cell's state table by the formulas: per kind, each rank's (logical, physical) bytes
    (``zeroexp.formulas.rank_state_bytes`` over :func:`cell_groups`); None where there is no byte model
    (:func:`no_byte_model`)."""
    if no_byte_model(cell):
        return None
    return rank_state_bytes(cell.row, cell_groups(cell), cell.itemsize, cell.knobs, cell.offload)


def plan_section(cell: Cell, cell_dir: Path, summary: dict[str, Any], itself: str | None = None,
                 live_groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted vs measured bytes per state kind (largest rank, physical) and per rank (logical and physical), and
    the calls and payload per collective; ``check`` PASS when every state kind matches exactly on every rank, the
    only other measured kinds are explained residuals, and every collective's count and payload match (where the
    payload model covers the cell). ``itself``: why the measurement is the planner's own model (a derived dry run):
    the check then reads n/a with that reason. ``live_groups``: the groups the strategy's adapter read off rank 0
    (``zeroexp.plan.check.expect.groups_record``); the planner's must equal them, element for element (``groups``).
    Never
    raises: a failure becomes ``check: ERROR``."""
    from zeroexp.plan.check.step_time import time_section

    try:
        section = _section(cell, Path(cell_dir), summary, itself, live_groups)
    except Exception as e:  # noqa: BLE001 - the plan must never fail a cell that ran
        section = Check.raised(e).fields()
    section["time"] = time_section(cell, summary)  # predicted vs measured step time (zeroexp.plan.check.step_time)
    return section


def _memory(cell: Cell, summary: dict[str, Any], name: str, groups: Groups, itemsize: int, shape: Any
            ) -> dict[str, Any]:
    """``plan.memory`` (:mod:`zeroexp.plan.check.memory`); never raises: a failure becomes ``check: ERROR``."""
    from zeroexp.models import import_class
    from zeroexp.plan.check.memory import memory_section

    from zeroexp._lib.fake_tensors import untraceable

    try:
        return memory_section(cell, summary, name, groups, itemsize, [import_class(p) for p in cell.wrap], shape)
    except Exception as e:  # noqa: BLE001 - the plan must never fail a cell that ran
        why = untraceable(e)  # the model's step, not the check, cannot run on fake tensors: not modelled, said why
        if why is not None:
            return Check(Verdict.NA, (Reason(Code.MEMORY_NOT_MODELLED, "no peak model for a step the planner cannot "
                                             f"trace on fake tensors: {why}"),)).fields()
        return Check.raised(e).fields()


def _measured(cell_dir: Path) -> dict[str, list[tuple[int, int]]] | None:
    import pandas as pd

    path = cell_dir / "rank_state.csv"
    if not path.exists():
        return None
    frame = pd.read_csv(path).sort_values("rank")
    return {str(kind): list(zip(rows.logical_bytes.astype(int), rows.physical_bytes.astype(int)))
            for kind, rows in frame.groupby("kind", sort=False)}


def collective_rows(predicted: dict[str, dict[str, int]], measured_counts: dict[str, int],
                    measured_payload: dict[str, int]) -> list[dict[str, Any]]:
    """Per collective op, the planned and the measured calls and payload S per step (the collectives probe's)."""
    return [{"op": op, "predicted_count": predicted.get(op, {}).get("count", 0),
             "measured_count": int(measured_counts.get(op, 0)),
             "predicted_bytes": predicted.get(op, {}).get("payload_bytes", 0),
             "measured_bytes": int(measured_payload.get(op, 0))}
            for op in dict.fromkeys([*predicted, *measured_payload, *measured_counts])]


def _section(cell: Cell, cell_dir: Path, summary: dict[str, Any], itself: str | None,
             live_groups: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`plan_section`'s section but ``time``; raises where the planner fails."""
    n, offload = cell.world_size, cell.offload
    precision = Precision(cell.precision, cell.policy.precision.param_dtype)
    name, layout = cell.row_name, cell.row
    if why := no_byte_model(cell):
        return _stopped(name, Reason(Code.PLAN_NO_BYTE_MODEL, why))
    measured = _measured(cell_dir)
    if measured is None:
        return _stopped(name, Reason(Code.PLAN_NO_STATE_MEASURED, "no rank_state.csv: the state probe did not run"))
    shape, knobs = cell_shape(cell), cell.knobs
    groups = derive_groups(name, layout, shape, n, precision.itemsize, knobs)
    record = plan_record(name, layout, shape, n, precision, offload, knobs, model=str(cell.model["name"]))
    predicted = rank_state_bytes(layout, groups, precision.itemsize, knobs, offload)
    kinds = [k for k in STATE_KINDS if k in predicted]
    ranks, reasons = _state_ranks(predicted, measured, n)
    pred = {k: _largest(predicted, [k], n) for k in kinds} | {"total": record["total_bytes"]}
    meas = ({k: _largest(measured, [k], n) if k in measured else 0 for k in kinds}
            | {"total": _largest(measured, kinds, n)})
    rows, payload_reasons, coll_reasons = _collectives(layout, groups, knobs, precision.name, offload, record,
                                                       summary.get("collectives", {}))
    group_check, differ = _group_check(groups, live_groups, itself)
    payload = None if rows is None else [
        {"op": r["op"], "predicted_bytes": r["predicted_bytes"], "measured_bytes": r["measured_bytes"],
         "difference_bytes": r["measured_bytes"] - r["predicted_bytes"]} for r in rows]
    section = {
        "layout": record["label"],
        "row": name,
        "predicted_bytes": pred,
        "measured_bytes": meas,
        "difference_bytes": {k: meas[k] - pred[k] for k in pred},
        "residual_bytes": {k: _largest(measured, [k], n) for k in RESIDUALS if k in measured},
        "ranks": ranks,
        "collectives": rows,
        "groups": group_check,
        "payload": payload,
        **_verdicts(reasons, coll_reasons, differ, payload_reasons, payload, itself),
    }
    try:  # a figure beside the checks, judged by none: its failure is said, not the plan's
        section["grad_norm"] = norm_reduction(layout, groups, knobs, precision.itemsize)
    except Exception as e:  # noqa: BLE001
        section["grad_norm"] = {"error": f"{type(e).__name__}: {e}"}
    section["memory"] = _memory(cell, summary, name, groups, precision.itemsize, shape)
    if cell.checkpoint != "none":  # the tensors' bytes each rank wrote (zeroexp.plan.check.checkpoint)
        from zeroexp.plan.check.checkpoint import checkpoint_section

        section["checkpoint"] = checkpoint_section(cell, summary, groups, precision.itemsize, shape)
    return section


def _stopped(name: str, why: Reason) -> dict[str, Any]:
    """A plan that stopped before its parts: n/a, ``why``."""
    return {"check": Verdict.NA, "row": name, **Check(Verdict.NA, (why,)).fields()}


def _verdicts(state: list[Reason], calls: list[Reason], groups: list[Reason], payload_reasons: list[Reason],
              payload: list[dict[str, Any]] | None, itself: str | None) -> dict[str, Any]:
    """The plan's verdict fields, their one writer: ``payload_check`` and why it is not checked
    (``payload_reasons``: then ``calls`` reads n/a with them), the ``state`` and ``calls`` parts, and the plan's own
    ``check`` over the state's, the calls' and the groups' reasons in that order (``plan.groups`` is
    :func:`_group_check`'s). ``itself``: why the measurement is the planner's own model: every check n/a."""
    if itself:  # the "measurement" is this model: comparing them cannot fail
        said = Check(Verdict.NA, (Reason(Code.NOT_CHECKED, f"not checked: {itself}"),))
        return {"payload_check": Verdict.NA, **_payload_why(payload_reasons), "state": said.fields(),
                "calls": said.fields(), **said.fields()}
    return {"payload_check": Verdict.NA if payload is None else
            Verdict.passed_if(all(p["difference_bytes"] == 0 for p in payload)),
            **_payload_why(payload_reasons),
            "state": Check.failed_if(state).fields(),
            "calls": (Check(Verdict.NA, tuple(payload_reasons)) if payload is None else
                      Check.failed_if(calls)).fields(),
            **Check.failed_if([*state, *calls, *(r.prefixed("groups ") for r in groups)]).fields()}


def _payload_why(payload_reasons: list[Reason]) -> dict[str, Any]:
    return {"payload_reasons": [r.text for r in payload_reasons],
            "payload_reason_codes": [r.code.value for r in payload_reasons]}


def _largest(table: dict[str, list[tuple[int, int]]], ks: list[str], n: int) -> int:
    """The largest rank's physical bytes of the kinds ``ks`` in ``table`` (per kind, per rank: logical and physical
    bytes), over the ranks every kind has (a dry run measures rank 0 only; at most ``n``)."""
    ranks_held = min([n, *(len(table[k]) for k in ks if k in table)])  # a dry run measures rank 0 only
    return max(sum(int(table[k][r][1]) for k in ks if k in table) for r in range(ranks_held))


def _state_ranks(predicted: dict[str, list[tuple[int, int]]], measured: dict[str, list[tuple[int, int]]],
                 n: int) -> tuple[list[dict[str, Any]], list[Reason]]:
    """Per rank and planned kind, the predicted and measured logical and physical bytes, and the reasons the state
    check fails: a rank's bytes of a kind differ from the plan, or a measured kind the plan leaves out is held and is
    not an explained residual (:data:`RESIDUALS`)."""
    reasons: list[Reason] = []
    ranks: list[dict[str, Any]] = []
    for kind in dict.fromkeys([*predicted, *measured]):
        want, got = predicted.get(kind), measured.get(kind)
        if want is None:
            if kind not in RESIDUALS and any(ph for _, ph in got):
                reasons.append(Reason(Code.PLAN_STATE_UNPLANNED, f"{kind}: {max(ph for _, ph in got)} B measured on "
                                      "the largest rank, not planned"))
            continue
        got = got or [(0, 0)] * n
        ranks += [{"rank": r, "kind": kind, "predicted_logical_bytes": w[0], "predicted_physical_bytes": w[1],
                   "measured_logical_bytes": int(g[0]), "measured_physical_bytes": int(g[1])}
                  for r, (w, g) in enumerate(zip(want, got))]
        reasons += [Reason(Code.PLAN_STATE_DIFFERS, f"rank {r} {kind}: measured {g[0]} B logical / {g[1]} B physical, "
                           f"planned {w[0]} / {w[1]}")
                    for r, (w, g) in enumerate(zip(want, got)) if tuple(map(int, g)) != tuple(w)]
    return ranks, reasons


def _collectives(layout: StateLayout, groups: Groups, knobs: PlanKnobs, precision: str, offload: str,
                 record: dict[str, Any],
                 coll: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, list[Reason], list[Reason]]:
    """The planned against the measured collectives (``coll``: the collectives probe's section): the rows
    (:func:`collective_rows`; None where the payload model does not cover the cell or the probe did not run), why
    they are not compared, and the ops whose calls or payload differ."""
    payload_reasons = [] if layout.payload_limits is None else \
        coded(Code.PLAN_PAYLOAD_NOT_MODELLED, layout.payload_limits(groups, knobs, precision, offload))
    if coll.get("payload_bytes") is None:
        payload_reasons.append(Reason(Code.PLAN_NO_COLLECTIVES_MEASURED,
                                      "no collectives section: the collectives probe did not run"))
    rows = None if payload_reasons else collective_rows(
        {op: {"count": record["counts"][op], "payload_bytes": b} for op, b in record["payload_bytes"].items()},
        coll.get("counts") or {}, coll["payload_bytes"])
    coll_reasons = [Reason(Code.PLAN_CALLS_DIFFER, f"{r['op']}: measured {r['measured_count']} calls / "
                           f"{r['measured_bytes']} B per step, planned {r['predicted_count']} / {r['predicted_bytes']}")
                    for r in rows or ()
                    if (r["measured_count"], r["measured_bytes"]) != (r["predicted_count"], r["predicted_bytes"])]
    return rows, payload_reasons, coll_reasons


def _group_check(groups: Groups, live_groups: dict[str, Any] | None,
                 itself: str | None) -> tuple[dict[str, Any], list[Reason]]:
    """``plan.groups``: the planned groups (:func:`~zeroexp.plan.check.expect.groups_record`) against the live ones the
    adapter reported, and the elements that differ; n/a where none were reported, or where the live groups are the
    planner's own (``itself``: why)."""
    planned = groups_record(groups)
    differ: list[Reason] = []
    if itself:
        check = Check(Verdict.NA, (Reason(Code.NOT_CHECKED, f"not checked: {itself}"),))
    elif live_groups is None:
        check = Check(Verdict.NA, (Reason(Code.PLAN_NO_LIVE_GROUPS, "the adapter reported no live groups for this "
                                          "cell (see collectives.reasons)"),))
    else:
        differ = [Reason(Code.PLAN_GROUPS_DIFFER, f"{k}: live {live_groups.get(k)!r}, planned {v!r}")
                  for k, v in planned.items() if live_groups.get(k) != v]
        check = Check.failed_if(differ)
    return {**check.fields(), "planned": planned}, differ


def norm_reduction(layout: StateLayout, groups: Groups, knobs: PlanKnobs, itemsize: int) -> dict[str, Any]:
    """The collectives per step the total gradient norm of global-norm clipping adds, by op and process group: the
    one collectives model (``step_collectives``) with clipping less the same without, so the figure the
    collectives check holds the cell to (``plan.collectives``) and this one are the same fact. ``collectives``:
    ``{op: {count, payload_bytes, groups?}}``, empty where the norm needs none (every rank holds the whole gradient,
    DDP's), or where the strategy takes the norm whether it clips or not (DeepSpeed's ZeRO optimizer: in the model
    without clipping too)."""
    from dataclasses import replace

    from zeroexp.formulas import step_collectives

    on = step_collectives(layout, groups, itemsize, replace(knobs, clipping=True, norm_allreduce=True))
    off = step_collectives(layout, groups, itemsize, replace(knobs, clipping=False,  # zeroexp's ZeRO scales with it
                                                              norm_allreduce=knobs.loss_scaling))
    added: dict[str, Any] = {}
    for op, entry in on.items():
        was = off.get(op, {})
        count, payload = entry["count"] - was.get("count", 0), entry["payload_bytes"] - was.get("payload_bytes", 0)
        if count <= 0:
            continue
        added[op] = {"count": count, "payload_bytes": payload}
        by_group = {g: {"size": e["size"], "count": e["count"] - was.get("groups", {}).get(g, {}).get("count", 0),
                        "payload_bytes": e["payload_bytes"]
                        - was.get("groups", {}).get(g, {}).get("payload_bytes", 0)}
                    for g, e in entry.get("groups", {}).items()}
        if by_group:
            added[op]["groups"] = {g: e for g, e in by_group.items() if e["count"] > 0}
    return {"collectives": added, "clipping": bool(knobs.clipping)}
