"""The peak model: what a rank holds above its steady state in each phase of a training step, by category."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Segment", "StepTrace"]


@dataclass(frozen=True)
class Segment:
    """One stretch of the traced step, ending at a hook: ``phase`` (forward | backward), the ``unit`` whose hook ends
    it (``loss``: the loss and its copy; ``root``: the end of backward), ``at`` (start | end of that unit); the peak
    inside the stretch and the bytes live at its end, relative to the step's start, by category."""

    phase: str
    unit: str
    at: str
    peak_bytes: int
    peak_by_category: dict
    end_bytes: int
    end_by_category: dict


@dataclass(frozen=True)
class StepTrace:
    """The bare model's step (``zeroexp.plan.steptrace.trace_step``): segments in time order; ``loss_bytes``: the
    loss and the training loop's copy of it, which the step keeps to its end."""

    batch_size: int
    segments: tuple[Segment, ...]
    loss_bytes: int


#: How each strategy row holds gradients in backward (the families the peak model covers; other rows: no model yet).
#: ``new``: autograd allocates each parameter's ``.grad`` after ``zero_grad(set_to_none=True)`` freed the last
#: step's (DDP; ZeroRedundancyOptimizer on DDP). ``in_place``: the gradients stay allocated across steps and autograd
#: accumulates into them (zeroexp's ZeRO-1: views of its flat buckets). ``bucket``: no gradient survives the step; a
#: bucket's flat buffer is allocated when its first gradient is ready and released in the optimizer step, after its
#: reduction and before the update (zeroexp's ZeRO-2, ``ShardedAdamW.step``).
GRADIENT_FLOW = {"ddp": "new", "zro": "new", "zero1": "in_place", "zero2": "bucket"}
PHASES = ("forward", "backward", "optimizer")


def adamw_temporaries(numels: tuple[int, ...] | list[int], itemsize: int, foreach: bool) -> int:
    """Bytes torch's AdamW allocates above its state during one step (no amsgrad, no capturable, decoupled weight
    decay; torch/optim/adam.py). ``foreach``: one ``_foreach_sqrt`` list of every tensor's size alive at once.
    Single-tensor (torch's default on CPU): per parameter ``denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`` holds
    the sqrt and the quotient at once, while the previous parameter's ``denom`` is still bound to the loop variable:
    max(2 n_0, n_{i-1} + 2 n_i) elements."""
    n = [int(x) for x in numels if x]
    if not n:
        return 0
    if foreach:
        return sum(n) * itemsize
    return max([2 * n[0], *(a + 2 * b for a, b in zip(n, n[1:]))]) * itemsize


def _add(into: dict, cats: dict, sign: int = 1) -> dict:
    out = dict(into)
    for c, b in cats.items():
        out[c] = out.get(c, 0) + sign * int(b)
    return out


def phase_peaks(flow: str, trace: StepTrace, *, steady_grad_bytes: int, buckets: tuple[int, ...],
                optimizer_numels: tuple[int, ...], optimizer_itemsize: int, foreach: bool) -> dict[str, dict]:
    """Per phase, the bytes a rank holds above its steady state at the phase's peak, by category.

    Forward: the traced forward's peak (the previous step's loss and its copy freed first, ``trace.loss_bytes``).
    Backward: per traced segment, its peak, less what the flow does not allocate anew (``in_place`` and ``bucket``:
    the traced ``.grad`` tensors; ``new``: the steady gradients ``zero_grad`` freed), plus, for ``bucket``, every
    bucket opened before the segment started (``buckets``: each one's bytes in reduce order, opened by its first
    ready gradient). Optimizer: AdamW's temporaries over the tensors this rank steps (:func:`adamw_temporaries`), or,
    for ``bucket``, the buckets alive when the step begins if they are more (released before the update). Each
    segment's figure is a lower bound of the real one; the phase's peak is the largest."""
    if flow not in ("new", "in_place", "bucket"):
        raise ValueError(f"unknown gradient flow {flow!r}")
    forward = [s for s in trace.segments if s.phase == "forward"]
    top = max(forward, key=lambda s: s.peak_bytes)
    out = {"forward": {"bytes": top.peak_bytes - trace.loss_bytes,
                       "by_category": _add(top.peak_by_category, {"activations": -trace.loss_bytes})}}
    best, before = None, 0  # before: traced gradient bytes at the segment's start
    edges = [sum(buckets[:i]) for i in range(len(buckets) + 1)]
    for s in (s for s in trace.segments if s.phase == "backward"):
        grads = s.peak_by_category.get("gradients", 0)
        cats = _add(s.peak_by_category, {"activations": -trace.loss_bytes})
        if flow == "new":
            cats = _add(cats, {"gradients": -steady_grad_bytes})
        else:
            cats = _add(cats, {"gradients": -grads})
            if flow == "bucket":
                held = sum(b for b, lo in zip(buckets, edges) if lo < before)
                cats = _add(cats, {"gradients": held})
        total = sum(cats.values())
        if best is None or total > best["bytes"]:
            best = {"bytes": total, "by_category": cats}
        before = s.end_by_category.get("gradients", 0)
    out["backward"] = best
    temps = adamw_temporaries(optimizer_numels, optimizer_itemsize, foreach)
    held = sum(buckets) if flow == "bucket" else 0
    out["optimizer"] = ({"bytes": temps, "by_category": {"optimizer_state": temps}} if temps >= held else
                        {"bytes": held, "by_category": {"gradients": held}})
    for rec in out.values():
        rec["by_category"] = {c: int(b) for c, b in rec["by_category"].items() if b}
    return out
