"""Steady and peak memory per rank: ``memory.csv`` and ``summary.json[memory]``.

``steady`` is what a rank holds at the optimizer boundary (``on_train_batch_end``, after ``optimizer.step``)
of the last memory-tracked step; ``peak`` is the highest allocation during the memory-tracked steps
(``Schedule.memory_tracked``: after warm-up, so the model is wrapped and the optimizer state exists, and
after the profiled steps). The peak is reset at the start of each tracked step, so it is a *training* peak:
the construction of the full model on every rank and the wrapping are not in it. The cycle collector runs
before steady is read and at each tracked step's start: garbage that only a reference cycle keeps alive is
not state, and counting it made steady depend on when Python's collector happened to run.

Sources (``memory.source`` names the one used):

- CUDA: the caching allocator's statistics (``memory_allocated``, ``max_memory_allocated`` after
  ``reset_peak_memory_stats``). No categories.
- CPU: torch has no CPU allocator statistics, so every tensor storage is followed with
  ``torch.distributed._tools.MemTracker`` (a ``TorchDispatchMode``): at the start of a tracked step every live
  tensor (found by the garbage collector) is registered, then each op's outputs, resizes and frees are
  followed. Categories are MemTracker's (parameters, buffers, gradients, activations, temporaries, optimizer
  state, other). Memory that never passes through a tensor op while tracked (gloo's internal buffers) is not
  seen; DDP's C++ gradient buckets are seen once all-reduced in the step. With FSDP1 and
  ``use_orig_params=True`` MemTracker cannot hook the non-leaf parameter views, so hooks are skipped there.
"""

from __future__ import annotations

import gc
from enum import Enum
from typing import Any

import pandas as pd
import torch
from torch import nn

from zeroexp.probes.base import Probe, ProbeReport

__all__ = ["MemoryProbe", "PEAK_MEANING", "memory_source"]

PEAK_MEANING = (
    "peak_bytes is a training peak: the highest allocation during the memory-tracked steps, reset after the "
    "model was wrapped and the optimizer state existed; it does not include building and wrapping the model, "
    "so it does not prove that a model can be initialised in that memory."
)
#: MemTracker's reference types -> the category names in memory.csv and the summary.
CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Activation": "activations",
              "Temp": "temporaries", "Optstate": "optimizer_state", "Other": "other"}


class _CudaAllocator:
    """CUDA caching allocator statistics, reset at each tracked step's start."""

    source = "torch.cuda caching allocator: memory_allocated (steady), max_memory_allocated (peak)"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def before_optimizer_update(self) -> None:
        pass

    def current_bytes(self) -> int:
        """Bytes allocated now (between ``begin`` and ``end``)."""
        return int(torch.cuda.memory_allocated(self.device))

    def end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        gc.collect()  # see _TensorTracker.end
        torch.cuda.synchronize(self.device)
        return {"steady": int(torch.cuda.memory_allocated(self.device)),
                "peak": int(torch.cuda.max_memory_allocated(self.device)), "steady_categories": {},
                "peak_categories": {}}

    def abort(self) -> None:
        pass


def _live_tensors_and_optimizers() -> tuple[list[torch.Tensor], list[torch.optim.Optimizer]]:
    """Every strided, non-meta tensor and every optimizer the garbage collector can see in this process."""
    tensors, optimizers = [], []
    for obj in gc.get_objects():
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


def _totals(snapshot: dict[torch.device, dict[Any, int]], device_type: str) -> tuple[int, dict[str, int]]:
    """Total bytes and bytes per category of a MemTracker snapshot, summed over devices of ``device_type``."""
    total, cats = 0, dict.fromkeys(CATEGORIES.values(), 0)
    for dev, snap in snapshot.items():
        if torch.device(dev).type != device_type:
            continue
        for key, nbytes in snap.items():
            name = key.value if isinstance(key, Enum) else str(key)
            if name == "Total":
                total += int(nbytes)
            elif name in CATEGORIES:
                cats[CATEGORIES[name]] += int(nbytes)
    return total, cats


def _step_mem_tracker() -> Any:
    """A MemTracker whose optimizer-state region is only the optimizer's update (see :class:`_TensorTracker`)."""
    from torch.distributed._tools import MemTracker

    class _StepMemTracker(MemTracker):
        # Lightning runs forward and backward inside ``optimizer.step(closure)``: MemTracker's global step
        # hooks would label every activation "optimizer state". The probe marks the update region instead.
        def _register_global_optimizer_hook(self) -> None:
            pass

        def set_in_optimizer_update(self, flag: bool) -> None:
            self._in_opt = flag

        # FSDP1 with use_orig_params=True exposes non-leaf parameter views in forward, on which MemTracker's
        # gradient hooks cannot be registered; their gradients land in the FlatParameter's, counted anyway.
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> Any:
            leaves = all(p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks and leaves)

    return _StepMemTracker()


