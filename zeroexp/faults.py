"""Test-only fault injection: make one rank raise, die by SIGKILL, or hang, at a chosen step.

Set ``ZEROEXP_FAULT=<rank>:<step>:<kind>[:<cell>]`` (kind: ``raise``, ``raise_tensor``, ``kill``, ``hang``; ``<cell>``, if
given, a substring the cell name must contain) in the environment of the launching process. It exists so that the reliability tests can prove that a failed or hung rank ends its cell
within the timeouts, leaves no process behind, and does not stop a sweep. It does nothing when unset.
Kind ``perturb`` changes that rank's batch of that step instead, so the equivalence tests can prove that a
run that computed something else FAILs.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import lightning.pytorch as pl

ENV = "ZEROEXP_FAULT"
#: ``perturb``: the rank trains on a changed batch at that step (silent data corruption; the equivalence
#: probe must then FAIL).
#: ``raise_tensor``: raises an error whose message holds a parameter's repr (as torch's C++ errors can).
KINDS = ("raise", "raise_tensor", "kill", "hang", "perturb")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str
    cell: str = ""

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        try:
            rank, step, kind, *cell = spec.split(":")
            fault = cls(int(rank), int(step), kind, cell[0] if cell else "")
        except (ValueError, IndexError) as e:
            raise ValueError(f"{ENV}={spec!r}: expected <rank>:<step>:<kind>[:<cell>]") from e
        if fault.kind not in KINDS:
            raise ValueError(f"{ENV}={spec!r}: kind must be one of {', '.join(KINDS)}")
        return fault


class FaultInjector(pl.Callback):
    """Injects ``fault`` at the start of its step on its rank."""

    def __init__(self, fault: Fault, rank: int, cell_name: str) -> None:
        self.fault, self.rank = fault, rank
        self.armed = fault.cell in cell_name

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.armed or self.rank != self.fault.rank or batch_idx != self.fault.step:
            return
        if self.fault.kind == "perturb":  # in place: training_step receives this very tensor
            batch.copy_(batch.roll(1, dims=-1))  # other data, same dtype and value range (token ids too)
            return
        if self.fault.kind == "raise":
            raise RuntimeError(f"injected fault: rank {self.rank} raised at step {batch_idx}")
        if self.fault.kind == "raise_tensor":
            param = next(pl_module.parameters())
            raise RuntimeError(f"injected fault: rank {self.rank} raised at step {batch_idx} on "
                               f"Parameter containing:\n{param.data}\nand {param.data.flatten()[:4]}")
        if self.fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: never reach the step's collectives
            time.sleep(3600)
