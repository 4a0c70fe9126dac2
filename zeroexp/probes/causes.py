"""The likely cause of a divergence at its first tensor (:mod:`zeroexp.probes.divergence`), read off what differs
there and what the cell's configuration does at that tensor. Each cause is a stable code (``summary.json``'s
``divergence.cause``) and a sentence with the numbers that decided it.

In the order they are tried:

- ``rank_batch``: a rank's loss of the step differs from the reference's loss of that rank's batch (the same
  parameters going in, the step before agreed): that rank's data or its forward differ.
- ``frozen_updated``: a parameter the model freezes (``requires_grad=False``) changed.
- ``decay_without_gradient`` / ``update_without_gradient``: the reference's step gave the parameter no gradient
  (forward never uses it: torch's AdamW skips it) and the strategy moved it: a flat buffer's or DeepSpeed's zero
  gradient let AdamW's weight decay (or its update) move it.
- ``clip_scale`` / ``grad_scale``: every gradient is the reference's times one factor ``c``. With clipping, the
  strategy clipped by another total norm, ``norm_ref / c`` where both clip (the factor between the two norms, squared,
  says how many times each square was counted: a norm reduced over a group too large or too small); without, a loss
  or gradient scale differs (a division by the world size or the accumulation steps).
- ``rounding``: every gradient differs from the reference's by about the unit roundoff of a 16-bit format, relative
  (bf16 2^-8, fp16 2^-11: IEEE 754 / bfloat16's significand widths): a reduction, an accumulation or an upcast in
  that format, named with the cell's precision and reduce dtype.
- ``second_moment``: the gradients agree but AdamW's second moment does not (betas, or the optimizer's state).
- ``update``: gradient and moments agree, the parameter after the step does not (learning rate, weight decay, eps).
- ``gradient``: the gradient differs in no pattern above (data, forward or a reduction).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = ["Evidence", "cause_of", "CAUSES"]

CAUSES = ("rank_batch", "frozen_updated", "decay_without_gradient", "update_without_gradient", "clip_scale",
          "grad_scale", "rounding", "second_moment", "update", "gradient")
#: Unit roundoff of the 16-bit formats (half the distance from 1 to the next number: 2^-p for p significand bits
#: after the leading one, bf16 7 + 1 rounding bit, fp16 10 + 1).
ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


@dataclass
class Evidence:
    """What the divergence replay saw at the step: the cell's config, the gradients (strategy's ``got``, the
    reference's ``ref``) and their bound, the ranks whose loss differs, the reference's trainable and ungraded
    parameters, its total gradient norm before clipping, the tensors excused by design."""

    cfg: Any
    step: int
    got: Mapping[str, torch.Tensor]
    ref: Mapping[str, torch.Tensor]
    bound: float
    ranks: list[int] = field(default_factory=list)
    trainable: set[str] = field(default_factory=set)
    ungraded: list[str] = field(default_factory=list)
    ref_norm: float | None = None
    excused: Mapping[str, str] = field(default_factory=dict)


def cause_of(kind: str, tensor: str, e: Evidence) -> tuple[str, str, dict[str, float]]:
    """``(code, sentence, numbers)`` for the first parting, ``kind`` of ``tensor`` (``grad``, ``exp_avg_sq``,
    ``param``); ``numbers``: what decided it, where a number did (``clip_scale``: ``factor``, ``norm``,
    ``reference_norm``, ``squares_counted``; ``grad_scale``: ``factor``; ``rounding``: ``relative``)."""
    code, why, *numbers = _cause(kind, tensor, e)
    return code, why, (numbers[0] if numbers else {})


def _cause(kind: str, tensor: str, e: Evidence) -> tuple[Any, ...]:
    if e.ranks:
        which = ", ".join(str(r) for r in e.ranks)
        return "rank_batch", (f"the loss of rank {which} at step {e.step} differs from the reference's loss of the "
                              "same batch on parameters that agreed before the step: that rank's batch or its forward "
                              "differ")
    if kind == "param" and tensor not in e.trainable:
        return "frozen_updated", (f"{tensor} is frozen (requires_grad=False) and the reference leaves it; the "
                                  f"strategy's copy changed at step {e.step}")
    if kind == "param" and tensor in e.ungraded:
        wd = float(e.cfg.optimizer.weight_decay)
        if wd > 0:
            return "decay_without_gradient", (
                f"the step gives {tensor} no gradient (forward never uses it), so torch's AdamW skips it; the strategy "
                f"stepped it with a zero gradient and weight_decay={wd:g} moved it")
        return "update_without_gradient", (f"the step gives {tensor} no gradient and the reference leaves it; the "
                                           "strategy's optimizer moved it")
    if kind == "grad":
        scaled = uniform_scale(e.got, e.ref, e.bound)
        if scaled is not None:
            return _scale_cause(scaled, e)
        fmt, relative = rounding_format(e.got, e.ref)
        if fmt is not None:
            return "rounding", _rounding_sentence(fmt, e), {"relative": relative}
        return "gradient", (f"the gradient of {tensor} at step {e.step} differs in no pattern (not one factor, not a "
                            "16-bit rounding) while every rank's loss agrees: the backward or the reduction differs")
    if kind == "exp_avg_sq":
        return "second_moment", (f"the gradients agree at step {e.step} but AdamW's second moment of {tensor} does "
                                 "not: the betas or the optimizer's state differ")
    return "update", (f"gradient and moments of {tensor} agree at step {e.step}, the parameter after the step does "
                      "not: the learning rate, the weight decay or eps of its update differ")


def uniform_scale(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], bound: float) -> float | None:
    """The one factor ``c`` with ``got ~ c * ref`` for every gradient (each tensor's least-squares factor within
    ``bound`` of the others and the residual within ``bound``), where it is not 1; else None."""
    factors = []
    for n, r in ref.items():
        g = got.get(n)
        rr = float((r.double() * r.double()).sum()) if g is not None else 0.0
        if g is None or rr == 0:
            continue
        c = float((g.double() * r.double()).sum()) / rr
        if float((g.double() - c * r.double()).abs().max()) > bound * float(r.double().abs().max()):
            return None
        factors.append(c)
    if not factors:
        return None
    c = sorted(factors)[len(factors) // 2]
    if any(abs(f - c) > bound * max(abs(c), 1e-30) * 4 for f in factors) or abs(c - 1) <= bound * 4:
        return None
    return c


def _scale_cause(c: float, e: Evidence) -> tuple[Any, ...]:
    clip = e.cfg.strategy.get("clip_grad_norm")
    if clip is None or e.ref_norm is None:
        return "grad_scale", (f"every gradient at step {e.step} is the reference's times {c:.6g}: a loss or gradient "
                              "scale differs (the division by the world size or by the accumulation steps)"), \
            {"factor": c}
    ref_coef = min(1.0, float(clip) / (e.ref_norm + 1e-6))  # torch.nn.utils.clip_grads_with_norm_'s coefficient
    coef = c * ref_coef
    said = f"every gradient at step {e.step} is the reference's times {c:.6g} under clip_grad_norm={float(clip):g}"
    if coef >= 1.0 - e.bound:  # within the gradients' bound of not clipping at all
        return "clip_scale", (f"{said}: the strategy did not clip where the reference's total norm "
                              f"{e.ref_norm:.6g} did"), {"factor": c, "reference_norm": e.ref_norm}
    norm = float(clip) / coef - 1e-6
    ratio = (norm / e.ref_norm) ** 2
    times = (f"each square counted {ratio:.3g} times: a norm summed over a group {round(ratio)} times too large"
             if ratio > 1 else f"{ratio:.3g} of the squares counted: a norm summed over too small a group")
    return "clip_scale", (f"{said}: the strategy clipped by a total norm of {norm:.6g} where the reference's is "
                          f"{e.ref_norm:.6g} ({times})"), \
        {"factor": c, "norm": norm, "reference_norm": e.ref_norm, "squares_counted": ratio}


def rounding_format(got: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> tuple[str | None, float]:
    """The 16-bit format whose rounding every gradient's relative difference (its norm against the reference's)
    matches: between an eighth of and twice its unit roundoff (round to nearest moves an element by at most the
    roundoff, relative, on average about half of it), and the largest relative difference; None where no format
    matches every gradient."""
    errs = []
    for n, r in ref.items():
        g = got.get(n)
        norm = float(r.double().norm()) if g is not None else 0.0
        if g is None or norm == 0:
            continue
        errs.append(float((g.double() - r.double()).norm()) / norm)
    for fmt, u in ROUNDOFF.items():
        if errs and all(u / 8 <= x <= 2 * u for x in errs):
            return fmt, max(errs)
    return None, max(errs, default=0.0)


def _rounding_sentence(fmt: str, e: Evidence) -> str:
    precision = str(e.cfg.precision.name)
    reduce = e.cfg.strategy.get("reduce_dtype")
    setting = (f"the cell computes in {precision}" + (f" and reduces in {reduce}" if reduce else
                                                     " and reduces in its compute dtype")
               if precision != "fp32" else "the cell is fp32 throughout: something rounds the gradient (a "
                                           "communication hook, a low-precision reduction or accumulation)")
    return (f"every gradient at step {e.step} differs from the reference's by {fmt}'s rounding (relative "
            f"2^-{int(-torch.log2(torch.tensor(ROUNDOFF[fmt])))} per element): {setting}")
