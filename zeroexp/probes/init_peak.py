"""The initialisation peak of one rank (measured): the most bytes held at once from just before the worker builds
the model to Lightning's ``on_fit_start`` (model built, moved, wrapped, the optimizer made; nothing trained).

``init=full`` builds the whole model on every rank first; ``init=meta`` builds it on the meta device and the adapter
materialises the rank's part (zeroexp.strategies._meta_init). The worker starts it (:meth:`InitPeak.begin`) and
adds it to the callbacks; its record lands in ``summary.json["memory"]`` (:func:`init_fields`, docs/results.md).
Sources as the memory probe's: CPU, every storage followed by MemTracker from :meth:`begin` on; CUDA, the caching
allocator's peak above what was allocated at :meth:`begin` (a model built on the host first is not in it).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from zeroexp._lib.memtrack import mem_tracker, totals

__all__ = ["InitPeak", "init_fields"]


class InitPeak(pl.Callback):
    """Peak bytes of the model's build and wrap on this rank (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mt: Any = None
        self._base = 0
        self.record: dict[str, Any] | None = None

    def begin(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = int(torch.cuda.memory_allocated(self.device))
            return
        self._mt = mem_tracker()
        self._mt.__enter__()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.end()  # never leave a dispatch mode pushed on a failing rank

    def end(self) -> None:
        if self.record is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device)) - self._base
            self.record = {"peak": peak, "source": "torch.cuda max_memory_allocated above the bytes at the start"}
            return
        if self._mt is None:
            return
        peak, _ = totals(self._mt.get_tracker_snapshot("peak"), self.device.type)
        self._mt.__exit__(None, None, None)
        self._mt = None
        self.record = {"peak": int(peak), "source": "torch.distributed._tools.MemTracker: every storage allocated "
                                                    "from the model's build to on_fit_start"}


def init_fields(records: list[dict[str, Any] | None], init: str) -> dict[str, Any]:
    """``summary.json["memory"]``'s init fields from every rank's :class:`InitPeak` record (empty without them)."""
    if not records or any(r is None for r in records):
        return {}
    peaks = [int(r["peak"]) for r in records]
    return {"init": init, "init_peak_bytes": peaks, "init_peak_bytes_max": max(peaks),
            "init_peak_source": records[0]["source"]}
