"""Reserved memory on CUDA: a rank's live bytes as the caching allocator's blocks, a CUDA cell's reserved bytes per
phase (``torch.cuda.max_memory_reserved``) beside the model of them (:mod:`zeroexp.formulas.peak.allocator`), and the
device's whole use as ``nvidia-smi`` counts it: reserved + NCCL's buffers + the CUDA context
(:mod:`zeroexp.formulas.device_memory`)."""

from __future__ import annotations

from typing import Any

from zeroexp.formulas import Groups, PlanKnobs, StateLayout, rank_state_bytes, step_collectives
from zeroexp.formulas.device import DeviceSemantics
from zeroexp.formulas.device_memory import communicators, context_bytes, nccl_bytes
from zeroexp.formulas.peak.allocator import allocations, reserved_peak
from zeroexp.formulas.device import TRAINING_HANDLES
from zeroexp.results.verdict import Code, Reason, Verdict

__all__ = ["steady_blocks", "cell_steady_blocks", "judge_reserved", "judge_device", "device_terms"]


def steady_blocks(param: int, grad: int, optim: int, buffers: int, workspace_bytes: int) -> dict[str, int]:
    """A rank's steady state as the caching allocator's blocks (:func:`zeroexp.formulas.peak.allocator.reserved_peak`),
    by
    the peak model's categories: its parameters, gradients and optimizer state (masters with it) each one block, the
    steady buffers one, and each training thread's cuBLAS workspace one (``workspace_bytes``: all of them)."""
    blocks = {"parameters": param, "gradients": grad, "optimizer_state": optim, "buffers": buffers}
    return {**blocks, **{f"workspace{i}": workspace_bytes // TRAINING_HANDLES for i in range(TRAINING_HANDLES)}}


def cell_steady_blocks(layout: StateLayout, groups: Groups, itemsize: int, knobs: PlanKnobs, offload: str,
                       rank: int, buffers: int, workspace_bytes: int, frees_grads: bool = False) -> dict[str, int]:
    """:func:`steady_blocks` of rank ``rank`` of a cell: its model state (``rank_state_bytes``, physical; without
    gradients where the step frees them, ``frees_grads``: DeepSpeed stages 1-2), its steady ``buffers`` and the
    device's workspaces."""
    state = rank_state_bytes(layout, groups, itemsize, knobs, offload)
    held = {k: state[k][rank][1] if k in state else 0 for k in ("param", "grad", "optim", "master")}
    return steady_blocks(held["param"], 0 if frees_grads else held["grad"], held["optim"] + held["master"], buffers,
                         workspace_bytes)


def judge_reserved(judged: dict[str, Any], reserved: dict[str, Any], blocks: dict[str, int],
                    predicted: dict[str, dict], expandable: bool = False) -> list[Reason]:
    """A CUDA cell's reserved bytes per phase (``max_memory_reserved``, the probe's ``reserved_by_rank``) beside the
    caching allocator's model of the same step (:func:`zeroexp.formulas.peak.allocator.reserved_peak`; segments are
    cached, so every phase of a step after the first reads the step's whole reserved figure). A lower bound: PASS
    when the prediction does not exceed the measurement (fragmentation, the side streams' own free blocks, NCCL's
    use of the allocator are not modelled); why not, otherwise. ``expandable``: the cell's ranks ran with
    ``expandable_segments`` (its device reading says so)."""
    want = reserved_peak(blocks, [allocations(predicted[ph]) for ph in predicted], expandable=expandable)[0]
    reasons = []
    for ph, got in reserved["phases"].items():
        if ph not in judged:
            continue
        ok = want <= int(got)
        judged[ph].update(predicted_reserved_bytes=want, measured_reserved_bytes=int(got),
                          reserved_check=Verdict.passed_if(ok))
        if not ok:
            reasons.append(Reason(Code.MEMORY_RESERVED_BELOW_PREDICTION, f"{ph}: measured {int(got)} B reserved, "
                                  f"predicted at least {want} B (the caching allocator's segments for the modelled "
                                  "live bytes)"))
    judged["steady"]["measured_reserved_bytes"] = int(reserved["steady_bytes"])
    return reasons


def device_terms(layout: StateLayout, groups: Groups, itemsize: int, knobs: PlanKnobs, device: DeviceSemantics,
                 reserved: int | None) -> dict[str, Any]:
    """What a CUDA rank of ``layout`` holds beside the caching allocator's ``reserved`` bytes: ``nccl_bytes`` (its
    communicators' buffers, :func:`zeroexp.formulas.device_memory.nccl_bytes`: one per process group the row's
    collectives run over, the default group's and the strategy's clone of it; null where the device has no NCCL
    topology), ``nccl`` (by communicator, and the settings assumed), ``context_bytes`` (the CUDA context; null where
    unknown) and ``device_total_bytes``, the three together (what ``nvidia-smi`` shows; null where one is
    unknown). Nothing on the CPU (all null)."""
    if device.name != "cuda":
        return {"nccl_bytes": None, "nccl": None, "context_bytes": None, "device_total_bytes": None}
    nccl = None
    if device.nccl_topology is not None:
        comms = communicators(step_collectives(layout, groups, itemsize, knobs), groups.world_size,
                              device.nccl_topology.ranks_per_node, layout.family.clones_world)
        nccl = nccl_bytes(comms, device.nccl_topology, device.nccl)
    parts = [reserved, None if nccl is None else nccl["total_bytes"], device.context_bytes]
    return {"nccl_bytes": parts[1], "nccl": nccl, "context_bytes": device.context_bytes,
            "device_total_bytes": None if None in parts else sum(parts)}


def judge_device(judged: dict[str, Any], reading: dict[str, Any] | None) -> list[Reason]:
    """A CUDA cell's whole device as ``nvidia-smi`` counts it (the probe's ``device_by_rank`` reading: NVML's used
    bytes, else ``cudaMemGetInfo``'s) beside the prediction of what it holds at least: the allocator's reserved
    model (``predicted_reserved_bytes`` of :func:`judge_reserved`) and the CUDA context
    (:func:`zeroexp.formulas.device_memory.context_bytes`). NCCL's buffers are not predicted for a cell (its node's
    topology is not known to it: ``nccl_why``); what the device holds beyond the allocator's measured reserved bytes
    (``beyond_allocator_bytes``: NCCL, the context, the kernels loaded) is recorded beside. A lower bound: PASS when
    the prediction does not exceed the reading; nothing judged without a reading."""
    steady = judged["steady"]
    wants = [rec["predicted_reserved_bytes"] for ph, rec in judged.items() if "predicted_reserved_bytes" in rec]
    if reading is None or not wants:
        return []
    used = reading.get("nvml_used_bytes")
    source = "nvml" if used is not None else "cudaMemGetInfo"
    used = int(used if used is not None else reading["cudamem_used_bytes"])
    want = max(wants) + context_bytes()
    reserved = max(int(rec.get("measured_reserved_bytes") or 0) for rec in judged.values())
    ok = want <= used
    steady.update(measured_device_used_bytes=used, device_used_source=source, predicted_device_floor_bytes=want,
                  beyond_allocator_bytes=used - reserved, device_check=Verdict.passed_if(ok),
                  nccl_why="a cell's NCCL topology (channels, NVLS) is not known to it: NCCL's buffers are not "
                           "predicted, only laid beside (beyond_allocator_bytes)")
    if ok:
        return []
    return [Reason(Code.MEMORY_DEVICE_BELOW_PREDICTION, f"device: {source} measured {used} B used, predicted at least "
                   f"{want} B (the allocator's reserved model and the CUDA context)")]
