"""``summary.json["plan"]["memory"]``: each phase's bytes above steady, predicted by the peak model beside measured.

The prediction (:func:`zeroexp.formulas.peak.phases.phase_peaks`) takes the bare model's step traced on fake tensors
(:func:`zeroexp.plan.steptrace.trace_step`: the cell's model, per-rank batch and device) and the groups the cell's row
derives from the shapes (the same groups ``plan.groups`` checks against the live ones). The measurement is the memory
probe's: the largest rank's steady bytes and each phase's peak by category (MemTracker's, with the probe's own
``unsharded`` and ``comm``: the model predicts in the same categories, so that a phase compares category by category).

The check: for every phase, the measured bytes above steady minus the predicted lie in [0, 2 % of the measured]; the
model is a lower bound, it may never exceed the measurement. One excess is allowed, and named: a tensor the model knows
gloo may free late (an async collective's input released only when gloo's work object goes away); the phase then
passes when the measured minus the prediction minus that tensor lies in the same band."""

from __future__ import annotations

from typing import Any

from zeroexp.cell.memo import memo_table, recall, remember
from zeroexp.cell.resolved import Cell
from zeroexp.formulas import ITEMSIZE, LAYOUTS, Groups, ModelShape, PlanKnobs
from zeroexp.formulas.device import CPU, FAKE_GROUP, DeviceSemantics, measured_on
from zeroexp.formulas.peak.checkpointing import mode_of
from zeroexp.formulas.peak.phases import StepTrace
from zeroexp.formulas.peak.precision import PrecisionTerms
from zeroexp.formulas.rows import row_of as _row, rows_where as _modelled
from zeroexp.plan.check.memory_excess import excess_sentence, explain_excess
from zeroexp.plan.check.judge import TOLERANCE, as_simulated, judge_rank
from zeroexp.plan.check.gloo import late_free
from zeroexp.plan.reserved import cell_steady_blocks, judge_device, judge_reserved
from zeroexp.results.verdict import Check, Code, Reason, Verdict, reasons as coded

__all__ = ["memory_section", "predict_phases", "worst_rank_phases", "step_traces", "needs_in_place", "flow_of",
           "uncovered", "steady_buffers_bytes", "trace_for", "trace_units_wanted", "TOLERANCE"]

# The peak model asks a row's family (StateLayout.family: zeroexp.formulas.families), never its name.


def uncovered(name: str, precision: str, offload: str,
              activation_checkpointing: str = "none", micro_batches: int = 1,
              sync_each_microbatch: bool = False, reduce_dtype: str | None = None,
              param_dtype: str = "float32", frozen: bool = False) -> list[str]:
    """Why the peak model does not cover a row in this precision, offload and axes (empty: it does);
    ``reduce_dtype``: FSDP2's ``strategy.reduce_dtype`` (None: the compute dtype, ``param_dtype``); ``frozen``: the
    model has parameters that do not train."""
    row = _row(name)
    flow = row.family.flow(row)
    reasons = []
    if flow is None:  # by family, FSDP's rows FULL_SHARD, SHARD_GRAD_OP, then hybrid sharding's
        covered = sorted(_modelled(lambda r: r.family.flow(r) is not None),
                         key=lambda n: (LAYOUTS[n].family.covered_rank, LAYOUTS[n].family.covered_key(LAYOUTS[n])))
        reasons.append(row.family.unmodelled(row)
                       or f"no peak model yet for strategy.layout={name} (covered: {', '.join(covered)})")
    if offload != "none" and (why := row.family.offload_limit(row, offload, micro_batches)):
        reasons.append(why)
    if activation_checkpointing != "none" and flow is not None and row.family.checkpointing_limit(row, frozen):
        reasons.append(row.family.checkpointing_limit(row, frozen))
    mixed_limit = row.family.mixed_accumulation_limit(row) if precision != "fp32" else None
    if micro_batches > 1 and flow is not None and mixed_limit and row.no_sync_accumulation \
            and not sync_each_microbatch:
        reasons.append(mixed_limit)
    frozen_limit = row.family.frozen_accumulation_limit(row) if micro_batches > 1 and frozen else None
    if frozen_limit and flow is not None:
        reasons.append(frozen_limit)
    dtype_limit = row.family.accumulation_limit(row, reduce_dtype, param_dtype) if micro_batches > 1 else None
    if dtype_limit and flow is not None and row.no_sync_accumulation and not sync_each_microbatch:
        reasons.append(dtype_limit)
    modelled = (row.no_sync_accumulation and not sync_each_microbatch and (
        activation_checkpointing == "none" or row.family.no_sync_checkpointing(row))) or (
        sync_each_microbatch and row.family.sync_accumulation(row))
    if micro_batches > 1 and flow is not None and not row.family.accumulates(row) and not modelled:
        covered = _modelled(lambda r: r.family.accumulates(r)) + [
            f"{n} under no_sync" + ("" if LAYOUTS[n].family.no_sync_checkpointing(LAYOUTS[n])
                                    else " without activation checkpointing")
            for n in _modelled(lambda r: r.no_sync_accumulation)] + [
            f"{n} with strategy.sync_each_microbatch" for n in _modelled(lambda r: r.family.sync_accumulation(r))]
        how = "".join(f" {k}={v}" for k, v in (("strategy.sync_each_microbatch", "true" if sync_each_microbatch
                                                                               else None),
                                               ("activation_checkpointing", activation_checkpointing))
                      if v not in (None, "none"))
        reasons.append(f"no peak model yet for grad_accum={micro_batches} with strategy.layout={name}{how} (covered: "
                       f"{', '.join(covered)})")
    return reasons


