"""Steady and peak memory per rank: ``memory.csv`` and ``summary.json[memory]``.

``steady`` is what a rank holds at the optimizer boundary (``on_train_batch_end``, after ``optimizer.step``)
of the last memory-tracked step; ``peak`` is the highest allocation during the memory-tracked steps
(``Schedule.memory_tracked``: after warm-up, so the model is wrapped and the optimizer state exists, and
after the profiled steps). The peak is reset at the start of each tracked step, so it is a *training* peak:
the construction of the full model on every rank and the wrapping are not in it. During a tracked step Python's
cycle collector runs only at its start and at each phase's end (see :class:`_Collector`): garbage that only a
reference cycle keeps alive is not state, and counting it made steady and the phase peaks depend on when the
collector happened to run. With ``grad_accum=K`` a tracked step spans its K micro-batches
(``zeroexp.rank.microbatches``): each micro-batch has a forward and a backward phase (the backward ending where the next
micro-batch starts, so it holds what the strategy's ``no_sync`` exit does), a phase's peak is the highest over them,
and MemTracker's per-module state is reset between them (it refuses a root module's second forward in one tracking).

Sources (``memory.source`` names the one used):

- CUDA: the caching allocator's statistics (``memory_allocated``, ``max_memory_allocated`` after
  ``reset_peak_memory_stats``). No categories.
- CPU: torch has no CPU allocator statistics, so every tensor storage is followed with
  ``torch.distributed._tools.MemTracker`` (a ``TorchDispatchMode``): at the start of a tracked step every live
  tensor (found by the garbage collector) is registered, then each op's outputs, resizes and frees are
  followed. Categories are MemTracker's (parameters, buffers, gradients, activations, temporaries, optimizer
  state, other) and zeroexp's ``unsharded`` (FSDP units gathered) and ``comm`` (collective buffers), named by the
  collectives a storage meets (``zeroexp._lib.memtrack``; each phase's peak categories are read at the step's end, when
  every storage alive at that peak has its name). Memory that never passes through a tensor op while tracked (gloo's
  internal buffers) is not seen; DDP's C++ gradient buckets are seen once all-reduced in the step. With FSDP1 and
  ``use_orig_params=True`` MemTracker cannot hook the non-leaf parameter views, so hooks are skipped there.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pandas as pd
import torch
from torch import nn

from zeroexp.formulas.peak.phases import PHASES
from zeroexp._lib.memtrack import born_at_peak as _born_at_peak, step_mem_tracker as _step_mem_tracker, \
    totals as _totals
from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.results.format import NA, byte_unit, missing
from zeroexp.results.section import Column, ReportTable, raw_rows
from zeroexp.cell.schedule import PROBE_STEPS

__all__ = ["MemoryProbe", "PEAK_MEANING", "PHASES", "freeze_startup_objects", "memory_source"]

PEAK_MEANING = (
    "peak_bytes is a training peak: the highest allocation during the memory-tracked steps, reset after the "
    "model was wrapped and the optimizer state existed; it does not include building and wrapping the model, "
    "so it does not prove that a model can be initialised in that memory."
)
#: ``PHASES`` (defined beside the peak model that predicts them): the phases of a training step, in order, each
#: ending at a Lightning hook: ``forward`` (the training step's forward and zero_grad; ends at ``on_before_backward``),
#: ``backward`` (backward with the strategy's gradient collectives, unscaling and clipping; ends at
#: ``on_before_optimizer_step``), ``optimizer`` (the optimizer's step: the update, and what a strategy does inside it:
#: zero1/zero2's reduce-scatter and all-gather, DeepSpeed's ``engine.step``; ends at ``on_train_batch_end``). A phase
#: whose hook never fires merges into the next.
LAST_PHASE = PHASES[-1]
#: The longest the memory probe waits at a tracked step's end for what gloo's worker threads still hold (``_settle``).
SETTLE_S = 0.2


class _Collector:
    """Python's cycle collector, held still during a tracked step: collected at its start and at each phase's
    end, never in between. Tensors that only a reference cycle keeps alive (autograd and FSDP hooks make some)
    are freed when the collector runs; left to run on its own, it ran at random points, and steady and the phase
    peaks changed by one FSDP unit's unsharded gradient from run to run."""

    def __init__(self) -> None:
        self._was_enabled: bool | None = None

    def hold(self) -> None:
        gc.collect()
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
        gc.disable()

    def collect(self) -> None:
        gc.collect()

    def release(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


class _CudaAllocator:
    """CUDA caching allocator statistics, the peak reset at each tracked step's start and at each phase's end."""

    source = ("torch.cuda caching allocator: memory_allocated (steady), max_memory_allocated (peak); "
              "memory_reserved, max_memory_reserved (reserved)")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._phases: dict[str, tuple[int, dict[str, int]]] = {}
        self._reserved: dict[str, int] = {}
        self._gc = _Collector()

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._gc.hold()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._phases, self._reserved = {}, {}

    def before_optimizer_update(self) -> None:
        pass

    def phase_end(self, phase: str) -> None:
        """Record the peak of the phase that ends now; the next phase's peak starts from the current bytes."""
        torch.cuda.synchronize(self.device)
        _keep_higher(self._phases, phase, (int(torch.cuda.max_memory_allocated(self.device)), {}))
        # segments are cached: the reserved peak of a phase is what the allocator held at most by its end
        self._reserved[phase] = max(self._reserved.get(phase, 0), int(torch.cuda.max_memory_reserved(self.device)))
        self._gc.collect()
        torch.cuda.reset_peak_memory_stats(self.device)

    def next_micro_batch(self) -> None:
        """Nothing to reset: the allocator's statistics know no modules."""

    def current_bytes(self) -> int:
        """Bytes allocated now (between ``begin`` and ``end``)."""
        return int(torch.cuda.memory_allocated(self.device))

    def end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        self.phase_end(LAST_PHASE)  # collects: steady is read after the collector ran
        torch.cuda.synchronize(self.device)
        steady = int(torch.cuda.memory_allocated(self.device))
        self._gc.release()
        return {"steady": steady, "steady_categories": {}, **_peak_of_phases(self._phases),
                "steady_reserved": int(torch.cuda.memory_reserved(self.device)), "phase_reserved": dict(self._reserved),
                "compute_capability": float("{}.{}".format(*torch.cuda.get_device_capability(self.device))),
                "device": device_reading(self.device)}

    def abort(self) -> None:
        self._gc.release()


#: The caching allocator's counters a CUDA cell records beside its peaks (``torch.cuda.memory_stats``).
ALLOCATOR_STATS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "inactive_split_bytes.all.peak",
                   "reserved_bytes.all.peak", "allocated_bytes.all.peak")


