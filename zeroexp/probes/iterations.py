"""Per-step loss and wall time on every rank: ``iterations.csv`` and ``summary.json[final_loss]``."""

from __future__ import annotations

import time
from typing import Any

import pandas as pd

from zeroexp.probes.base import Probe, ProbeReport


class IterationsProbe(Probe):
    """Records, for every training step, the rank-local loss and the step's wall time in ms.

    The step time spans ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, the
    gradient collectives and the optimizer step (with a device synchronisation on CUDA).
    """

    name = "iterations"
    order = 10
    dry_run_absent = "no loss: FakeTensorMode computes shapes and dtypes, not values"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.rows: list[dict[str, Any]] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sync_device()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sync_device()
        step_ms = (time.perf_counter() - self._t0) * 1e3
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append({"step": batch_idx, "loss": float(loss.detach().float().item()), "step_ms": step_ms})

    def rank_result(self) -> dict[str, Any]:
        return {"rows": self.rows}

    @classmethod
    def aggregate(cls, results, cell) -> ProbeReport:
        frame = pd.DataFrame(
            [{"rank": r, **row} for r, res in enumerate(results) for row in res["rows"]],
            columns=["rank", "step", "loss", "step_ms"],
        )
        last = frame[frame.step == frame.step.max()]
        # Every rank's batch has the same size, so the mean of rank losses is the global-batch loss.
        global_loss = frame.groupby("step").loss.mean()
        return ProbeReport(
            section={
                "global_loss": [float(v) for v in global_loss.values],
                "steps_recorded": int(frame.step.nunique()),
            },
            tables={"iterations.csv": frame},
            top_level={"final_loss": float(last.loss.mean())},
        )
