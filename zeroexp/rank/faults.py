"""Test-only fault injection: make one rank raise, die by SIGKILL, hang or run out of memory at a chosen step, or
find the disk full while it writes the cell's results.

Set ``ZEROEXP_FAULT=<rank>:<step>:<kind>[:<cell>]`` (kind: ``raise``, ``raise_tensor``, ``kill``, ``hang``, ``memory``,
``enospc``; ``<cell>``, if given, a substring the cell name must contain) in the environment of the launching
process. ``enospc`` counts result writes, not steps: after training, the rank's result file write number ``<step>``
(0 first; a CSV table or ``summary.json`` in the cell directory) fails with ENOSPC half-way through its data. It exists
so that the reliability tests can prove that a failed or hung rank ends its cell within the timeouts, leaves no process
behind, and does not stop a sweep. It does nothing when unset. Kind ``perturb`` changes that rank's batch of that step
instead, so the equivalence tests can prove that a run that computed something else FAILs. Kinds ``frozen``,
``round_grads`` and ``clip_world`` make a strategy's arithmetic wrong in a way users meet (see :data:`KINDS`), so that
the divergence replay (zeroexp.probes.divergence) is proven to name the step, the tensor and the cause. A cell that
replays its steps (``probes.trace_divergence``) re-applies the kinds of :data:`REPLAYED`.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "ZEROEXP_FAULT"
#: ``perturb``: the rank trains on a changed batch at that step (silent data corruption; the equivalence
#: probe must then FAIL).
#: ``raise_tensor``: raises an error whose message holds a parameter's repr (as torch's C++ errors can).
#: ``memory``: raises MemoryError (what an allocation beyond the machine's memory raises in Python).
#: ``enospc``: a result write fails with ENOSPC (see the module's doc).
#: ``frozen``: after that step's optimizer step, the rank's copy (its shard) of the model's first frozen parameter
#: moves by 1e-2 (a frozen parameter the optimizer updated: accelerate#3844's class).
#: ``round_grads``: before that step's optimizer step, the rank's gradients rounded to bf16 (a reduction or
#: accumulation in bf16 in an fp32 cell).
#: ``clip_world``: at that step, every rank (the rank field is ignored: a norm is a collective) clips by a total norm
#: whose squares are all-reduced over the whole world instead of the shard group (VeOmni#184's HSDP bug: each square
#: counted once per replica); the right norm for FSDP2 without a replicate dimension; DTensor gradients only (DDP's
#: and the flat-buffer ZeRO's whole gradient on every rank would count each square N times).
#: ``hold`` / ``upcast``: during that step, the rank's first module with parameters to take a floating-point
#: input keeps a copy of it (float64 for ``upcast``) alive through forward and backward, from a forward pre-hook
#: (memory above the plan: the memory explanation must name that module and the op, zeroexp.plan.check.memory_excess).
KINDS = ("raise", "raise_tensor", "kill", "hang", "perturb", "memory", "enospc", "frozen", "round_grads",
         "clip_world", "hold", "upcast")
#: The kinds that keep memory alive in their step, not raising nor changing what is computed.
HOLDS = ("hold", "upcast")
#: The kinds that change what a cell computes, re-applied when it replays its steps (probes.trace_divergence).
REPLAYED = ("perturb", "frozen", "round_grads", "clip_world")


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


def fault_injector(fault: Fault, rank: int, cell_name: str) -> Any:
    """The Lightning callback that injects ``fault`` at the start of its step on its rank (armed where the cell's
    name contains ``fault.cell``). Made in the rank (zeroexp._lib.callbacks): this module is imported by the launching
    process too (for :data:`ENV`), which does not import Lightning."""
    from zeroexp._lib.callbacks import as_callback

    return as_callback(FaultInjector)(fault, rank, cell_name)


class FaultInjector:
    """Injects ``fault`` at the start of its step on its rank (Lightning's hooks: :func:`fault_injector`)."""

    def __init__(self, fault: Fault, rank: int, cell_name: str) -> None:
        self.fault, self.rank = fault, rank
        self.armed = fault.cell in cell_name

    def on_train_end(self, trainer, pl_module) -> None:
        if self.armed and self.rank == self.fault.rank and self.fault.kind == "enospc":
            fill_disk_at_result_write(self.fault.step)

    def _here(self, step: int, kind: str) -> bool:
        return self.armed and self.fault.kind == kind and step == self.fault.step and \
            (self.rank == self.fault.rank or kind == "clip_world")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.armed and self.fault.kind == "clip_world" and pl_module.clip_gradients is not None:
            right = pl_module.clip_gradients
            max_norm = right.__self__.clip_grad_norm

            def clip(model) -> None:
                if not self._here(trainer.global_step, "clip_world") or max_norm is None:
                    return right(model)
                right.__self__.took_grad_norm(clip_over_world(model, max_norm))  # the norm the strategy then took
            pl_module.clip_gradients = clip

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        held = getattr(self, "_held", None)
        if held is not None:  # backward is over: the copies and the hooks go (the step ends without them)
            for hook in held[1]:
                hook.remove()
            held[0].clear()
            self._held = None
        if self._here(trainer.global_step, "round_grads"):
            import torch

            with torch.no_grad():
                for p in pl_module.parameters():
                    if p.grad is not None:
                        p.grad.copy_(p.grad.to(torch.bfloat16).to(p.grad.dtype))

    def _hold(self, pl_module) -> None:
        import torch

        kept: list = []

        def keep(module, args) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if kept or x is None or not x.is_floating_point():
                return
            with torch.no_grad():
                kept.append((x.to(torch.float64) if self.fault.kind == "upcast" else x.clone(), module))
        owners = [m for m in pl_module.modules() if any(True for _ in m.parameters(recurse=False))]
        self._held = (kept, [m.register_forward_pre_hook(keep) for m in owners])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._here(batch_idx, "frozen"):
            import torch

            with torch.no_grad():
                next(p for p in pl_module.parameters() if not p.requires_grad).add_(1e-2)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.armed or self.rank != self.fault.rank or batch_idx != self.fault.step \
                or self.fault.kind in ("enospc", "frozen", "round_grads", "clip_world"):
            return
        if self.fault.kind in HOLDS:
            return self._hold(pl_module)
        if self.fault.kind == "memory":
            raise MemoryError(f"injected fault: rank {self.rank} ran out of memory at step {batch_idx}")
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


def clip_over_world(model, max_norm: float) -> Any:
    """Clip ``model``'s gradients by a norm whose squares are summed over every rank of the world: the rank's local
    gradient (its shard of a DTensor) squared and all-reduced over the default group (``clip_world``); the norm."""
    import torch
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params)]
    squares = torch.stack([t.detach().float().pow(2).sum() for t in local]).sum()
    dist.all_reduce(squares)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, squares.sqrt())
    return squares.sqrt()


def fill_disk_at_result_write(n: int) -> None:
    """From now on in this process, result write number ``n`` (0 first: a ``*.csv`` or ``summary.json`` through
    ``zeroexp.results.files.write_text``) writes half its data to its temporary file, then fails with ENOSPC, as a disk
    that fills up mid-write does. The atomic writer must leave nothing half-written under the real name."""
    from zeroexp.results import files as results

    real = results._open_tmp
    count = [0]

    class _Full:
        def __init__(self, f) -> None:
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

        def write(self, text: str) -> int:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    def open_tmp(fd: int, path: Path):
        f = real(fd, path)
        if not (Path(path).suffix == ".csv" or Path(path).name == "summary.json"):
            return f
        count[0] += 1
        return _Full(f) if count[0] - 1 == n else f

    results._open_tmp = open_tmp