def shape_limits(name: str, shape: ModelShape, groups: Groups) -> list[str]:
    """Why the peak model does not cover this model's shape under row ``name`` (empty: it does)."""
    row = _row(name)
    first, later, last = row.family.shape_limits(row, shape)
    reasons = list(first)
    rnn = [c for c in shape.opaque if c in ("RNN", "LSTM", "GRU")]
    if rnn:
        reasons.append(f"no peak model yet for {', '.join(rnn)}: the CPU kernel (mkldnn_rnn_layer) saves for "
                       "backward what its fake-tensor kernel does not (77,440 B against 20,096 on a 2-layer LSTM of "
                       "16); state, collectives and groups are checked")
    reasons += later
    if shape.exact and any(shape.calls(u) > 1 for u in range(len(shape.units))):
        reasons.append("no peak model yet for a module applied more than once in a forward: the run accumulates its "
                       "gradient in place where the fake-tensor trace allocates the sum (64 B less measured on an "
                       "8-wide model); state, collectives and groups are checked")
    return reasons + last


def flow_of(name: str) -> str | None:
    """The row's gradient flow in the peak model (``zeroexp.formulas.peak.phases``), None where there is no model."""
    row = _row(name)
    return row.family.flow(row)


def step_traces(name: str, model_cfg: Any, batch_size: int, wrap: list[type], checkpointing: Any,
                micro_batches: int, param_dtype: str = "float32", terms: PrecisionTerms | None = None,
                block: int = 1) -> tuple[StepTrace, StepTrace | None]:
    """The bare step traced for row ``name`` (:func:`trace_for`, checkpointed as the cell, in its precision, each
    storage counted in ``block``-byte blocks: ``DeviceSemantics.block``), and, where the row's gradients live across
    a step (``in_place``, ``bucket``) or a later micro-batch adds into them (``new`` with ``grad_accum`` > 1), the
    same step traced with its gradients allocated before it."""
    trace = trace_for(name, model_cfg, batch_size, wrap, param_dtype, checkpointing, terms=terms, block=block)
    if needs_in_place(name, micro_batches):
        return trace, trace_for(name, model_cfg, batch_size, wrap, param_dtype, checkpointing, grads_in_place=True,
                                terms=terms, block=block)
    return trace, None


