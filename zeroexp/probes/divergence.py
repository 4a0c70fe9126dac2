"""Where a strategy's training parts from the unsharded reference: the first step, the first tensor, what of it, and
the likely cause (``summary.json[equivalence][divergence]``).

The equivalence probe compares the parameters after the last step; a FAIL there says how far, not where. The
**replay** (:func:`replay_wanted`, run by the rank after the measured steps, every probe's window closed) trains the
cell again from the same seed on the same batches, with any injected fault re-applied, and after every optimizer step
gathers the strategy's whole state on rank 0 (the adapter's ``full_state_dicts``, the state a ``full`` checkpoint
holds) and each rank's loss. Rank 0 steps two references beside it (:class:`~zeroexp.probes.reference.Reference`: the
mean loss's, and data parallelism's arithmetic, whose distance from the first is the step's reduction-order floor)
and compares, per step, in the order the step computes them:

1. ``grad``: the gradient the optimizer applied, per parameter. It is derived alike for the strategy and the
   references from AdamW's first moment, ``g = (m_t - beta1 m_{t-1}) / (1 - beta1)`` (torch/optim/adamw.py:
   ``exp_avg.lerp_(grad, 1 - beta1)``), so it is the gradient after reduction, unscaling and clipping, whatever
   tensor the strategy kept it in;
2. ``exp_avg_sq``: AdamW's second moment;
3. ``param``: the parameter after the step (the frozen ones too).

A tensor parts where its difference exceeds the bound: for ``param`` the equivalence's own (the precision's threshold,
or ``FLOOR_FACTOR`` times the step's floor where larger); for ``grad`` and ``exp_avg_sq`` its largest difference
relative to the reference's largest element, against ``FLOOR_FACTOR`` times the step's floor of that kind or
:data:`ULPS` units in the last place of the compute dtype, whichever is larger. The first step where any tensor parts
is reported, with its first kind and, of that kind, the tensor furthest beyond its bound; a tensor the equivalence
excuses by design (an unused parameter a flat gradient buffer lets AdamW decay) is reported only where nothing else
parts. Each rank's loss of the step is compared too (relative, the same bound): it names the rank whose batch or
forward differs. The cause (:mod:`zeroexp.probes.causes`) is read off what differs at that tensor and what the cell's
configuration does there.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from zeroexp._lib.modules import strip_wrappers
from zeroexp.probes.causes import Evidence, cause_of
from zeroexp.probes.reference import PREFIX, Reference
from zeroexp.tolerances import FLOOR_FACTOR

__all__ = ["DivergenceTracer", "Watch", "ULPS", "relative_bound", "replay_wanted", "divergence_line"]

#: The least relative bound of a gradient, moment, loss or norm comparison: this many units of roundoff of the
#: compute dtype (``torch.finfo(dtype).eps / 2``) at the tensor's largest element. Summation error grows with the
#: number of terms (Higham, Accuracy and Stability of Numerical Algorithms, 2002, section 4.2: |error| <= (n-1) u
#: sum|x_i|); 64 roundoffs are far above the few ulps a reordered fp32 reduction moves a gradient (the floor, measured
#: each step) and far below a changed batch or a bf16 rounding (2^-8 relative) in an fp32 cell.
ULPS = 64
#: The kinds compared, in the order a step computes them.
KINDS = ("grad", "exp_avg_sq", "param")


def relative_bound(floor: float, dtype: str | torch.dtype, ulps: int = ULPS) -> float:
    """The bound of a relative difference: ``FLOOR_FACTOR`` times its floor (the same figure of data parallelism's
    arithmetic), or ``ulps`` units of roundoff of ``dtype`` (``torch.finfo(dtype).eps / 2``), whichever is larger."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return max(ulps * torch.finfo(dtype).eps / 2, FLOOR_FACTOR * floor)


def replay_wanted(setting: bool | None, equivalence: Mapping[str, Any] | None) -> bool:
    """Whether the cell replays its steps to locate a divergence: ``probes.trace_divergence`` true (always), false
    (never), null (when the equivalence check FAILed above its bound)."""
    if setting is not None:
        return bool(setting) and bool(equivalence)
    return bool(equivalence) and equivalence.get("check") == "FAIL" and \
        "equivalence.above_bound" in (equivalence.get("reason_codes") or ["equivalence.above_bound"])


def _name(key: str) -> str:
    """A state dict's key as the model names the parameter: wrapper prefixes and CellModule's ``net.`` taken off."""
    return strip_wrappers(key).removeprefix(PREFIX)