def device_reading(device: torch.device) -> dict[str, Any]:
    """The device's whole use after the tracked steps, as ``nvidia-smi`` counts it: NVML's used bytes
    (``torch.cuda.device_memory_used``; null where NVML is not importable, ``nvml_why``), ``cudaMemGetInfo``'s total
    less free (``torch.cuda.mem_get_info``), the allocator's mode this process runs (``expandable_segments``, from
    ``PYTORCH_CUDA_ALLOC_CONF``), the caching allocator's counters (:data:`ALLOCATOR_STATS`) and NCCL's
    own bytes where torch exposes them (it does not: null, ``nccl_why``). Both device readings count the whole GPU:
    every process on it and the driver's own reservation."""
    from zeroexp.devices import runs_expandable

    free, total = torch.cuda.mem_get_info(device)
    out: dict[str, Any] = {"cudamem_used_bytes": int(total - free), "total_bytes": int(total), "nvml_used_bytes": None,
                           "expandable_segments": runs_expandable(),
                           "nccl_bytes": None, "nccl_why": "torch exposes no NCCL memory figure (NCCL_DEBUG=INFO "
                           "NCCL_DEBUG_SUBSYS=ALLOC logs its allocations)"}
    try:
        out["nvml_used_bytes"] = int(torch.cuda.device_memory_used(device))
    except Exception as e:  # noqa: BLE001 - NVML (pynvml) missing or failing: the reading says why
        out["nvml_why"] = f"{type(e).__name__}: {e}"
    stats = torch.cuda.memory_stats(device)
    out["allocator_stats"] = {k: int(stats[k]) for k in ALLOCATOR_STATS if k in stats}
    return out


def _keep_higher(phases: dict[str, tuple[int, dict[str, int]]], phase: str, got: tuple[int, dict[str, int]]) -> None:
    """Record a phase's peak; with ``grad_accum=K`` each phase recurs once per micro-batch and keeps its highest."""
    if phase not in phases or got[0] > phases[phase][0]:
        phases[phase] = got


