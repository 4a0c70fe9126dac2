"""One configuration's predicted peak on a device, read through the planner's own functions: what the planner's
table computes per row (``zeroexp.cli.plan``'s peaks and ``zeroexp.plan.core.judge_fits``), for one row, one
micro-batch and one set of axes at a time, so that a search (``zeroexp.recommend``) asks for the peaks it needs and
no more. Every figure is the peak model's (:mod:`zeroexp.plan.memory`, docs/planner.md); the step traces are
remembered by their arguments (``zeroexp.plan.memory.trace_for``), and the activations of one forward here, so that
configurations that share a model, micro-batch, precision and checkpointing trace once.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from zeroexp.formulas import (COMPUTE_ITEMSIZE, LAYOUTS, STATE_KINDS, ModelShape, PlanKnobs, derive_groups,
                              offloaded_kinds)
from zeroexp.formulas.device import DeviceSemantics

__all__ = ["row_peak", "activation_bytes", "precision_of"]

#: activation_bytes's answers in this process, by their arguments (model config, batch, dtype, checkpointing).
_ACTIVATIONS: dict[tuple, int] = {}


def activation_bytes(model_cfg: Any, batch: int, wrap: list[type], param_dtype: str, checkpointing: bool) -> int:
    """What one forward keeps for backward at ``batch`` samples (``zeroexp.plan.activations.trace_activations``, on
    fake tensors): below fp32 the fewer of autocast's and the module cast's (a row without a peak model computes one
    way or the other, as ``judge_fits`` reads them); checkpointed: ``checkpointed_forward_bytes`` of the same."""
    from omegaconf import OmegaConf

    from zeroexp.formulas.checkpointing import checkpointed_forward_bytes
    from zeroexp.models import torch_dtype
    from zeroexp.plan.activations import trace_activations

    key = (repr(OmegaConf.to_container(model_cfg, resolve=True)) if OmegaConf.is_config(model_cfg) else
           repr(model_cfg), int(batch), tuple(c.__qualname__ for c in wrap), param_dtype, bool(checkpointing))
    if key not in _ACTIVATIONS:
        dtype = torch_dtype(param_dtype)
        traces = [trace_activations(model_cfg, batch, wrap, dtype=dtype)]
        if dtype.itemsize < 4:
            traces.append(trace_activations(model_cfg, batch, wrap, module_dtype=dtype))
        _ACTIVATIONS[key] = min(checkpointed_forward_bytes(t.total_bytes, t.unit_bytes, t.unit_input_bytes)
                                if checkpointing else t.total_bytes for t in traces)
    return _ACTIVATIONS[key]


def row_peak(record: dict[str, Any], shape: ModelShape, precision: Any, knobs: PlanKnobs, model_cfg: Any,
             batch: int, wrap: list[type], checkpointing: bool, prefetch: str, device: DeviceSemantics,
             budget: int) -> dict[str, Any]:
    """The peak of ``record`` (a ``zeroexp.plan.core.plan_record`` of one row at one world size, precision and
    offload, ``knobs.micro_batches`` the grad_accum) at ``batch`` samples a micro-batch, judged against ``budget``
    bytes (``judge_fits``: on the peak where the peak model covers the row, else the model state + gather floor +
    one forward's activations). Returns the record's fields the planner sets (``peak_bytes``, ``peak_phase``,
    ``phase_bytes``, ``steady_bytes``, ``peak_note``, ``activation_bytes``, ``workspace_bytes``, ``fits_on``,
    ``fits_bytes``, ``fits``) and ``by_category``: the bytes held at the peak by category (the record's device
    state kinds, the steady buffers and workspace, the peak phase's categories above steady)."""
    from zeroexp.formulas.accumulation import ACCUMULATING_FLOWS, accumulated_grad_bytes
    from zeroexp.plan.core import judge_fits
    from zeroexp.plan.memory import (cell_precision_terms, flow_of, steady_buffers_bytes,
                                     step_traces, uncovered, worst_rank_phases)
    from zeroexp.plan.peak_deepspeed import ds_peak_limits

    name, n, k = record["strategy"], record["world_size"], knobs.micro_batches
    c, dtype = COMPUTE_ITEMSIZE[precision.param_dtype], precision.param_dtype
    out: dict[str, Any] = {**record, "peak_bytes": None, "peak_phase": None, "phase_bytes": None,
                           "steady_bytes": None, "activation_bytes": None, "activation_cast_bytes": None,
                           "workspace_bytes": device.workspace_bytes, "device_memory_bytes": budget}
    flow = flow_of(name)
    out["accum_grad_bytes"] = (accumulated_grad_bytes(flow, record["grad_bytes"]) if k > 1 and flow in
                               ACCUMULATING_FLOWS else None)
    why = uncovered(name, precision.name, record["offload"], activation_checkpointing="full" if checkpointing
                    else "none", micro_batches=k)
    groups = None if why else derive_groups(name, LAYOUTS[name], shape, n, c, knobs)
    why = why or ds_peak_limits(name, groups, knobs.bucket_cap_bytes)
    host = offloaded_kinds(LAYOUTS[name], record["offload"])
    state = {kind: record[f"{kind}_bytes"] for kind in STATE_KINDS if kind not in host}
    if why:
        out["peak_note"] = "; ".join(why)
        out["activation_bytes"] = activation_bytes(model_cfg, batch, wrap, dtype, checkpointing)
        judge_fits(out)
        out["by_category"] = {**state, "gather_floor": record["gather_floor_bytes"] or 0,
                              "activations": out["activation_bytes"], "workspace": device.workspace_bytes}
        return out
    terms = cell_precision_terms(name, SimpleNamespace(precision=precision))
    trace, in_place = step_traces(name, model_cfg, batch, wrap, checkpointing, k, dtype, terms)
    phases = worst_rank_phases(name, groups, shape, trace, c, prefetch, k, in_place, knobs.bucket_cap_bytes, terms,
                               device)
    top = max(phases, key=lambda ph: phases[ph]["bytes"])
    buffers = steady_buffers_bytes(name, groups, c if terms is None else terms.grad_itemsize, knobs.bucket_cap_bytes,
                                   terms)
    steady = record["device_bytes"] + buffers + device.workspace_bytes
    out.update(phase_bytes={ph: v["bytes"] for ph, v in phases.items()}, peak_phase=top, steady_bytes=steady,
               peak_bytes=steady + max(phases[top]["bytes"], 0))
    judge_fits(out)
    above = phases[top]["by_category"] if phases[top]["bytes"] > 0 else {}
    out["by_category"] = {**state, "steady_buffers": buffers, "workspace": device.workspace_bytes,
                          **{f"{cat} ({top})": v for cat, v in above.items() if v}}
    return out


def precision_of(name: str, param_dtype: str) -> Any:
    """A precision option as the planner's functions read it (``.name``, ``.param_dtype``)."""
    return SimpleNamespace(name=name, param_dtype=param_dtype)