def _derived(m_now: torch.Tensor, m_prev: torch.Tensor | None, beta1: float) -> torch.Tensor:
    """The gradient AdamW folded into its first moment this step (``exp_avg.lerp_(grad, 1 - beta1)``)."""
    m_now = m_now.double()
    return m_now / (1 - beta1) if m_prev is None else (m_now - beta1 * m_prev.double()) / (1 - beta1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| relative to max|b| (inf where b is all zero and a is not)."""
    if not b.numel():
        return 0.0
    err, scale = float((a.double() - b.double()).abs().max()), float(b.double().abs().max())
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if b.numel() else 0.0


class Watch:
    """Rank 0's side of the replay: the references, stepped beside the strategy, and the first parting found."""

    def __init__(self, cfg: Any, *, clip: float | None, threshold: float | None, start: Any = None,
                 ungraded_why: str | None = None) -> None:
        self.cfg = cfg
        self.ref = Reference(cfg, clip_grad_norm=clip, start=start)
        self.avg = Reference(cfg, clip_grad_norm=clip, averaged_grads=True, start=start) \
            if int(cfg.world_size) > 1 else None
        self.threshold = threshold
        self.dtype = str(cfg.precision.param_dtype)
        #: Why a parameter the step gives no gradient may move by design (a flat gradient buffer's zero gradient:
        #: the equivalence excuses it too); None: it may not.
        self.ungraded_why = ungraded_why
        self.excused: dict[str, str] = {}
        self.beta1 = self.ref.betas[0]
        held = {n: m[0].clone() for n, m in self.ref.moments().items()}  # the start's first moments (none: zero)
        self.prev = {"got": dict(held), "ref": dict(held), "avg": dict(held)}
        self.found: dict[str, Any] | None = None
        self.excused_found: dict[str, Any] | None = None
        self.steps = 0

    def observe(self, step: int, losses: list[float], model_sd: Mapping[str, Any],
                optim_sd: Mapping[str, Any]) -> bool:
        """Compare the strategy's state after optimizer step ``step`` (its full state dicts and each rank's loss) with
        the references' after the same step; True once a parting is found (nothing more need be gathered)."""
        self.ref.take_step()
        if self.avg is not None:
            self.avg.take_step()
        self.steps += 1
        if self.ungraded_why:
            self.excused.update({n: self.ungraded_why for n in self.ref.ungraded})
        got_p = {_name(k): v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
        got_m = {_name(k): (s["exp_avg"], s["exp_avg_sq"]) for k, s in (optim_sd.get("state") or {}).items()
                 if "exp_avg" in s}
        sides = {"got": (got_p, got_m), "ref": (self.ref.parameters(), self.ref.moments())}
        if self.avg is not None:
            sides["avg"] = (self.avg.parameters(), self.avg.moments())
        values = {side: self._values(side, p, m) for side, (p, m) in sides.items()}
        for side, (_, m) in sides.items():
            self.prev[side] = {n: t[0].detach().clone() for n, t in m.items()}
        partings: dict[str, list[tuple[float, str, float, float]]] = {}
        bounds: dict[str, float] = {}
        if not set(values["got"]["param"]) & set(values["ref"]["param"]):
            raise ValueError(f"no parameter of the strategy's state ({', '.join(sorted(got_p)[:3])} ...) is one the "
                             f"reference names ({', '.join(sorted(values['ref']['param'])[:3])} ...)")
        skipped = set(self.ref.ungraded)  # AdamW skipped them in the reference: their moments did not move
        for kind in KINDS:
            ref, got, avg = values["ref"][kind], values["got"][kind], values.get("avg", {}).get(kind, {})
            if kind != "param":
                ref = {n: t for n, t in ref.items() if n not in skipped}
            measure = _abs if kind == "param" else _rel
            floor = max((measure(avg[n], ref[n]) for n in ref if n in avg), default=0.0)
            bound = max(self.threshold or 0.0, FLOOR_FACTOR * floor) if kind == "param" else \
                relative_bound(floor, self.dtype)
            bounds[kind] = bound
            partings[kind] = sorted(((measure(got[n], ref[n]) / bound if bound > 0 else float("inf"), n,
                                      measure(got[n], ref[n]), bound) for n in ref
                                     if n in got and measure(got[n], ref[n]) > bound), reverse=True)
        loss_floor = max((abs(a - r) / abs(r) for a, r in zip(self.avg.rank_losses, self.ref.rank_losses) if r),
                         default=0.0) if self.avg is not None else 0.0
        loss_bound = relative_bound(loss_floor, self.dtype)
        ranks = [r for r, (g, ref) in enumerate(zip(losses, self.ref.rank_losses))
                 if ref and abs(g - ref) / abs(ref) > loss_bound]
        graded = {n: t for n, t in values["ref"]["grad"].items() if n not in skipped}
        evidence = Evidence(self.cfg, step, values["got"]["grad"], graded, bounds["grad"],
                            ranks, self.ref.trainable(), self.ref.ungraded, self.ref.grad_norm, self.excused)
        for excused_pass in (False, True):
            for kind in KINDS:
                hits = [h for h in partings[kind] if (h[1] in self.excused) == excused_pass]
                if not hits:
                    continue
                _, name, size, bound = hits[0]
                code, why, numbers = cause_of(kind, name, evidence)
                found = {"step": step, "tensor": name, "kind": kind, "size": size, "bound": bound,
                         "relative": kind != "param", "tensors_beyond": len(hits), "cause": code, "why": why,
                         **({"ranks": ranks} if ranks else {}), **({"evidence": numbers} if numbers else {})}
                if excused_pass:
                    self.excused_found = self.excused_found or {**found, "by_design": self.excused[name]}
                    return False
                self.found = found
                return True
        return False

    def _values(self, side: str, params: Mapping[str, torch.Tensor],
                moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        prev = self.prev[side]
        return {"param": {n: t.detach().to("cpu") for n, t in params.items()},
                "grad": {n: _derived(m[0].detach().to("cpu"), prev.get(n), self.beta1) for n, m in moments.items()},
                "exp_avg_sq": {n: m[1].detach().to("cpu") for n, m in moments.items()}}

    def result(self) -> dict[str, Any]:
        """``summary.json[equivalence][divergence]``: the first parting (or, where only a tensor excused by design
        parted, that one with ``by_design``), else ``found: false`` with the steps compared."""
        found = self.found or self.excused_found
        if found is None:
            return {"found": False, "steps_compared": self.steps,
                    "why": f"every tensor within its bound at each of the {self.steps} steps replayed"}
        return {"found": True, "steps_compared": self.steps, **found}


class DivergenceTracer:
    """The replay's callback (made a Lightning callback by ``zeroexp._lib.callbacks.as_callback``): after each
    optimizer step, every rank's loss gathered and the whole state gathered to rank 0 (collectives: the replay is
    outside every measured window), rank 0's :class:`Watch` compares; once it has found the parting, nothing more is
    gathered."""

    def __init__(self, ctx: Any, watch: Watch | None, failed: str | None = None) -> None:
        self.ctx, self.watch = ctx, watch
        #: rank 0 without its references (``failed``: why) gathers nothing from the first step on, nor do the others
        self.error = failed
        self.done = ctx.rank == 0 and watch is None

    def on_train_start(self, trainer, pl_module) -> None:
        """``checkpoint.load_from``: the checkpoint loaded as the measured run loaded it (the checkpoint probe's
        load), so that the replay starts where the reference starts."""
        source = self.ctx.cell.load_from
        if source is not None:
            from pathlib import Path

            self.ctx.adapter.load_checkpoint(source.kind, Path(source.dir), trainer.strategy.model,
                                             trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch.distributed as dist

        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        mine = torch.tensor([float(loss.detach().float()) if loss is not None else float("nan"), float(self.done)],
                            dtype=torch.float64, device=self.ctx.device)
        every = [torch.zeros_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(every, mine)
        if bool(every[0][1]):  # rank 0 found the parting at an earlier step
            return
        model_sd, optim_sd = self.ctx.adapter.full_state_dicts(trainer.strategy.model, trainer.optimizers[0])
        if self.watch is not None and self.error is None:
            try:  # rank 0 alone: a comparison that raises stops the gathering on every rank at the next step
                self.done = self.watch.observe(int(batch_idx), [float(t[0]) for t in every], model_sd, optim_sd)
            except Exception as e:  # noqa: BLE001 - said in the result
                self.error, self.done = f"{type(e).__name__}: {e}", True

    def rank_result(self) -> dict[str, Any]:
        if self.ctx.rank != 0:
            return {}
        if self.error is not None:
            return {"found": False, "error": self.error, "why": "the replay's comparison raised: no divergence located"}
        return self.watch.result()


def divergence_line(d: Mapping[str, Any]) -> str:
    """One line of a divergence: where, how far, why."""
    if not d.get("found"):
        return f"no divergence located ({d.get('why', 'not replayed')})"
    size = f"{d['size']:.3g}" + (" relative" if d.get("relative") else "")
    return (f"first parts at step {d['step']}: {d['kind']} of {d['tensor']} ({size} > bound {d['bound']:.3g}, "
            f"{d['tensors_beyond']} tensor(s) beyond); cause {d['cause']}: {d['why']}")