class _TensorTracker:
    """MemTracker around one step, with every live tensor registered first (CPU).

    New allocations are labelled by where they happen: forward -> activations, backward -> temporaries,
    between ``on_before_optimizer_step`` and the step's end -> optimizer state. At the step's end the model
    and the optimizers are registered again, so this step's gradients and state carry their own labels.
    """

    source = ("torch.distributed._tools.MemTracker: tensor storages followed through the dispatcher, every live "
              "tensor registered at the tracked step's start")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mt: Any = None
        self._optimizers: list[torch.optim.Optimizer] = []

    def begin(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._mt = _step_mem_tracker()
        gc.collect()  # garbage awaiting the cycle collector is not held memory: do not register it
        tensors, self._optimizers = _live_tensors_and_optimizers()
        self._mt.track_external(*tensors)  # as "other"; the model and optimizers below re-label theirs
        del tensors  # the tracker holds weak references only: freed storages must leave the count
        self._mt.track_external(model, *_trackable(self._optimizers))
        self._mt.__enter__()

    def before_optimizer_update(self) -> None:
        if self._mt is not None:
            self._mt.set_in_optimizer_update(True)

    def current_bytes(self) -> int:
        """Bytes of the tracked storages alive now (between ``begin`` and ``end``)."""
        return _totals(self._mt.get_tracker_snapshot("current"), self.device.type)[0]

    def end(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        mt = self._mt
        mt.set_in_optimizer_update(False)
        gc.collect()  # storages only kept by reference cycles leave the count now, not at a random later step
        mt.track_external(model, *_trackable(self._optimizers))  # label this step's new gradients and optimizer state
        steady, steady_cats = _totals(mt.get_tracker_snapshot("current"), self.device.type)
        peak, peak_cats = _totals(mt.get_tracker_snapshot("peak"), self.device.type)
        self.abort()
        return {"steady": steady, "peak": peak, "steady_categories": steady_cats, "peak_categories": peak_cats}

    def abort(self) -> None:
        if self._mt is not None:
            self._mt.__exit__(None, None, None)
        self._mt, self._optimizers = None, []


def memory_source(device: torch.device) -> "_CudaAllocator | _TensorTracker":
    """The tracker for ``device``: ``begin(model, optimizer)``, ``current_bytes()``, ``end(...)`` -> ``{"steady",
    "peak", "steady_categories", "peak_categories"}``, ``abort()``; ``source`` names it."""
    return _CudaAllocator(device) if device.type == "cuda" else _TensorTracker(device)


class MemoryProbe(Probe):
    """Steady bytes at the optimizer boundary and the training peak of each memory-tracked step, per rank."""

    name = "memory"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.source = memory_source(ctx.device)
        self.records: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx in self.ctx.schedule.memory_tracked:
            self.source.begin(trainer.strategy.model, trainer.optimizers[0])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.source.before_optimizer_update()  # after backward, before the update; no-op when not tracking

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx in self.ctx.schedule.memory_tracked:
            self.records.append({"step": batch_idx, **self.source.end(trainer.strategy.model, trainer.optimizers[0])})

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.source.abort()  # never leave a dispatch mode pushed on a failing rank

    def rank_result(self) -> dict[str, Any]:
        return {"source": self.source.source, "records": self.records}

    @classmethod
    def aggregate(cls, results, cfg) -> ProbeReport:
        rows, peak_cats = [], []
        for rank, res in enumerate(results):
            records = res["records"]
            last = records[-1]  # steady: the boundary of the last tracked step
            top = max(reversed(records), key=lambda rec: rec["peak"])  # ties: the latest, as for steady
            row = {"rank": rank, "steady_bytes": last["steady"], "peak_bytes": top["peak"],
                   "peak_minus_steady_bytes": top["peak"] - last["steady"], "peak_step": top["step"]}
            row.update({f"steady_{c}_bytes": b for c, b in last["steady_categories"].items()})
            row.update({f"peak_{c}_bytes": b for c, b in top["peak_categories"].items()})
            rows.append(row)
            peak_cats.append(top["peak_categories"])
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
            "peak_kind": "training",
            "peak_meaning": PEAK_MEANING,
        }
        if peak_cats[worst]:
            section["peak_categories_of_max_rank"] = {c: int(b) for c, b in peak_cats[worst].items()}
        return ProbeReport(section=section, tables={"memory.csv": frame})