def needs_in_place(name: str, micro_batches: int) -> bool:
    """Whether row ``name``'s peak model reads the step traced with its gradients allocated (:func:`step_traces`)."""
    row = _row(name)
    return row.family.needs_in_place(row, micro_batches)


def worst_rank_phases(name: str, groups: Groups, shape: ModelShape, trace: StepTrace, itemsize: int,
                      prefetch: str, micro_batches: int = 1, in_place: StepTrace | None = None,
                      bucket_cap_bytes: int = PlanKnobs.bucket_cap_bytes, terms: PrecisionTerms | None = None,
                      device: DeviceSemantics = CPU, root_kept: bool = False,
                      knobs: PlanKnobs = PlanKnobs()) -> dict[str, dict]:
    """:func:`predict_phases` for the rank whose largest phase is highest, without a measurement to say which rank
    that is (zro's ranks differ by their owned parameters, DeepSpeed stage 1-2's by their partitions): where the
    row's family finds that rank without each rank's phases (``Family.worst_rank``), that rank's alone."""
    row = _row(name)
    worst = row.family.worst_rank(row, groups, trace, itemsize, micro_batches=micro_batches, in_place=in_place,
                                  bucket_cap_bytes=bucket_cap_bytes, foreach=device.foreach, knobs=knobs) \
        if row.ranks_differ else 0
    ranks = range(groups.world_size) if worst is None else (worst,) if isinstance(worst, int) else worst
    return max((predict_phases(name, groups, shape, trace, itemsize, r, prefetch, device.gloo, micro_batches, in_place,
                               bucket_cap_bytes, terms, root_kept=root_kept, foreach=device.foreach, knobs=knobs,
                               block=device.block)
                for r in ranks), key=lambda ph: max(v["bytes"] for v in ph.values()))


def predict_phases(name: str, groups: Groups, shape: ModelShape, trace: StepTrace, itemsize: int, rank: int = 0,
                   prefetch: str = "none", gloo: bool = False, micro_batches: int = 1,
                   in_place: StepTrace | None = None, bucket_cap_bytes: int = PlanKnobs.bucket_cap_bytes,
                   terms: PrecisionTerms | None = None, reduce: str = "reduce_scatter", root_kept: bool = False,
                   foreach: bool = False, knobs: PlanKnobs = PlanKnobs(), block: int = 1) -> dict[str, dict]:
    """The peak model for a covered row (:func:`uncovered` is empty): per phase, ``bytes`` above steady and
    ``by_category``, for rank ``rank``. ``itemsize``: the compute dtype's. ``trace``: the bare step (checkpointed
    when the cell is: its segments then hold each unit's input in forward and its recompute in backward; DeepSpeed
    rows: :func:`trace_for`'s); ``in_place``: the same with its gradients allocated before it (:func:`step_traces`);
    ``micro_batches``: ``grad_accum``, each phase the highest over them (:mod:`zeroexp.formulas.peak.accumulation`);
    ``bucket_cap_bytes``: ``strategy.bucket_cap_mb``, DeepSpeed's reduce bucket; ``terms``: how the row applies the
    precision (:func:`cell_precision_terms`; None: fp32); ``reduce``: zeroexp's ZeRO's ``strategy.reduce`` (on gloo
    a reduce_scatter's wait hands back a reduced copy of the bucket: :func:`zeroexp.formulas.peak.phases.phase_peaks`);
    ``root_kept``: FSDP2's root kept unsharded from forward to backward (``PlanKnobs.root_kept_after_forward``);
    ``knobs``: FSDP2's explicit prefetch (``PlanKnobs.forward_prefetch``, ``backward_prefetch``) and ``reduce_dtype``;
    ``gloo``, ``foreach`` and ``block``: the device's backend copies, AdamW update and allocation block
    (:mod:`zeroexp.formulas.device`; each tensor of the closed-form terms counted in blocks, the trace's too:
    :func:`step_traces`; DeepSpeed's terms unrounded)."""
    row = _row(name)
    return row.family.phase_peaks(row, groups, shape, trace, itemsize, rank=rank, prefetch=prefetch, gloo=gloo,
                                  micro_batches=micro_batches, in_place=in_place, bucket_cap_bytes=bucket_cap_bytes,
                                  terms=terms, reduce=reduce, root_kept=root_kept, foreach=foreach, knobs=knobs,
                                  block=block)


