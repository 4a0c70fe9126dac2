"""The total gradient norm each rank computed, every step, against the unsharded reference's:
``summary.json["grad_norm"]``.

A strategy that clips by the global norm (``strategy.clip_grad_norm``) computes the total norm itself every step: each
rank's sum of squares over the gradient it holds (its shards, its flat buffer's partition, a DTensor's local part)
reduced over the group the strategy chooses (FSDP1's ``clip_grad_norm_``, FSDP2's ``get_total_norm`` and
``full_tensor()``, zeroexp's ZeRO's all_reduce of its shards' squares; DDP's whole gradient needs none); DeepSpeed's
ZeRO optimizer computes it every step, clipping or not (``engine.get_global_grad_norm``). The probe reads that norm
after the step (``StrategyAdapter.step_grad_norm``): nothing more is computed or sent. Where the strategy computes no
norm (no clipping), the probe takes it the strategy's way (``StrategyAdapter.grad_norm``: a collective where the
gradients are sharded) before the optimizer step of each step outside every measured window (warm-up, in a default
schedule), so no profiled, tracked or timed step holds it.

Rank 0 reads the reference's norm of each step before clipping (:func:`zeroexp.probes.reference.trajectory`: the run
the equivalence probe compares with, trained once) and the same of data parallelism's arithmetic; the check holds every
rank's norm of every step it has to the reference's, relative, within ``FLOOR_FACTOR`` times that step's floor (the two
references' relative difference) or :data:`~zeroexp.probes.divergence.ULPS` units of roundoff of the compute dtype,
whichever is larger. A norm reduced over the wrong group is off by a factor: ``squares_counted``, the square of the
ratio, says how many times each square was counted (2: a group twice too large).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.probes.divergence import relative_bound
from zeroexp.results.verdict import Check, Code, Reason, Verdict

__all__ = ["GradNormProbe", "NORM_ULPS", "grad_norm_line", "judge_norms", "norm_ulps"]

#: The least relative bound of a norm, in units of roundoff of the compute dtype: ``NORM_ULPS`` for the gradient's own
#: rounding (each element rounded to the compute dtype moves the norm by at most one roundoff, relative: Higham,
#: Accuracy and Stability of Numerical Algorithms, 2002, section 3.1; measured 3.1e-3, 0.8 units, for an FSDP2 bf16
#: cell against the fp32 reference) plus ceil(log2 n) for summing n squares in another order (pairwise summation's
#: bound, ibid. section 4.2). For the mlp's 524,288 gradients 27 units: 1.6e-6 in fp32, 0.105 in bf16, which still
#: catches a norm of the wrong group (sqrt 2: 41 %).
NORM_ULPS = 8


def norm_ulps(numel: int) -> int:
    """The units of roundoff a norm over ``numel`` gradients is held within (:data:`NORM_ULPS`)."""
    return NORM_ULPS + max(1, math.ceil(math.log2(max(numel, 2))))


class GradNormProbe(Probe):
    """Every rank's total gradient norm per step against the reference's (rank 0 holds the reference's)."""

    name = "grad_norm"
    order = 62
    dry_run_absent = "no gradients to take the norm of"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.norms: dict[int, Any] = {}
        self.source: str | None = None
        self.why_none: str | None = None
        self.reference: dict[str, Any] = {}

    def _measured_steps(self) -> set[int]:
        out: set[int] = set()
        for window in self.ctx.schedule.windows.values():
            out |= set(window) if isinstance(window, range) else ({window} if window is not None else set())
        return out

    def on_train_start(self, trainer, pl_module) -> None:
        adapter = self.ctx.adapter  # a strategy that takes no norm and holds no whole gradient to take one of: why
        self.why_none = None if adapter.computes_grad_norm else adapter.grad_norm_unavailable

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """No norm of the strategy's own: take it, the strategy's way, at a step outside every measured window."""
        if self.ctx.adapter.computes_grad_norm or self.why_none is not None:
            return
        step = int(trainer.global_step)
        if step in self._measured_steps():
            return
        self.source = "probe"
        self.norms[step] = float(self.ctx.adapter.grad_norm(trainer.strategy.model))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """The strategy keeps the norm it takes for this step unless the step is memory-tracked (a kept 0-dim tensor
        would count in its phases; DeepSpeed's engine keeps its own anyway)."""
        tracked = self.ctx.schedule.windows.get("memory_tracked") or range(0)
        self.ctx.adapter.keep_grad_norm(trainer.strategy.model, int(batch_idx) not in tracked)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        norm = self.ctx.adapter.step_grad_norm(trainer.strategy.model, trainer.optimizers[0])
        if norm is not None:  # read now (after the timing and memory probes' reads of the step): nothing held
            self.source = "strategy"
            self.norms[int(batch_idx)] = float(norm)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.ctx.rank != 0 or not self.norms:
            return
        from zeroexp.probes.reference import trajectory

        cfg, steps, clip = self.ctx.cfg, int(trainer.global_step), self.ctx.adapter.clip_grad_norm
        source = self.ctx.cell.load_from
        start = None if source is None else (source, self.ctx.adapter.read_whole(source.kind, Path(source.dir)))
        ref = trajectory(cfg, steps, clip_grad_norm=clip, start=start)
        avg = trajectory(cfg, steps, clip_grad_norm=clip, averaged_grads=True, start=start) \
            if self.ctx.world_size > 1 else ref
        dtype = str(cfg.precision.param_dtype)
        numel = sum(t.numel() for t in ref.params.values())  # the unsharded model's (frozen ones too: log2 of it)
        self.reference = {"norms": list(ref.norms), "floor_norms": list(avg.norms), "numel": numel,
                          "loss_scaling": cfg.precision.loss_scale is not None,
                          "dtype": dtype}

    def rank_result(self) -> dict[str, Any]:
        return {"norms": {str(s): n for s, n in sorted(self.norms.items())}, "source": self.source,
                "why_none": self.why_none, "reference": self.reference}

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cell: Any) -> ProbeReport:
        return ProbeReport(section=judge_norms(results))


