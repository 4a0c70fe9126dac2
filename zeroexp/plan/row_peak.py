"""One configuration's predicted peak on a device, read through the planner's own functions: what the planner's
table computes per row (``zeroexp.cli.plan``'s peaks and ``zeroexp.plan.core.judge_fits``), for one row, one
micro-batch and one set of axes at a time, so that a search (``zeroexp.recommend``) asks for the peaks it needs and
no more. Every figure is the peak model's (:mod:`zeroexp.plan.check.memory`, docs/planner.md); the step traces are
remembered by their arguments (``zeroexp.plan.check.memory.trace_for``), and the forwards traced for the activations
here
(:func:`forward_trace`), so that configurations that share a model, micro-batch and dtypes trace once, with or
without checkpointing.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from zeroexp.formulas import COMPUTE_ITEMSIZE, LAYOUTS, STATE_KINDS, ModelShape, PlanKnobs, offloaded_kinds
from zeroexp.cell.memo import memoized
from zeroexp.formulas.device import DeviceSemantics
from zeroexp.formulas.peak.checkpointing import mode_of

__all__ = ["row_peak", "activation_bytes", "checkpointed_kept", "forward_trace", "precision_of"]



def _model_key(model_cfg: Any, wrap: list[Any]) -> tuple:
    from omegaconf import OmegaConf

    from zeroexp.models import unit_names

    return (repr(OmegaConf.to_container(model_cfg, resolve=True)) if OmegaConf.is_config(model_cfg) else
            repr(model_cfg), unit_names(wrap))


def forward_trace(model_cfg: Any, batch: int, wrap: list[type], dtype: Any = None, module_dtype: Any = None,
                  policy: Any = None) -> Any:
    """``zeroexp.plan.activations.trace_activations`` remembered by its arguments in this process (an
    ``ActivationTrace`` is read, never changed): the activations with and without checkpointing, the planner's table
    and its peaks read one forward; the module is built once per model config and module dtype
    (``fake_build``) and run at every batch and autocast dtype asked. A model that declares a stack of identical
    blocks deeper than ``DERIVED_ABOVE`` is traced at two, three and four blocks and its trace derived
    (``zeroexp.plan.stack.derived_trace``), or traced whole where the three do not check. ``policy``: a
    ``selective_op`` mode whose policy the trace counts too (``ActivationTrace.unit_policy_bytes``); None else."""
    policy = policy if policy is not None and policy.policy else None
    model = _model_key(model_cfg, wrap)
    key = (*model, int(batch), dtype, module_dtype, policy)  # remembered by what is traced (zeroexp.cell.memo)
    return memoized("forward_traces", key,
                    lambda: _forward_trace(model_cfg, batch, wrap, dtype, module_dtype, model, policy))


def _forward_trace(model_cfg: Any, batch: int, wrap: list[type], dtype: Any, module_dtype: Any, model: tuple,
                   policy: Any = None) -> Any:
    import torch

    from zeroexp.plan.activations import fake_build, trace_activations
    from zeroexp.plan.stack import at_depth, derived_trace, stack_of

    stack, trace = stack_of(model_cfg), None
    if stack is not None:  # a deep stack of identical blocks: from 2, 3 and 4 blocks (zeroexp.plan.stack)
        argument, container, depth = stack
        shallow = [forward_trace(at_depth(model_cfg, argument, d), batch, wrap, dtype, module_dtype, policy)
                   for d in (2, 3, 4)]
        trace = derived_trace(*shallow, depth, container)
    if trace is None:
        cast = module_dtype if module_dtype not in (None, torch.float32) else None
        # one fake build serves every batch and autocast dtype of a model config and module dtype
        build = memoized("fake_builds", (model[0], cast), lambda: fake_build(model_cfg, module_dtype=cast))
        trace = trace_activations(model_cfg, batch, wrap, dtype=dtype, module_dtype=module_dtype, build=build,
                                  policy=policy)
    return trace


def checkpointed_kept(trace: Any, mode: Any) -> int:
    """What the forward of ``trace`` (an ``ActivationTrace``, traced with ``mode``'s policy where it has one) keeps
    for backward under ``mode`` (``zeroexp.formulas.peak.checkpointing.checkpointed_forward_bytes``)."""
    from zeroexp.formulas.peak.checkpointing import checkpointed_forward_bytes

    return checkpointed_forward_bytes(trace.total_bytes, trace.unit_bytes, trace.unit_input_bytes, mode_of(mode),
                                      trace.unit_policy_bytes, list(trace.unit_input_bytes))


def activation_bytes(model_cfg: Any, batch: int, wrap: list[type], param_dtype: str, checkpointing: Any) -> int:
    """What one forward keeps for backward at ``batch`` samples (``zeroexp.plan.activations.trace_activations``, on
    fake tensors): below fp32 the fewer of autocast's and the module cast's (a row without a peak model computes one
    way or the other, as ``judge_fits`` reads them); checkpointed (a ``Checkpointing``, or True: ``full``):
    :func:`checkpointed_kept` of the same."""
    from zeroexp.models import torch_dtype

    mode = mode_of(checkpointing)
    key = (*_model_key(model_cfg, wrap), int(batch), param_dtype, mode)

    def compute() -> int:
        dtype = torch_dtype(param_dtype)
        traces = [forward_trace(model_cfg, batch, wrap, dtype=dtype, policy=mode)]
        if dtype.itemsize < 4:
            traces.append(forward_trace(model_cfg, batch, wrap, module_dtype=dtype, policy=mode))
        return min(checkpointed_kept(t, mode) for t in traces)

    return memoized("activation_bytes", key, compute)


def row_peak(record: dict[str, Any], shape: ModelShape, precision: Any, knobs: PlanKnobs, model_cfg: Any,
             batch: int | None, wrap: list[type], checkpointing: Any, prefetch: str, device: DeviceSemantics,
             memory: int | None, headroom: float | None = None) -> dict[str, Any]:
    """The peak of ``record`` (a ``zeroexp.plan.core.plan_record`` of one row at one world size, precision and
    offload, ``knobs.micro_batches`` the grad_accum) at ``batch`` samples a micro-batch (None, or no ``model_cfg``:
    a parameter count, nothing traced), judged against ``memory`` bytes less ``headroom`` (None: the record's;
    ``zeroexp.plan.core.usable_bytes``; ``judge_fits``: on the peak where the peak
    model covers the row, on cuda its reserved memory, else the model state + gather floor + one forward's
    activations). The planner's table (``zeroexp.cli.plan``) and the search (``zeroexp.recommend``) both read it.
    Returns the record with the fields the planner sets (``peak_bytes``, ``peak_phase``, ``phase_bytes``,
    ``steady_bytes``, ``reserved_peak_bytes``, ``peak_note``, ``activation_bytes`` (the record's where it has one),
    ``row_activation_bytes`` (the one activation figure of the row: its own forward's, autocast's or the module
    cast's as its peak model traces it, ``casts_module``; without a peak model the fewer of the two, what ``fits``
    adds),
    ``workspace_bytes``, ``device_semantics``, ``fits_on``, ``fits_bytes``, ``fits``) and ``by_category``: the bytes
    held at the peak by category (the record's device state kinds, the steady buffers and workspace, the peak
    phase's categories above steady)."""
    from zeroexp.formulas.peak.allocator import allocations, reserved_peak
    from zeroexp.plan.core import judge_fits, row_groups, usable_bytes
    from zeroexp.plan.check.memory import (casts_module, precision_terms_of, shape_limits, steady_buffers_bytes,
                                     step_traces, uncovered, worst_rank_phases)
    from zeroexp.plan.reserved import device_terms, steady_blocks

    name, n, k = record["strategy"], record["world_size"], knobs.micro_batches
    c, dtype = COMPUTE_ITEMSIZE[str(precision.param_dtype)], str(precision.param_dtype)
    traced = batch is not None and model_cfg is not None
    out: dict[str, Any] = {**record, "peak_bytes": None, "peak_phase": None, "phase_bytes": None,
                           "steady_bytes": None, "reserved_peak_bytes": None, "device_semantics": device.name,
                           "workspace_bytes": device.workspace_bytes, "device_memory_bytes": memory}
    out["headroom"] = record["headroom"] if headroom is None else headroom
    out["usable_memory_bytes"] = usable_bytes(memory, out["headroom"])
    out.setdefault("activation_bytes", None)
    out.setdefault("activation_cast_bytes", None)
    row = LAYOUTS[name]
    out["accum_grad_bytes"] = row.family.accumulated_grad_bytes(row, record["grad_bytes"]) if k > 1 else None
    why = uncovered(name, str(precision.name), record["offload"], activation_checkpointing=mode_of(checkpointing).mode,
                    micro_batches=k, sync_each_microbatch=knobs.sync_each_microbatch,
                    reduce_dtype=knobs.reduce_dtype or None, param_dtype=dtype, frozen=bool(shape.frozen))
    if not traced:
        why = why or ["no traced step: give model= and batch_size="]
    groups = None if why else row_groups(name, LAYOUTS[name], shape, n, c, knobs)
    # what the model brings that the peak model does not cover: the same limits as a cell's check (memory_section)
    why = why or (row.family.peak_limits(row, groups, knobs.bucket_cap_bytes,
                                                knobs.recompute_mode or knobs.recompute)
                  + shape_limits(name, shape, groups))
    host = offloaded_kinds(LAYOUTS[name], record["offload"])
    state = {kind: record[f"{kind}_bytes"] for kind in STATE_KINDS if kind not in host}
    if why:
        out["peak_note"] = "; ".join(why)
        if out["activation_bytes"] is None and traced:
            out["activation_bytes"] = activation_bytes(model_cfg, batch, wrap, dtype, checkpointing)
        acts = [a for a in (out["activation_bytes"], out["activation_cast_bytes"]) if a is not None]
        out["row_activation_bytes"] = min(acts) if acts else None  # what judge_fits adds to the state
        out.update(device_terms(row, groups or row_groups(name, row, shape, n, c, knobs), c, knobs, device, None))
        judge_fits(out)
        out["by_category"] = {**state, "gather_floor": record["gather_floor_bytes"] or 0,
                              "activations": out["row_activation_bytes"] or 0, "workspace": device.workspace_bytes}
        return out
    terms = precision_terms_of(name, precision.name, precision.param_dtype)
    cast = out["activation_cast_bytes"] if casts_module(name, dtype, terms) else None
    out["row_activation_bytes"] = out["activation_bytes"] if cast is None else cast  # the row's own forward
    trace, in_place = step_traces(name, model_cfg, batch, wrap, checkpointing, k, dtype, terms, device.block)
    root_kept = knobs.root_kept_after_forward and LAYOUTS[name].gathers_per_unit(True, knobs) == 1
    phases = worst_rank_phases(name, groups, shape, trace, c, prefetch, k, in_place, knobs.bucket_cap_bytes, terms,
                               device, root_kept, knobs)
    top = max(phases, key=lambda ph: phases[ph]["bytes"])
    buffers = steady_buffers_bytes(name, groups, c if terms is None else terms.grad_itemsize, knobs.bucket_cap_bytes,
                                   terms)
    on = {kind: record[f"{kind}_bytes"] or 0 for kind in STATE_KINDS if kind not in host}  # the device's state
    freed = on.get("grad", 0) if row.family.step_frees_grads(row) else 0  # none between steps (offloaded: the host's)
    steady = record["device_bytes"] - freed + buffers + device.workspace_bytes
    out.update(phase_bytes={ph: v["bytes"] for ph, v in phases.items()}, peak_phase=top, steady_bytes=steady,
               peak_bytes=steady + max(phases[top]["bytes"], 0))
    if device.name == "cuda":  # the caching allocator's segments for the same live bytes
        blocks = steady_blocks(on.get("param", 0), on.get("grad", 0) - freed, on.get("optim", 0) + on.get("master", 0),
                               buffers, device.workspace_bytes)
        out["reserved_peak_bytes"] = reserved_peak(blocks, [allocations(v) for v in phases.values()],
                                                   expandable=device.expandable_segments)[0]
    out.update(device_terms(row, groups, c, knobs, device, out["reserved_peak_bytes"]))
    judge_fits(out)
    above = phases[top]["by_category"] if phases[top]["bytes"] > 0 else {}
    out["by_category"] = {**state, "steady_buffers": buffers, "workspace": device.workspace_bytes,
                          **{f"{cat} ({top})": v for cat, v in above.items() if v}}
    return out


def precision_of(name: str, param_dtype: str) -> Any:
    """A precision option as the planner's functions read it (``.name``, ``.param_dtype``)."""
    return SimpleNamespace(name=name, param_dtype=param_dtype)