def precision_terms_of(name: str, precision: str, param_dtype: str) -> PrecisionTerms | None:
    """How row ``name`` applies a precision (its name and compute dtype; None: a row without precision terms:
    DeepSpeed's, or no model)."""
    row = _row(name)
    return row.family.precision_terms(row, precision, param_dtype, ITEMSIZE[param_dtype])


def cell_precision_terms(name: str, cell: Cell) -> PrecisionTerms | None:
    """:func:`precision_terms_of` the cell's precision."""
    return precision_terms_of(name, cell.precision, cell.policy.precision.param_dtype)


def _trace_record(terms: PrecisionTerms | None) -> dict[str, Any]:
    """The dtypes the step was traced in, for ``plan.memory.trace``: ``autocast`` and ``param_dtype`` (null: none,
    the model's own fp32)."""
    return {"autocast": terms and terms.autocast, "param_dtype": terms and terms.module_dtype}


def steady_buffers_bytes(name: str, groups: Groups, itemsize: int, bucket_cap_bytes: int = PlanKnobs.bucket_cap_bytes,
                         terms: PrecisionTerms | None = None) -> int:
    """What a rank holds at the optimizer boundary beside its model state: DDP's gradient buckets (ddp, zro:
    ``gradient_as_bucket_view=false``, a copy of every gradient), DeepSpeed stage 3's ipg bucket; given ``terms``,
    zeroexp's ZeRO's all-gather inputs below fp32 (:func:`gather_input_bytes`, the phases' figures are less them)."""
    row = _row(name)
    return row.family.steady_buffers(row, groups, itemsize, bucket_cap_bytes, terms)


def trace_dtypes(name: str, param_dtype: str, terms: PrecisionTerms | None) -> tuple[str | None, str | None]:
    """(the autocast dtype, the dtype the module is cast to) row ``name``'s step computes in, as :func:`trace_for`
    traces it (None: neither, the model's own fp32): DeepSpeed's engine converts the module below fp32; the other rows
    as their ``terms`` say (FSDP's mixed precision and zeroexp's ZeRO cast, DDP autocasts:
    :mod:`zeroexp.formulas.peak.precision`)."""
    row = _row(name)
    if row.family.trace_options(row)["converts_module"]:
        return None, param_dtype if param_dtype != "float32" else None
    return (None, None) if terms is None else (terms.autocast, terms.module_dtype)


def casts_module(name: str, param_dtype: str, terms: PrecisionTerms | None) -> bool:
    """Whether row ``name``'s step computes with its module cast (:func:`trace_dtypes`) rather than under autocast:
    which of the planner's two traced forwards is the row's own."""
    return trace_dtypes(name, param_dtype, terms)[1] is not None