def judge_norms(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The section from every rank's result (index = rank; rank 0's holds the reference's norms): each rank's norm of
    each step it has held to the reference's of that step (see the module's doc)."""
    ref = results[0].get("reference") or {}
    source = next((r.get("source") for r in results if r.get("source")), None)
    if source is None:
        why = next((r["why_none"] for r in results if r.get("why_none")), None) or \
            "no step outside the measured windows to take the norm at (warmup_steps=0), and the strategy computes none"
        said = Check(Verdict.NA, (Reason(Code.GRAD_NORM_NOT_TAKEN, why),))
        return {"source": None, **said.fields()}
    norms, floors = ref.get("norms") or [], ref.get("floor_norms") or []
    rows, worst, skipped = [], None, 0
    every = {int(k) for r in results for k in (r.get("norms") or {})}
    missing = {rank: sorted(every - {int(k) for k in (r.get("norms") or {})}) for rank, r in enumerate(results)}
    missing = {rank: steps for rank, steps in missing.items() if steps}
    for rank, r in enumerate(results):
        for key, got in (r.get("norms") or {}).items():
            step = i = int(key)  # the cell's steps from 0, as the reference's from its start (a checkpoint's too)
            if not 0 <= i < len(norms):
                continue
            if not math.isfinite(got) and ref.get("loss_scaling"):  # a step the loss scaler skipped, on every rank
                skipped += 1
                continue
            want = norms[i]
            err = abs(got - want) / want if want else (0.0 if got == 0 else math.inf)
            if not math.isfinite(err):
                err = math.inf  # a NaN or inf norm where the reference's is finite: beyond any bound
            floor = abs(floors[i] - want) / want if want and i < len(floors) else 0.0
            bound = relative_bound(floor, ref.get("dtype", "float32"), norm_ulps(int(ref.get("numel", 2))))
            row = {"rank": rank, "step": step, "norm": got, "reference": want, "relative_err": err, "bound": bound}
            rows.append(row)
            if worst is None or err / bound > worst["relative_err"] / worst["bound"]:
                worst = row
    if not rows:
        said = Check(Verdict.NA, (Reason(Code.GRAD_NORM_NOT_TAKEN, "no step's norm to compare (none finite, or "
                                                                    "none the reference trained)"),))
        return {"source": source, **said.fields()}
    failed = [r for r in rows if not r["relative_err"] <= r["bound"]]
    out: dict[str, Any] = {"source": source, "ranks": sorted({r["rank"] for r in rows}),
                           "steps": sorted({r["step"] for r in rows}), "compared": len(rows),
                           "max_relative_err": worst["relative_err"], "worst": worst,
                           **({"skipped_nonfinite": skipped} if skipped else {})}
    lost = [Reason(Code.GRAD_NORM_MISSING, f"rank {rank} has no norm at step(s) {', '.join(map(str, steps))} that "
                                          "another rank has") for rank, steps in missing.items()]
    if not failed:
        return {**out, **Check(Verdict.FAIL if lost else Verdict.PASS, tuple(lost)).fields()}
    first_bad = min(failed, key=lambda r: (r["step"], r["rank"]))
    squares = (first_bad["norm"] / first_bad["reference"]) ** 2 if first_bad["reference"] else math.inf
    out.update(failed=len(failed), first_failed=first_bad, squares_counted=squares)
    why = (f"rank {first_bad['rank']} step {first_bad['step']}: norm {first_bad['norm']:.6g} against the reference's "
           f"{first_bad['reference']:.6g} (relative {first_bad['relative_err']:.3g} > bound {first_bad['bound']:.3g}; "
           f"each square counted {squares:.3g} times); {len(failed)} of {len(rows)} (rank, step) norms beyond")
    return {**out, **Check(Verdict.FAIL, (Reason(Code.GRAD_NORM_DIFFERS, why), *lost)).fields()}


def grad_norm_line(s: dict[str, Any]) -> str:
    if s.get("source") is None or "worst" not in s:
        return "; ".join(s.get("reasons") or ["not taken"])
    taken = {"strategy": "the strategy's own", "probe": "taken by the probe outside the measured steps"}[s["source"]]
    line = (f"{taken}: {s['compared']} (rank, step) norms, largest relative error {s['max_relative_err']:.3g} "
            f"(bound {s['worst']['bound']:.3g})")
    return line + (f"; {s['reasons'][0]}" if s.get("reasons") else "")


GradNormProbe.digest_line = staticmethod(grad_norm_line)
