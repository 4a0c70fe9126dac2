"""Numerical equivalence with an unsharded reference: ``summary.json[equivalence]``.

After the last training step every rank enters the adapter's ``full_parameters`` (FSDP all-gathers with
``summon_full_params(writeback=False)``; DDP and ZeroRedundancyOptimizer hold full parameters already) and
rank 0 copies them. Rank 0 then trains the reference: a plain ``nn.Module`` from the same seed and
``build_model`` (so the same initial weights), ``torch.optim.AdamW`` with the cell's hyper-parameters, one
process, on the identical global batches (every rank's ``make_batch`` of each step) with the loss of data
parallelism, the mean over ranks of the per-rank losses. It runs after every measured step, so it is in no
memory peak or step time.
"""

from __future__ import annotations

from typing import Any, Mapping

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from zeroexp.models import LOSSES, build_model, make_batch
from zeroexp.probes.base import Probe, ProbeReport

__all__ = ["EquivalenceProbe", "THRESHOLDS", "train_reference", "compare"]

#: max_abs_err allowed per precision. fp32: different reduction orders (all-reduce vs one process, sharded
#: vs whole-tensor AdamW) move weights by a few ulps per step; 1e-5 is far above that and far below any real
#: divergence (a changed batch moves weights by ~lr = 1e-3). A precision missing here: errors reported, SKIP.
#: bf16 / fp16 (fp32 master, low-precision forward and backward) against the fp32 reference: rounding (8 / 11
#: significand bits) flips Adam's lr-sized steps on gradients within the noise, so the drift grows with the
#: steps. Measured with zero1/zero2 at lr 1e-3: mlp (N=2-4, 10-30 steps) bf16 1.5e-3 to 2.1e-3, fp16 2.7e-4 to
#: 7.3e-4; gpt (N=2) bf16 6.8e-3 (10 steps) and 1.2e-2 (30), fp16 3.0e-3 and 5.2e-3. Sized for cells of up to
#: about 30 steps; they catch a divergence, not an error of one step (about lr).
THRESHOLDS: dict[str, float] = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 1e-2}
REFERENCE = "unsharded nn.Module + torch.optim.AdamW, one process, same seed, identical global batches"
#: CellModule keeps the user's model as ``net``: the prefix of every parameter name the adapter reports.
_PREFIX = "net."


def train_reference(cfg: DictConfig, steps: int) -> dict[str, torch.Tensor]:
    """Train the unsharded reference for ``steps`` steps; return its parameters by name (on the CPU)."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    pl.seed_everything(int(cfg.seed), workers=False, verbose=False)  # exactly what each rank did before build
    net = build_model(model_cfg)
    o = cfg.optimizer
    opt = torch.optim.AdamW(net.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    loss_fn = LOSSES[cfg.model.loss]
    for step in range(steps):
        # The global batch, fed rank by rank: each rank's loss is the loss of its own batch, as in training.
        parts = [make_batch(model_cfg, int(cfg.batch_size), int(cfg.seed), step, r) for r in range(int(cfg.world_size))]
        loss = torch.stack([loss_fn(net(b), b) for b in parts]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.strategy.get("clip_grad_norm") is not None:  # the strategy clips by the global norm: so does DDP
            torch.nn.utils.clip_grad_norm_(net.parameters(), float(cfg.strategy.clip_grad_norm))
        opt.step()
    return {name: p.detach() for name, p in net.named_parameters()}


def compare(trained: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
            threshold: float | None) -> dict[str, Any]:
    """``max_abs_err`` (max |a - b| over every element), ``max_rel_err`` (max over tensors of
    max|a - b| / max|b|) and ``check``: PASS when the names and shapes agree and max_abs_err <= threshold;
    SKIP when there is no threshold (a precision without one in :data:`THRESHOLDS`)."""
    out: dict[str, Any] = {"compared_tensors": len(reference), "threshold": threshold}
    if set(trained) != set(reference):
        diff = sorted(set(trained) ^ set(reference))
        return {**out, "max_abs_err": None, "max_rel_err": None, "check": "FAIL",
                "why": f"parameter names differ: {', '.join(diff[:5])}"}
    abs_err = rel_err = 0.0
    for name, ref in reference.items():
        got = trained[name].to(ref.dtype)
        if got.shape != ref.shape:
            return {**out, "max_abs_err": None, "max_rel_err": None, "check": "FAIL",
                    "why": f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"}
        err = float((got - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
    out.update(max_abs_err=abs_err, max_rel_err=rel_err)
    if threshold is None:
        return {**out, "check": "SKIP", "why": "no equivalence threshold for this precision"}
    return {**out, "check": "PASS" if abs_err <= threshold else "FAIL"}


class EquivalenceProbe(Probe):
    """Full parameters after training vs the unsharded reference (rank 0 reports)."""

    name = "equivalence"

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.threshold = THRESHOLDS.get(ctx.cfg.precision.name)  # None: errors reported, check SKIP
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        trained: dict[str, torch.Tensor] = {}
        with self.ctx.adapter.full_parameters(trainer.strategy.model) as full:  # a collective: every rank
            if self.ctx.rank == 0:
                trained = {name: t.to("cpu", copy=True) for name, t in full.items()}
        if self.ctx.rank == 0:
            reference = train_reference(self.ctx.cfg, steps=int(trainer.global_step))
            self.result = {"reference": REFERENCE, "steps": int(trainer.global_step),
                           **compare(trained, {_PREFIX + n: t for n, t in reference.items()}, self.threshold)}

    def rank_result(self) -> dict[str, Any]:
        return self.result

    @classmethod
    def aggregate(cls, results, cfg) -> ProbeReport:
        return ProbeReport(section=dict(results[0]))