def _peak_of_phases(phases: dict[str, tuple[int, dict[str, int]]]) -> dict[str, Any]:
    """The step's peak (the largest phase peak; ties: the earliest phase), its phase and categories, every
    phase's peak."""
    top = max(phases, key=lambda ph: phases[ph][0])  # dicts keep the phases' order; max keeps the first tie
    return {"peak": phases[top][0], "peak_categories": phases[top][1], "peak_phase": top,
            "phase_peaks": {ph: total for ph, (total, _) in phases.items()},
            "phase_categories": {ph: cats for ph, (_, cats) in phases.items()}}


#: Weak references to the tensors alive when :func:`freeze_startup_objects` ran: the collector no longer lists them.
_FROZEN_TENSORS: list[Any] = []


def freeze_startup_objects() -> None:
    """Move every object alive now (the imports: ~400k objects) to the collector's permanent generation, once, before
    the rank builds anything: each of the tracked steps' collections then walks only what the rank created (about
    0.2 s less each on a quiet 2-core host, a second under load), and the scan below only those objects. The tensors
    alive now are still found (weakly referenced here): the tracked set is the same as without the freeze."""
    import weakref

    _FROZEN_TENSORS.extend(weakref.ref(o) for o in gc.get_objects() if isinstance(o, torch.Tensor))
    gc.freeze()


def _live_tensors_and_optimizers() -> tuple[list[torch.Tensor], list[torch.optim.Optimizer]]:
    """Every strided, non-meta tensor and every optimizer the garbage collector can see in this process (and those
    frozen by :func:`freeze_startup_objects` that are still alive)."""
    tensors, optimizers = [], []
    frozen = [t for t in (ref() for ref in _FROZEN_TENSORS) if t is not None]
    for obj in [*gc.get_objects(), *frozen]:
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.strided and not obj.is_meta:
                tensors.append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            optimizers.append(obj)
    return tensors, optimizers