def trace_for(name: str, model_cfg: Any, batch_size: int, wrap: list[type], param_dtype: str = "float32",
              checkpointing: Any = False, grads_in_place: bool = False,
              terms: PrecisionTerms | None = None, block: int = 1) -> StepTrace:
    """The bare step the row's peak model reads (:func:`zeroexp.plan.steptrace.trace_step`): segmented at the
    strategy's units, or, for DeepSpeed (which gathers and releases stage-3 parameters module by module) and for the
    ``bucket`` flow, at every module holding parameters; in the dtypes the cell computes in: DeepSpeed's bf16 runs
    the module converted to bf16,
    the other rows as their ``terms`` say (autocast, or the module cast: :mod:`zeroexp.formulas.peak.precision`);
    each storage counted in ``block``-byte blocks (CUDA's 512; DeepSpeed's rows: 1, as their closed-form terms)."""
    import torch

    from zeroexp.plan.shape import arguments_key
    from zeroexp.plan.steptrace import trace_steps_of

    row = _row(name)
    options = row.family.trace_options(row)
    autocast, cast = trace_dtypes(name, param_dtype, terms)
    dtypes = {"dtype": autocast and getattr(torch, autocast), "module_dtype": cast and getattr(torch, cast)}
    # remembered by what is traced, not by the row: rows that trace the same step share it
    device_block = int(block)
    rest = dict(device="cpu", checkpointing=mode_of(checkpointing), grads_in_place=bool(grads_in_place),
                **{k: v for k, v in dtypes.items() if v is not None})

    def key_of(own: bool, root: bool, tensor_bytes: bool) -> str | None:
        b = 1 if tensor_bytes else device_block  # DeepSpeed's closed-form terms are tensor bytes: its trace too
        kw = {**rest, "own_params_units": bool(own), "root_unit": bool(root),
              **({"block": b} if b > 1 else {})}  # CPU traces keep their keys
        return arguments_key(model_cfg, int(batch_size), wrap, sorted((k, str(v)) for k, v in kw.items()))

    asked = (bool(options["own_params_units"]), bool(options["root_unit"]), bool(options["tensor_bytes"]))
    own, root, tensor_bytes = asked
    twin = _root_twin(recall("step_traces", key_of(own, not root, tensor_bytes))[1], root)
    if twin is not None:
        return twin
    found, trace = recall("step_traces", key_of(*asked))  # this invocation's, or the store's (zeroexp.cell.memo)
    if found:
        return trace
    views = [asked]  # the other segmentations and block sizes the invocation reads of the same step, in the same run
    same = (autocast, cast, bool(grads_in_place))
    views += [v[:3] for v in (memo_table("step_trace_units") or {})
              if v[3:] == same and v[:3] not in views and not recall("step_traces", key_of(*v[:3]))[0]]
    units = tuple((own, root, 1 if tensor_bytes else device_block) for own, root, tensor_bytes in views)
    traced = trace_steps_of(model_cfg, batch_size, wrap, units=units, **rest)
    for view, trace in zip(views, traced):
        remember("step_traces", key_of(*view), trace)
    return traced[0]


def trace_units_wanted(rows: list[tuple[str, str, str, int]]) -> None:
    """The rows this invocation will read the peak of, each ``(name, precision, param_dtype, grad_accum)`` (the
    planner's table: every row shown; the search: the rows of its space whose model state fits): a step traced for
    one of their segmentations and block sizes (``trace_options``: ``own_params_units``, ``root_unit``,
    ``tensor_bytes``) is traced with the others of the same dtypes (:func:`trace_dtypes`) and gradients (the step
    with its gradients allocated where the row reads it: :func:`needs_in_place`) in the same run
    (:func:`zeroexp.plan.steptrace.trace_steps`: one fake-tensor run for all, the segments of each the same as its
    own run's). Nothing outside an invocation."""
    table = memo_table("step_trace_units")
    for name, precision, param_dtype, micro_batches in rows if table is not None else ():
        row = _row(name)
        if row.family.flow(row) is None:  # no peak model: nothing traced
            continue
        options = row.family.trace_options(row)
        view = (bool(options["own_params_units"]), bool(options["root_unit"]), bool(options["tensor_bytes"]),
                *trace_dtypes(name, param_dtype, precision_terms_of(name, precision, param_dtype)))
        table[(*view, False)] = True
        if needs_in_place(name, micro_batches):
            table[(*view, True)] = True


def _root_twin(trace: StepTrace | None, root_unit: bool) -> StepTrace | None:
    """``trace``, the step traced with ``root_unit`` the other way (None: not traced), where it is the same step:
    ``root_unit`` (the model as its one unit where no unit is found, FSDP2's) changes nothing when the step traced
    without it started a unit's forward, nor when the step traced with it has no unit ``<model>``."""
    if trace is None:
        return None
    if root_unit:
        return trace if any(s.phase == "forward" and s.at == "start" for s in trace.segments) else None
    return trace if all(s.unit != "<model>" for s in trace.segments) else None


