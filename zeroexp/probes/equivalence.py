"""Numerical equivalence with an unsharded reference: ``summary.json[equivalence]``.

After the last training step every rank enters the adapter's ``full_parameters`` (FSDP all-gathers with
``summon_full_params(writeback=False)``; DDP and ZeroRedundancyOptimizer hold full parameters already) and
rank 0 copies them. Rank 0 then trains the reference: a plain ``nn.Module`` from the same seed and
``build_model`` (so the same initial weights), ``torch.optim.AdamW`` with the cell's hyper-parameters, one
process, on the identical global batches (every rank's ``make_batch`` of each step) with the loss of data
parallelism, the mean over ranks of the per-rank losses. It runs after every measured step, so it is in no
memory peak or step time.

The same reference is trained a second time with data parallelism's arithmetic: each rank's gradient of its own
loss, summed in the reverse rank order, then divided by the world size. The two differ only by where the
rounding falls (the order of the sums, the division by N before or after them), which is all that separates
data parallelism from one process. Their largest difference is the run's **reduction-order floor** (computed). AdamW
normalises each update, so a few ulps of gradient on a near-zero component become a sizeable step, and the floor grows
with the steps; a fixed absolute threshold would then call plain DDP wrong. The check's bound is the precision's
threshold, or ``FLOOR_FACTOR`` times the floor where that is larger (``threshold_basis`` says which). What the
reference holds in rank 0's host memory is :mod:`zeroexp.formulas.reference`'s (counted before launch by
``zeroexp.config.resources``): a change to what it keeps changes that formula.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pandas as pd
import torch
from omegaconf import DictConfig

from zeroexp._lib.modules import strip_wrappers, wrapper_prefixes
from zeroexp.cell.source import Source
from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.probes.divergence import divergence_line
from zeroexp.probes.reference import PREFIX as _PREFIX, start_from, trajectory

from zeroexp.tolerances import FLOOR_FACTOR, THRESHOLDS
from zeroexp.results.format import fmt_err, fmt_int, missing
from zeroexp.results.section import Column, ReportTable, raw_rows
from zeroexp.results.verdict import Check, Code, Reason, Verdict

__all__ = ["EquivalenceProbe", "FLOOR_FACTOR", "THRESHOLDS", "train_reference", "start_from", "compare", "max_abs_diff"]

REFERENCE = "unsharded nn.Module + torch.optim.AdamW, one process, same seed, identical global batches"


def train_reference(cfg: DictConfig, steps: int, *, clip_grad_norm: float | None = None,
                    averaged_grads: bool = False, seen: dict[str, Any] | None = None,
                    start: tuple[Source, dict] | None = None) -> dict[str, torch.Tensor]:
    """Train the unsharded reference (:class:`~zeroexp.probes.reference.Reference`) for ``steps`` steps; return its
    parameters by name (on the CPU).

    ``start``: the checkpoint the cell started from (``checkpoint.load_from``) and its state read whole in this
    process (``StrategyAdapter.read_whole``; not the state the cell loaded): the reference starts from that state
    (parameters, AdamW's moments and step) and trains on the batches of the steps after it: the target
    configuration's uninterrupted run from the same state.

    ``clip_grad_norm``, ``averaged_grads``: :class:`~zeroexp.probes.reference.Reference`'s. ``seen``, when given, is
    filled with ``ungraded`` (the trainable parameters the first step gave no gradient, by name), ``buffers`` (the
    buffers after the last step) and ``moved_buffers`` (the names of those training changed).
    """
    run = trajectory(cfg, steps, clip_grad_norm=clip_grad_norm, averaged_grads=averaged_grads, start=start)
    if seen is not None:
        seen.update(ungraded=list(run.ungraded), buffers=run.buffers, moved_buffers=list(run.moved_buffers))
    return run.params


#: Why a parameter forward never uses may differ from the reference by design.
UNGRADED = ("forward never uses it, so the reference gives it no gradient and AdamW leaves it; the strategy holds it "
            "in a flat buffer whose gradient is zero there, so AdamW's weight decay moves it")
#: Why a buffer a training step changes is not compared.
PER_RANK_BUFFER = ("each rank's forward updates it from its own batch (BatchNorm statistics of data parallelism are "
                   "per rank), the reference's from every rank's batch in turn")


def compare_buffers(pl_module: Any, seen: Mapping[str, Any]) -> dict[str, Any]:
    """The module's buffers on rank 0 against the reference's after the same steps: those training leaves as they
    are (masks, tables) must be equal (``buffers_check``); those it changes are listed in ``buffers_not_compared``
    with the reason. Empty for a model without buffers."""
    reference = {_PREFIX + n: b for n, b in (seen.get("buffers") or {}).items()}
    if not reference:
        return {}
    moved = {_PREFIX + n for n in seen.get("moved_buffers", [])}
    mine = {}
    for name, b in pl_module.named_buffers():
        mine[strip_wrappers(name)] = b.detach().to("cpu")  # FSDP1's and checkpoint_wrapper's names out of the path
    differ = [n for n, ref in reference.items() if n not in moved  # in the dtype the strategy holds it in
              and (n not in mine or mine[n].shape != ref.shape or not torch.equal(mine[n], ref.to(mine[n].dtype)))]
    return {"buffers_compared": len(reference) - len(moved), "buffers_check": Verdict.passed_if(not differ),
            "buffers_differ": differ, "buffers_not_compared": [{"tensor": n, "why": PER_RANK_BUFFER}
                                                               for n in sorted(moved)]}


def equivalence_check(verdict: Verdict, code: Code | None = None, why: str = "") -> dict[str, Any]:
    """The section's verdict fields, their one writer: ``check``, ``why`` (where said) and ``reason_codes``. A FAIL
    above the bound says no ``why`` of its own (its numbers are in the section) unless a cause is known."""
    return Check(verdict, () if code is None else (Reason(code, why),)).fields("why")


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest |a - b| over every element of the tensors both mappings name."""
    return max((float((a[n].to(t.dtype) - t).abs().max()) for n, t in b.items() if n in a and t.numel()),
               default=0.0)


def compare(trained: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
            threshold: float | None, floor: float | None = None,
            by_design: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``max_abs_err`` (max |a - b| over every element), ``max_rel_err`` (max over tensors of
    max|a - b| / max|b|) and ``check``: PASS when the names and shapes agree and max_abs_err <= the bound, the
    precision's ``threshold`` or ``FLOOR_FACTOR * floor`` where larger (``floor``: the reduction-order floor,
    None when not measured); SKIP when there is no threshold (a precision without one in :data:`THRESHOLDS`).
    ``by_design``: tensors a strategy may compute otherwise by design, each with the reason: one beyond the bound
    is left out of the errors and listed in ``not_compared`` with its error and that reason."""
    by_design = by_design or {}
    out: dict[str, Any] = {"compared_tensors": len(reference), "threshold": threshold}
    if floor is not None:
        out["reduction_floor"] = floor
    if threshold is not None:
        raised = floor is not None and FLOOR_FACTOR * floor > threshold
        out["effective_threshold"] = FLOOR_FACTOR * floor if raised else threshold
        out["threshold_basis"] = "reduction-order floor" if raised else "precision"
    if set(trained) != set(reference):
        diff = sorted(set(trained) ^ set(reference))
        return {**out, "max_abs_err": None, "max_rel_err": None, **equivalence_check(
            Verdict.FAIL, Code.EQUIVALENCE_NAMES_DIFFER, f"parameter names differ: {', '.join(diff[:5])}")}
    abs_err = rel_err = 0.0
    bound = out.get("effective_threshold")
    not_compared = []
    for name, ref in reference.items():
        got = trained[name].to(ref.dtype)
        if got.shape != ref.shape:
            return {**out, "max_abs_err": None, "max_rel_err": None, **equivalence_check(
                Verdict.FAIL, Code.EQUIVALENCE_SHAPE_DIFFERS,
                f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")}
        err = float((got - ref).abs().max()) if ref.numel() else 0.0
        if name in by_design and bound is not None and err > bound:
            not_compared.append({"tensor": name, "max_abs_err": err, "why": by_design[name]})
            continue
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
    out.update(max_abs_err=abs_err, max_rel_err=rel_err, not_compared=not_compared,
               compared_tensors=len(reference) - len(not_compared))
    if threshold is None:
        return {**out, **equivalence_check(Verdict.SKIP, Code.EQUIVALENCE_NO_THRESHOLD,
                                           "no equivalence threshold for this precision")}
    if abs_err <= out["effective_threshold"]:
        return {**out, **equivalence_check(Verdict.PASS)}
    return {**out, **equivalence_check(Verdict.FAIL, Code.EQUIVALENCE_ABOVE_BOUND)}


def equivalence_table(ok: pd.DataFrame) -> ReportTable:
    """Final parameters against the unsharded reference."""
    keys = ["equivalence.max_abs_err", "equivalence.max_rel_err", "equivalence.reduction_floor",
            "equivalence.threshold", "equivalence.effective_threshold", "equivalence.check", "equivalence.steps",
            "equivalence.compared_tensors"]
    cols = [Column("cell", "label", str), Column("max abs err", keys[0], fmt_err),
            Column("max rel err", keys[1], fmt_err), Column("reduction floor", keys[2], fmt_err),
            Column("threshold", keys[3], fmt_err), Column("bound", keys[4], fmt_err), Column("check", keys[5]),
            Column("steps", keys[6], fmt_int), Column("tensors", keys[7], fmt_int)]
    note = ("Every parameter after the last step against an unsharded nn.Module + AdamW trained in one process on "
            "the same global batches; the reduction floor is how far the same reference moves when only the "
            "rounding of data parallelism's sums changes. PASS when max abs err <= bound: the precision's "
            f"threshold, or {FLOOR_FACTOR:g}x the floor where larger.")
    return ReportTable("equivalence", "Numerical equivalence", raw_rows(ok, keys), cols, note)


def equivalence_line(e: dict[str, Any]) -> str:
    bound = e.get("effective_threshold", e.get("threshold"))
    basis = e.get("threshold_basis")
    return (f"max abs err {fmt_err(e.get('max_abs_err'))} vs bound {fmt_err(bound)}"
            + ("" if missing(basis) else f" ({basis})") + f" after {e.get('steps')} steps"
            + ("" if missing(e.get("cause")) else f"; cause: {e['cause']}")
            + (f"; {divergence_line(e['divergence'])}" if isinstance(e.get("divergence"), dict) else ""))


class EquivalenceProbe(Probe):
    """Full parameters after training vs the unsharded reference (rank 0 reports)."""

    name = "equivalence"
    order = 60
    dry_run_absent = "no parameter values to compare with the reference"

    digest_line = staticmethod(equivalence_line)
    report_table = staticmethod(equivalence_table)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.threshold = THRESHOLDS.get(ctx.cfg.precision.name)  # None: errors reported, check SKIP
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        trained: dict[str, torch.Tensor] = {}
        with self.ctx.adapter.full_parameters(trainer.strategy.model) as full:  # a collective: every rank
            if self.ctx.rank == 0:  # activation_checkpointing=full: the wrapper's prefix is no name of the model
                ckpt = wrapper_prefixes()["checkpoint"]
                trained = {name.replace(ckpt, ""): t.to("cpu", copy=True) for name, t in full.items()}
        if self.ctx.rank == 0:
            steps, clip = int(trainer.global_step), self.ctx.adapter.clip_grad_norm
            seen: dict[str, Any] = {}
            source = self.ctx.cell.load_from
            start = None if source is None else (source, self.ctx.adapter.read_whole(source.kind, Path(source.dir)))
            reference = train_reference(self.ctx.cfg, steps, clip_grad_norm=clip, seen=seen, start=start)
            floor = None
            if self.ctx.world_size > 1:  # one rank: there is no other order
                averaged = train_reference(self.ctx.cfg, steps, clip_grad_norm=clip, averaged_grads=True,
                                           start=start)
                floor = max_abs_diff(averaged, reference)
            # only a flat gradient buffer (zeroexp's ZeRO, FSDP1) gives an unused parameter a gradient by design;
            # elsewhere it must stay where the reference leaves it, or the adapter names why not (``cause``)
            flat = self.ctx.expect.layout.family.flat_buffers
            by_design = {_PREFIX + n: UNGRADED for n in seen.get("ungraded", [])} if flat else {}
            known = self.ctx.adapter.known_divergence(seen.get("ungraded", []))
            self.result = {"reference": REFERENCE, "steps": steps,
                           **compare(trained, {_PREFIX + n: t for n, t in reference.items()}, self.threshold, floor,
                                     by_design),
                           **compare_buffers(pl_module, seen)}
            if self.result.get("buffers_check") == Verdict.FAIL and self.result.get("check") in (Verdict.PASS,
                                                                                                 Verdict.SKIP):
                self.result.update(equivalence_check(Verdict.FAIL, Code.EQUIVALENCE_BUFFERS_DIFFER,
                                                     "buffers the reference keeps unchanged differ: "
                                                     + ", ".join(self.result["buffers_differ"][:5])))
            if known is not None:  # the configuration implies the divergence: named, whatever the verdict
                self.result["cause"] = known[0]
                r = self.result
                if r.get("check") == Verdict.FAIL and "why" not in r:  # above the bound: the cause says why
                    r.update(equivalence_check(Verdict.FAIL, Code.EQUIVALENCE_ABOVE_BOUND,
                                               f"max abs err {fmt_err(r.get('max_abs_err'))} > bound "
                                               f"{fmt_err(r.get('effective_threshold'))}: {known[1]}"))

    def rank_result(self) -> dict[str, Any]:
        return self.result

    @classmethod
    def aggregate(cls, results, cell) -> ProbeReport:
        return ProbeReport(section=dict(results[0]))


# The digest line and the report section (Probe.digest_line, Probe.report_table).


