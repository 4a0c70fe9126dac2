"""The unsharded reference a cell is checked against, one optimizer step at a time.

A plain ``nn.Module`` from the cell's seed and ``build_model`` (so the same initial weights), ``torch.optim.AdamW`` with
the cell's hyper-parameters and update path, one process, on the identical global batches (every rank's ``make_batch``
of each step) with the loss of data parallelism, the mean over ranks of the per-rank losses. The equivalence probe
(:mod:`zeroexp.probes.equivalence`) trains it to the end; the divergence replay (:mod:`zeroexp.probes.divergence`)
steps it beside the strategy and compares after every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from zeroexp.models import LOSSES, build_model, make_batch

__all__ = ["Reference", "Trajectory", "trajectory", "start_from", "PREFIX"]

#: CellModule keeps the user's model as ``net``: the prefix of every parameter name the adapter reports.
PREFIX = "net."


class Reference:
    """The reference of ``cfg``, ready for its first step (``start``: the checkpoint the cell started from, read
    whole; the reference starts from its parameters, moments and step, on the batches of the steps after it).

    ``clip_grad_norm``: clip by the global norm as the strategy does. ``averaged_grads``: data parallelism's arithmetic
    instead of the mean loss's: each rank's gradient of its own loss, summed in the reverse rank order, then divided by
    the world size (what separates data parallelism from one process: the reduction-order floor)."""

    def __init__(self, cfg: DictConfig, *, clip_grad_norm: float | None = None, averaged_grads: bool = False,
                 start: tuple[Any, Mapping[str, Any]] | None = None) -> None:
        import lightning.pytorch as pl  # here: the probes' modules are read without Lightning (zeroexp.probes.base)

        self.model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        pl.seed_everything(int(cfg.seed), workers=False, verbose=False)  # exactly what each rank did before build
        self.net = build_model(self.model_cfg)
        self.params = list(self.net.parameters())
        o = cfg.optimizer
        impl = o.get("impl")  # the cell's AdamW path (optimizer.impl), so that only the sharding differs
        path = {} if impl is None else {"foreach": impl == "foreach", "fused": impl == "fused"}
        self.betas = tuple(float(b) for b in o.betas)
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=self.betas, eps=o.eps, weight_decay=o.weight_decay,
                                     **path)
        if start is not None:
            start_from(self.net, self.opt, start[1])
        self.loss_fn = LOSSES[cfg.model.loss]
        self.n, self.k, self.batch, self.seed = int(cfg.world_size), int(cfg.grad_accum), int(cfg.batch_size), \
            int(cfg.seed)
        self.clip, self.averaged = clip_grad_norm, averaged_grads
        self.step = 0 if start is None else start[0].step  # the next optimizer step's index
        #: After each step: each rank's loss of the step (the mean of its micro-batches'), the total gradient norm
        #: before clipping (``total_norm``; ``grad_norm`` the same where the reference clips, else None), the
        #: trainable parameters the step gave no gradient (by name).
        self.rank_losses: list[float] = []
        self.total_norm: float = 0.0
        self.grad_norm: float | None = None
        self.ungraded: list[str] = []

    def take_step(self) -> None:
        """One optimizer step of ``grad_accum`` micro-batches, each rank's part of the global batch in turn."""
        params, n, k = self.params, self.n, self.k
        self.opt.zero_grad(set_to_none=True)
        losses = [0.0] * n
        for micro in range(self.step * k, self.step * k + k):  # grad_accum=K: K micro-batches per step, each loss / K
            # The global batch, fed rank by rank: each rank's loss is the loss of its own batch, as in training.
            parts = [make_batch(self.model_cfg, self.batch, self.seed, micro, r) for r in range(n)]
            if self.averaged:
                total: list[torch.Tensor | None] = [None] * len(params)
                held = [p.grad for p in params]
                for r in reversed(range(n)):
                    for p in params:
                        p.grad = None
                    loss = self.loss_fn(self.net(parts[r]), parts[r])
                    losses[r] += float(loss.detach()) / k
                    (loss / k if k > 1 else loss).backward()
                    total = [g if t is None else (t if g is None else t + g)
                             for t, g in zip(total, (p.grad for p in params))]
                for p, t, h in zip(params, total, held):
                    p.grad = None if t is None else (t / n if h is None else h + t / n)
            else:
                each = [self.loss_fn(self.net(b), b) for b in parts]
                losses = [s + float(x.detach()) / k for s, x in zip(losses, each)]
                loss = torch.stack(each).mean()
                (loss / k if k > 1 else loss).backward()
        self.rank_losses = losses
        self.ungraded = [name for name, p in self.net.named_parameters() if p.requires_grad and p.grad is None]
        graded = [p for p in params if p.grad is not None]
        # torch.nn.utils.clip_grad_norm_ is these two calls (torch/nn/utils/clip_grad.py): the norm is kept
        total = torch.nn.utils.get_total_norm([p.grad for p in graded], 2.0)
        self.total_norm = float(total)
        self.grad_norm = None
        if self.clip is not None:  # the strategy clips by the global norm: so does the reference
            torch.nn.utils.clip_grads_with_norm_(graded, self.clip, total)
            self.grad_norm = self.total_norm
        self.opt.step()
        self.step += 1

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by its name in the model (no prefix), detached."""
        return {name: p.detach() for name, p in self.net.named_parameters()}

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """AdamW's ``(exp_avg, exp_avg_sq)`` of every parameter that has them, by name."""
        out = {}
        for name, p in self.net.named_parameters():
            s = self.opt.state.get(p)
            if s and "exp_avg" in s:
                out[name] = (s["exp_avg"], s["exp_avg_sq"])
        return out

    def trainable(self) -> set[str]:
        return {name for name, p in self.net.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Trajectory:
    """A reference trained for its steps: ``params`` after the last (by name), ``norms`` the total gradient norm of
    each step before clipping, ``ungraded`` the trainable parameters the first step gave no gradient, ``buffers``
    after the last step and ``moved_buffers`` the names of those training changed."""

    params: dict[str, torch.Tensor]
    norms: tuple[float, ...]
    ungraded: tuple[str, ...]
    buffers: dict[str, torch.Tensor]
    moved_buffers: tuple[str, ...]


def trajectory(cfg: DictConfig, steps: int, *, clip_grad_norm: float | None = None, averaged_grads: bool = False,
               start: tuple[Any, Mapping[str, Any]] | None = None) -> Trajectory:
    """:class:`Reference` of ``cfg`` trained ``steps`` steps (its arguments), once per invocation for the same
    arguments (``zeroexp.cell.memo``: the equivalence and gradient-norm probes of a rank read the same runs)."""
    from zeroexp.cell.memo import memoized

    key = (OmegaConf.to_yaml(cfg), steps, clip_grad_norm, averaged_grads, None if start is None else repr(start[0]))
    return memoized("reference_runs", key, lambda: _train(cfg, steps, clip_grad_norm, averaged_grads, start))


def _train(cfg: DictConfig, steps: int, clip: float | None, averaged: bool, start: Any) -> Trajectory:
    ref = Reference(cfg, clip_grad_norm=clip, averaged_grads=averaged, start=start)
    initial = {name: b.detach().clone() for name, b in ref.net.named_buffers()}
    norms: list[float] = []
    ungraded: tuple[str, ...] = ()
    for i in range(steps):
        ref.take_step()
        norms.append(ref.total_norm)
        if i == 0:
            ungraded = tuple(ref.ungraded)
    buffers = {name: b.detach() for name, b in ref.net.named_buffers()}
    return Trajectory(ref.parameters(), tuple(norms), ungraded, buffers,
                      tuple(n for n, b in buffers.items() if not torch.equal(b, initial[n])))


def start_from(net: torch.nn.Module, opt: torch.optim.Optimizer, whole: Mapping[str, Any]) -> None:
    """Load a checkpoint's state read whole (``{"model": ..., "optim": ...}``) into the plain ``net`` and its AdamW
    ``opt``: the parameters and buffers it holds by name (CellModule's ``net.`` prefix taken off), each parameter's
    moments and step where it has them (copied: ``whole`` is left as it was)."""
    net.load_state_dict({n.removeprefix(PREFIX): t for n, t in whole["model"].items()})
    index = {name: i for i, (name, _) in enumerate(net.named_parameters())}
    # copies: AdamW's load keeps a tensor that needs no cast as it is, and its step updates moments and step count in
    # place: a second reference started from the same state read whole would start where the first one ended
    state = {index[n.removeprefix(PREFIX)]: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for n, s in whole["optim"]["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