def _uncovered_cell(cell: Cell, name: str) -> list[str]:
    """:func:`uncovered` for a cell of row ``name``."""
    cast = cell.strategy_setting("output_dtype")
    why = [] if cast is None else [f"no peak model yet for strategy.output_dtype={cast}: FSDP2 casts the model's "
                                   "outputs, the traced step does not"]
    return why + uncovered(name, cell.precision, cell.offload, cell.activation_checkpointing, cell.grad_accum,
                           cell.knobs.sync_each_microbatch, cell.strategy_setting("reduce_dtype"),
                           cell.policy.precision.param_dtype, frozen=bool(cell.shape and cell.shape.frozen))


def _cell_step_traces(cell: Cell, name: str, wrap: list[type], terms: PrecisionTerms | None, block: int = 1
                      ) -> tuple[StepTrace, StepTrace | None]:
    """:func:`step_traces` for a cell of row ``name``: what its ``plan.memory`` reads (``block``: its device's,
    ``DeviceSemantics.block``)."""
    trace, in_place = step_traces(name, cell.model, cell.batch_size, wrap, cell.checkpointed, cell.grad_accum,
                                  cell.policy.precision.param_dtype, terms, block)
    return trace.for_cell(cell.logs_loss), in_place and in_place.for_cell(cell.logs_loss)


