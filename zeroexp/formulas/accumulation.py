"""Gradient accumulation (``grad_accum=K``) in the peak model: what the K micro-batches of one optimizer step hold.

The memory probe measures each phase's peak as the highest over the step's micro-batches (zeroexp/probes/memory.py),
so a phase's prediction is the highest over the micro-batches' own: the first starts from the steady state as a step
without accumulation does, every later one starts with what the earlier ones left (the gradients accumulated so
far). Sources: torch's ``AccumulateGrad`` (an existing ``.grad`` is added into in place), DDP's ``no_sync``
(torch/nn/parallel/distributed.py: no bucket copy, no all_reduce), zeroexp's ``ShardedAdamW.accumulating``
(zeroexp/sharding.py).
"""

from __future__ import annotations

from zeroexp.formulas.peak import StepTrace, phase_peaks

__all__ = ["ACCUMULATING_FLOWS", "accumulated_phase_peaks", "accumulated_grad_bytes"]

#: What each gradient flow of the peak model does with K micro-batches (the flows whose accumulation is modelled):
#: ``new`` (DDP, ZeroRedundancyOptimizer on DDP, under ``no_sync``): the first micro-batch allocates the gradients
#: after ``zero_grad`` freed them, as without accumulation; every later one adds into them in place, so it holds the
#: whole gradient from its start. ``in_place`` (zeroexp's ZeRO-1): its flat buffers accumulate, every micro-batch as
#: a step without accumulation. ``bucket`` (zeroexp's ZeRO-2): every micro-batch opens its buckets, reduce-scatters
#: them, adds the shard into the gradient shard (steady) and releases them, as a step without accumulation.
ACCUMULATING_FLOWS = {
    "new": "the first micro-batch allocates the gradients, the later ones add into them in place",
    "in_place": "the flat gradient buffers accumulate in place, every micro-batch as one step",
    "bucket": "every micro-batch reduce-scatters its buckets into the gradient shard and releases them",
}


def accumulated_phase_peaks(flow: str, trace: StepTrace, micro_batches: int, **terms) -> dict[str, dict]:
    """:func:`zeroexp.formulas.peak.phase_peaks` over the ``micro_batches`` micro-batches of one optimizer step: per
    phase the highest of the micro-batches' peaks (``terms``: phase_peaks' keywords, ``in_place`` the step traced with
    the gradients allocated). For ``new`` the later micro-batches are the ``in_place`` flow: the gradients are held
    from their start (as in the steady state) and autograd adds into them."""
    if flow not in ACCUMULATING_FLOWS:
        raise ValueError(f"no accumulation model for gradient flow {flow!r}")
    first = phase_peaks(flow, trace, **terms)
    if micro_batches < 2 or flow != "new":
        return first
    later = phase_peaks("in_place", trace, **terms)
    return {ph: max((first[ph], later[ph]), key=lambda rec: rec["bytes"]) for ph in first}


def accumulated_grad_bytes(flow: str, grad_bytes: int) -> int:
    """The gradient bytes the later micro-batches of a step hold from their start that a step without accumulation
    does not (``grad_bytes``: the rank's gradients in the steady state): ``new`` holds the gradients ``zero_grad``
    frees at K=1; ``in_place`` holds its buffers at K=1 too; ``bucket`` keeps only its gradient shard (steady)."""
    if flow not in ACCUMULATING_FLOWS:
        raise ValueError(f"no accumulation model for gradient flow {flow!r}")
    return int(grad_bytes) if flow == "new" else 0