def _trackable(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers MemTracker can walk: ZeroRedundancyOptimizer.load_state_dict leaves None in the wrapper's
    state for parameters other ranks own (its local optimizer, tracked too, holds the real state)."""
    return [o for o in optimizers if all(isinstance(s, dict) for s in o.state.values())]


class _TensorTracker:
    """MemTracker around one step, with every live tensor registered first (CPU).

    New allocations are labelled by where they happen: forward -> activations, backward -> temporaries,
    between ``on_before_optimizer_step`` and the step's end -> optimizer state; a collective's buffer -> unsharded or
    comm, from its allocation. At the step's end the model and the optimizers are registered again, so this step's
    gradients and state carry their own labels (``settle``: a reduce-scatter's output kept as the sharded gradient
    is a gradient).
    """

    source = ("torch.distributed._tools.MemTracker: tensor storages followed through the dispatcher, every live "
              "tensor registered at the tracked step's start")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mt: Any = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._gc = _Collector()

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._mt = _step_mem_tracker()
        self._gc.hold()  # garbage awaiting the cycle collector is not held memory: do not register it
        tensors, self._optimizers = _live_tensors_and_optimizers()
        self._mt.track_external(*tensors)  # as "other"; the model and optimizers below re-label theirs
        del tensors  # the tracker holds weak references only: freed storages must leave the count
        self._mt.track_external(model, *_trackable(self._optimizers))
        self._start = self._held_bytes()  # the previous step's boundary, as registered
        self._mt.__enter__()

    def before_optimizer_update(self) -> None:
        if self._mt is not None:
            self._mt.set_in_optimizer_update(True)

    def phase_end(self, phase: str) -> None:
        """Close the phase that ends now (its peak's categories are read at the step's end: a storage alive at the
        peak may be named ``unsharded`` or ``comm`` later in the step); the next phase's peak starts from the bytes
        alive now. No-op when not tracking."""
        if self._mt is not None:
            self._mt.close_phase(phase)  # with grad_accum=K a phase recurs per micro-batch: its highest is kept
            self._gc.collect()  # the next phase starts without the cycles' garbage
            self._mt.reset_peak()

    def next_micro_batch(self) -> None:
        """Between two micro-batches of one optimizer step: forget the modules' per-iteration state (MemTracker
        refuses a root module's second forward otherwise); the storages, their labels and the peak are kept."""
        if self._mt is not None:
            self._mt.reset_mod_stats()

    def current_bytes(self) -> int:
        """Bytes of the tracked storages alive now (between ``begin`` and ``end``)."""
        return _totals(self._mt.get_tracker_snapshot("current"), self.device.type)[0]

    def end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        mt = self._mt
        self.phase_end(LAST_PHASE)  # collects: storages only kept by reference cycles leave the count now
        settle_ms = self._settle()
        mt.set_in_optimizer_update(False)
        mt.settle()  # model state wins from here: a reduce-scatter's output kept as the sharded gradient
        mt.track_external(model, *_trackable(self._optimizers))  # label this step's new gradients and optimizer state
        steady, steady_cats = _totals(mt.get_tracker_snapshot("current"), self.device.type)
        peaks = _peak_of_phases({ph: _totals(snap, self.device.type) for ph, (snap, _) in mt.phases.items()})
        born = {ph: _born_at_peak(mt, ph) for ph in mt.phases}  # what the step made, alive at each phase's peak
        self.abort()
        return {"steady": steady, "steady_categories": steady_cats, "settle_ms": settle_ms, **peaks,
                "born_at_peak": born}

    def _settle(self) -> float:
        """Wait (at most ``SETTLE_S``) while the rank holds more than at the step's start, activations aside (the
        step's loss and the loop's copy of it, released after the step's end): a tensor only gloo's worker
        thread still references (a finished work object's, e.g. the reduced copy a reduce_scatter hands back) is freed
        when that thread drops the work, which under load came after the step's end (once in CI: steady 128 KiB high).
        A step after warm-up ends holding what it started with; one that grows (zeroexp's ZeRO below fp32 after a
        profiled step, which waited for its all-gather inputs) is read after the bound. The milliseconds waited."""
        t0 = time.perf_counter()
        while self._held_bytes() > self._start and time.perf_counter() - t0 < SETTLE_S:
            time.sleep(0.001)  # releases the GIL: the worker thread's release runs the tracker's free callback
        return round((time.perf_counter() - t0) * 1e3, 3)

    def _held_bytes(self) -> int:
        """Bytes of the tracked storages alive now, less those labelled activations."""
        total, cats = _totals(self._mt.get_tracker_snapshot("current"), self.device.type)
        return total - cats["activations"]

    def abort(self) -> None:
        if self._mt is not None:
            self._mt.__exit__(None, None, None)
        self._mt, self._optimizers = None, []
        self._gc.release()


def memory_source(device: torch.device) -> "_CudaAllocator | _TensorTracker":
    """The tracker for ``device``: ``begin(model, optimizer)``, ``phase_end(phase)``, ``next_micro_batch()``,
    ``current_bytes()``, ``end(...)`` -> ``{"steady", "peak", "steady_categories", "peak_categories"}``, ``abort()``;
    ``source`` names it."""
    return _CudaAllocator(device) if device.type == "cuda" else _TensorTracker(device)


def memory_table(ok: pd.DataFrame) -> ReportTable:
    """Steady bytes at the optimizer boundary, the training peak, the difference, the peak of each phase of the
    step and the phase the peak falls in (the largest rank's each)."""
    phases = PHASES
    keys = ["memory.steady_bytes_max", "memory.peak_bytes_max", "memory.peak_minus_steady_max",
            *(f"memory.phase_peak_bytes_max.{ph}" for ph in phases)]
    raw = raw_rows(ok, keys + ["memory.peak_phase_of_max_rank", "memory.source"])
    unit = byte_unit(v for k in keys for v in raw[k])
    cols = [Column("cell", "label", str), Column(f"steady {unit}", keys[0], unit),
            Column(f"peak {unit}", keys[1], unit), Column(f"peak - steady {unit}", keys[2], unit),
            *(Column(f"{ph} peak {unit}", key, unit) for ph, key in zip(phases, keys[3:])),
            Column("peak in", "memory.peak_phase_of_max_rank")]
    planned = [f"plan.memory.phases.{ph}.{f}" for ph in phases for f in ("predicted_bytes", "measured_bytes")]
    extra = raw_rows(ok, [*planned, "plan.memory.check"])
    model_note = ""
    if any(not missing(v) for k in planned for v in extra[k]):  # the peak model's prediction beside the measurement
        punit = byte_unit(v for k in planned for v in extra[k])
        raw["planned peak"] = [  # the phase of the measured peak
            NA if missing(ph) or missing(row.get(f"plan.memory.phases.{ph}.predicted_bytes")) else
            f"{punit(row[f'plan.memory.phases.{ph}.predicted_bytes'])} / "
            f"{punit(row[f'plan.memory.phases.{ph}.measured_bytes'])}"
            for ph, (_, row) in zip(raw["memory.peak_phase_of_max_rank"], extra.iterrows())]
        raw["plan.memory.check"] = extra["plan.memory.check"]
        cols += [Column(f"model P / M {punit}", "planned peak", str), Column("model", "plan.memory.check")]
        model_note = (f" Model P / M: the peak phase's bytes above steady in {punit}, the peak model's (computed, "
                      "summary.json plan.memory, every phase there) beside the measurement; model: its check (the "
                      "prediction at most 2 % below the measurement and never above it, or the excess one named "
                      "tensor gloo freed late; n/a: no model for the cell).")
    sources = sorted({str(s).split(":")[0] for s in raw["memory.source"] if not missing(s)})
    note = (f"Largest rank of each, in {unit}. Steady: what a rank holds at the optimizer boundary; peak: the highest "
            "allocation during the memory-tracked steps (a training peak: building and wrapping the model are not "
            "in it). Phase peaks: the highest allocation within forward (to on_before_backward), backward (with the "
            "gradient collectives, to on_before_optimizer_step) and the optimizer step; 'peak in' names the phase "
            "of the peak. A peak in the optimizer step is what the step allocates (AdamW's update temporaries; "
            "zero1/zero2's and DeepSpeed's gradient reduction run there too): the activations are freed by then. "
            f"Source: {'; '.join(sources) or NA}.{model_note}")
    return ReportTable("memory", "Steady and peak memory", raw, cols, note)


def memory_line(m: dict[str, Any]) -> str:
    unit = byte_unit([m.get("steady_bytes_max"), m.get("peak_bytes_max")])
    phase = m.get("peak_phase_of_max_rank")
    return (("simulated (dry run), " if m.get("simulated") else "")
            + f"largest rank: steady {unit(m.get('steady_bytes_max'))} {unit}, peak {unit(m.get('peak_bytes_max'))} "
            f"{unit}" + ("" if missing(phase) else f" (in {phase})"))


#: What the memory probe's figures mean in a traced dry run.
SIMULATED = ("simulated: rank 0's steps under FakeTensorMode and a fake process group, tracked by the memory probe's "
             "MemTracker (fake storages, nothing allocated); the backend's own buffers (gloo's or NCCL's copies) are "
             "not in it: the fake process group makes none")


class MemoryProbe(Probe):
    """Steady bytes at the optimizer boundary and the training peak of each memory-tracked step, per rank."""

    name = "memory"
    order = 40
    report_order = 25  # in the report, beside the state table
    steps = PROBE_STEPS["memory"]  # declared in zeroexp.cell.schedule
    dry_run_absent = "no real memory: no tensor is allocated, and the fake process group moves no bytes"

    digest_line = staticmethod(memory_line)
    report_table = staticmethod(memory_table)

    @classmethod
    def in_dry_run(cls, cell) -> bool:
        """A traced dry run tracks one micro-batch a step (MemTracker refuses a second forward in one tracked step,
        as in a real run): its phase peaks are a simulation (:data:`SIMULATED`)."""
        return cell.grad_accum == 1

    @classmethod
    def dry_report(cls, results: list[dict[str, Any]], cell, source: str) -> ProbeReport | None:
        """A traced dry run's phase peaks, marked simulated; absent otherwise (:attr:`dry_run_absent`)."""
        if source != "traced" or not results or not (results[0] or {}).get("records"):
            return None
        report = cls.aggregate(results, cell)
        return ProbeReport({**report.section, "source": SIMULATED, "simulated": True},
                           {"memory.csv": report.tables["memory.csv"]})

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.source = memory_source(ctx.device)
        self.records: list[dict[str, Any]] = []
        self._open = False  # inside a memory-tracked step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._open = batch_idx in self.ctx.schedule.memory_tracked
        if self._open:
            self.source.begin(trainer.strategy.model, trainer.optimizers[0])

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._open:
            self.source.phase_end("forward")

    def on_micro_batch_start(self, trainer, pl_module, batch, step, micro) -> None:
        """``grad_accum=K``: micro-batch ``micro`` (1 .. K-1) of the step starts; the previous one's backward (with
        what its ``no_sync`` exit did) ends here. Each phase's peak is the highest over the step's micro-batches."""
        if self._open:
            self.source.phase_end("backward")
            self.source.next_micro_batch()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._open:
            self.source.phase_end("backward")
            self.source.before_optimizer_update()  # after backward, before the update

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._open:
            self._open = False
            self.records.append({"step": batch_idx, **self.source.end(trainer.strategy.model, trainer.optimizers[0])})

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.source.abort()  # never leave a dispatch mode pushed on a failing rank

    def rank_result(self) -> dict[str, Any]:
        return {"source": self.source.source, "records": self.records}

    @classmethod
    def aggregate(cls, results, cell) -> ProbeReport:
        rows, picked = [], []  # per rank: (the last tracked step, the step of the highest peak)
        for rank, res in enumerate(results):
            records = res["records"]
            last = records[-1]  # steady: the boundary of the last tracked step
            top = max(reversed(records), key=lambda rec: rec["peak"])  # ties: the latest, as for steady
            row = {"rank": rank, "steady_bytes": last["steady"], "peak_bytes": top["peak"],
                   "peak_minus_steady_bytes": top["peak"] - last["steady"], "peak_step": top["step"],
                   "peak_phase": top["peak_phase"], "settle_ms": max(rec.get("settle_ms", 0.0) for rec in records)}
            row.update({f"{ph}_peak_bytes": top["phase_peaks"].get(ph) for ph in PHASES})
            row.update({f"steady_{c}_bytes": b for c, b in last["steady_categories"].items()})
            row.update({f"peak_{c}_bytes": b for c, b in top["peak_categories"].items()})
            rows.append(row)
            picked.append((last, top))
        frame = pd.DataFrame(rows)
        worst = int(frame.peak_bytes.idxmax())
        section = {
            "source": results[0]["source"],
            "steady_bytes_max": int(frame.steady_bytes.max()),
            "peak_bytes_max": int(frame.peak_bytes.max()),
            "peak_minus_steady_max": int(frame.peak_minus_steady_bytes.max()),
            "steady_bytes": [int(v) for v in frame.steady_bytes],
            "peak_bytes": [int(v) for v in frame.peak_bytes],
            "peak_minus_steady_bytes": [int(v) for v in frame.peak_minus_steady_bytes],
            "tracked_steps": [rec["step"] for rec in results[0]["records"]],
            "peak_phase_of_max_rank": str(frame.peak_phase[worst]),
            "phase_peak_bytes_max": {ph: int(frame[f"{ph}_peak_bytes"].max())
                                     for ph in PHASES if frame[f"{ph}_peak_bytes"].notna().any()},
            "peak_kind": "training",
            "peak_meaning": PEAK_MEANING,
        }
        last, top = picked[worst]
        if top["peak_categories"]:
            section["peak_categories_of_max_rank"] = {c: int(b) for c, b in top["peak_categories"].items()}
        section["max_rank"] = worst
        section["steady_categories_of_max_rank"] = {c: int(b) for c, b in last["steady_categories"].items()}
        def phases_of(top: dict[str, Any]) -> dict[str, Any]:
            return {ph: {"peak_bytes": int(top["phase_peaks"][ph]),
                         "by_category": {c: int(b) for c, b in top.get("phase_categories", {}).get(ph, {}).items()}}
                    for ph in PHASES if ph in top["phase_peaks"]}

        if "phase_reserved" in top:  # the CUDA allocator's reserved bytes, beside allocated
            section["reserved_of_max_rank"] = {"steady_bytes": int(last["steady_reserved"]),
                                               "phases": {ph: int(b) for ph, b in top["phase_reserved"].items()}}
            section["reserved_by_rank"] = [{"steady_bytes": int(lt["steady_reserved"]),
                                            "phases": {ph: int(b) for ph, b in t["phase_reserved"].items()}}
                                           for lt, t in picked]
            section["compute_capability"] = top["compute_capability"]
            if all("device" in t for _, t in picked):  # the whole device, as nvidia-smi counts it (device_reading)
                section["device_by_rank"] = [t["device"] for _, t in picked]
        section["phases_of_max_rank"] = phases_of(top)
        section["phases_by_rank"] = [phases_of(t) for _, t in picked]  # every rank's, for the plan's per-rank check
        section["steady_categories_by_rank"] = [{c: int(b) for c, b in lt["steady_categories"].items()}
                                                for lt, _ in picked]
        if all("born_at_peak" in t for _, t in picked):  # CPU: what each rank's step made, alive at each phase's peak
            section["born_at_peak_by_rank"] = [t["born_at_peak"] for _, t in picked]
        return ProbeReport(section=section, tables={"memory.csv": frame})


# The digest line and the report section (Probe.digest_line, Probe.report_table).