def memory_section(cell: Cell, summary: dict[str, Any], name: str, groups: Groups, itemsize: int,
                   wrap: list[type], shape: ModelShape) -> dict[str, Any]:
    """The plan's memory section for a cell that ran (``name``: its row; ``groups``: derived from the shapes)."""
    measured = summary.get("memory") or {}
    knobs = cell.knobs
    cap, recompute = knobs.bucket_cap_bytes, knobs.recompute_mode or knobs.recompute
    row = _row(name)
    uncovered = (_uncovered_cell(cell, name) + row.family.peak_limits(row, groups, cap, recompute)
                 + shape_limits(name, shape, groups))
    if uncovered:
        return Check(Verdict.NA, tuple(coded(Code.MEMORY_NOT_MODELLED, uncovered))).fields()
    terms = cell_precision_terms(name, cell)
    several = terms is not None and terms.master_below_compute and len(groups.shards) > 1
    if several and measured.get("phases_of_max_rank"):
        return Check(Verdict.NA, (Reason(
            Code.MEMORY_NOT_MODELLED,
            f"no peak model yet for {name} below fp32 with {len(groups.shards)} buckets: gloo held every bucket's "
            "all-gather input through forward in the cell measured, more than the one late tensor the check allows "
            "(docs/planner.md, the peak model)"),)).fields()
    checkpointing, micro_batches, prefetch = cell.checkpointed, cell.grad_accum, cell.policy.prefetch
    device = (measured_on(str(measured.get("source", "")), measured.get("compute_capability"),
                           measured.get("backend") == "fake") if measured.get("phases_of_max_rank") else FAKE_GROUP
              ).with_adamw(cell.policy.optimizer.impl)
    trace, in_place = _cell_step_traces(cell, name, wrap, terms, device.block)
    traced = {"batch_size": trace.batch_size, "device": "cpu", "block_bytes": device.block,
              "loss_bytes": trace.loss_bytes, "checkpointing": bool(checkpointing), "micro_batches": micro_batches,
              **_trace_record(terms)}
    if not measured.get("phases_of_max_rank"):  # a dry run: the prediction alone, for every rank's worst
        predicted = worst_rank_phases(name, groups, shape, trace, itemsize, prefetch, micro_batches,
                                      in_place, cap, terms, device, knobs.root_kept_after_forward, knobs)
        return {"model": f"peak model (zeroexp.formulas.peak.phases), row {name}", "trace": traced,
                "phases": {ph: {"predicted_bytes": v["bytes"], "predicted_by_category": v["by_category"]}
                           for ph, v in predicted.items()},
                **Check(Verdict.NA, (Reason(Code.MEMORY_NO_MEASUREMENT, "no per-phase memory measurement (a dry run, "
                                            "or the memory probe did not run): predicted only"),)).fields()}
    worst_rank = int(measured["max_rank"])
    gloo = device.gloo
    late = late_free(name, groups, itemsize, gloo, micro_batches, cap)
    by_rank = measured.get("phases_by_rank") or [None] * len(measured["steady_bytes"])
    steady_by_rank = measured.get("steady_categories_by_rank") or [None] * len(by_rank)
    out_reasons, errs, ranks = [], [], []
    phases: dict[str, Any] = {}
    reduce = knobs.reduce
    for rank in range(len(by_rank)):  # every rank judged against its own prediction
        got_phases = measured["phases_of_max_rank"] if rank == worst_rank else by_rank[rank]
        if got_phases is None:
            continue
        steady_cats = (measured.get("steady_categories_of_max_rank") if rank == worst_rank
                       else steady_by_rank[rank]) or {}
        predicted = predict_phases(name, groups, shape, trace, itemsize, rank, prefetch, gloo,
                                   micro_batches, in_place, cap, terms, reduce, knobs.root_kept_after_forward,
                                   foreach=device.foreach, knobs=knobs, block=device.block)
        judged, reasons, rank_errs = judge_rank(got_phases, int(measured["steady_bytes"][rank]), steady_cats,
                                                 predicted, late)
        reasons = _explained(judged, reasons, (measured.get("born_at_peak_by_rank") or [None] * len(by_rank))[rank])
        reserved = (measured.get("reserved_by_rank") or [None] * len(by_rank))[rank]
        if reserved is not None:  # a CUDA cell: the caching allocator's segments beside allocated
            buffers = steady_buffers_bytes(name, groups, itemsize if terms is None else terms.grad_itemsize, cap, terms)
            blocks = cell_steady_blocks(row, groups, itemsize, knobs, cell.offload, rank,
                                        buffers, device.workspace_bytes, row.family.step_frees_grads(row))
            reading = (measured.get("device_by_rank") or [None] * len(by_rank))[rank]
            reasons += judge_reserved(judged, reserved, blocks, predicted,
                                      bool(reading and reading.get("expandable_segments")))
            reasons += judge_device(judged, reading)
        out_reasons += [r.prefixed(f"rank {rank} ") for r in reasons]
        errs += rank_errs
        ranks.append({"rank": rank, "check": Verdict.passed_if(not reasons),
                      **{ph: {k: rec[k] for k in ("measured_bytes", "predicted_bytes", "check", "late_free", "in_range",
                                                  "explained")
                              if k in rec} for ph, rec in judged.items() if ph != "steady"}})
        if rank == worst_rank:
            judged["steady"]["predicted_buffers_bytes"] = steady_buffers_bytes(  # DDP's: the grads' dtype
                name, groups, itemsize if terms is None else terms.grad_itemsize, cap)
            phases = judged
    source = row.family.peak_source
    out = {"rank": worst_rank, "model": f"peak model, gradient flow '{flow_of(name)}' ({source})",
           "trace": traced, "phases": phases, "ranks": ranks, "max_rel_err": max((e for e, _ in errs), default=None),
           "max_rel_err_modelled": max((e for e, late in errs if not late), default=None),
           "tolerance": TOLERANCE, **Check.failed_if(out_reasons).fields()}
    return as_simulated(out) if measured.get("simulated") else out


def _explained(judged: dict[str, Any], reasons: list[Reason], born: dict[str, Any] | None) -> list[Reason]:
    """Each FAILed phase above its prediction broken down at its peak (zeroexp.plan.check.memory_excess): the record
    gains ``explained``, the phase's reason the residual in words."""
    out = []
    for reason in reasons:
        phase = reason.text.split(":", 1)[0]
        rec = judged.get(phase)
        told = explain_excess(rec, (born or {}).get(phase)) if rec and rec["measured_bytes"] > rec["predicted_bytes"] \
            else None
        if told is not None:
            rec["explained"] = told
            reason = Reason(reason.code, f"{reason.text}; {excess_sentence(told)}")
        out.append(reason)
    return out
