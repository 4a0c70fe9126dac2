"""Time of a collective and of compute: the latency-bandwidth model, its fit, the two-level ring, the overlap rule
of the device.

[NCCL-TESTS] doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x bus factor (:func:`~zeroexp.formulas.bus_factor`),
the bandwidth each rank's link carries in the ring model, comparable across ops and N. So one op on N ranks takes
``t = alpha + S x bus_factor(op, N) / busbw`` [HOCKNEY] (alpha: latency, busbw: the asymptotic bus bandwidth).
[HOCKNEY] R. Hockney, "The communication challenge for MPP", Parallel Computing 20(3), 1994: t = alpha + n / beta.
[THAKUR] Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA 2005:
ring reduce_scatter / all_gather (N-1)/N x S per rank, all_reduce twice that.
[HIER] Sergeev, Del Balso, "Horovod", arXiv:1802.05799, and NCCL's tree/ring over nodes: a collective across m nodes
of g ranks is an intra-node reduce_scatter, the inter-node collective on S / g per rank (every rank on its own NIC),
then an intra-node all_gather.
[KAPLAN] Kaplan et al. "Scaling Laws for Neural Language Models", arXiv:2001.08361, 2.1: forward 2N FLOPs per token,
backward twice that (6N in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroexp.formulas.paper import bus_factor

__all__ = ["LinkFit", "fit_link", "collective_seconds", "two_level_seconds", "ComputeRate", "overlap_possible",
           "CALIBRATED_OPS", "steps_to_narrow"]

#: The collectives zeroexp's strategies issue and the calibration measures.
CALIBRATED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class LinkFit:
    """One op's fit: latency ``alpha_s`` (seconds per call) and bus bandwidth ``busbw_Bps`` (bytes per second)."""

    alpha_s: float
    busbw_Bps: float


def fit_link(op: str, world_size: int, sizes: list[int], seconds: list[float]) -> LinkFit:
    """Least squares of ``t = alpha + S x bus_factor / busbw`` over the measured (S, t), each residual relative to
    its t (so that 4 KiB and 256 MiB weigh alike); alpha is held >= 0 (refit through the origin if negative)."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need two or more (size, time) pairs, got {len(sizes)} sizes and {len(seconds)} times")
    factor = bus_factor(op, world_size)
    xs = [s * factor for s in sizes]  # bus bytes
    ws = [1.0 / t ** 2 for t in seconds]
    sw, sx, sy = sum(ws), sum(w * x for w, x in zip(ws, xs)), sum(w * y for w, y in zip(ws, seconds))
    sxx, sxy = sum(w * x * x for w, x in zip(ws, xs)), sum(w * x * y for w, x, y in zip(ws, xs, seconds))
    det = sw * sxx - sx * sx
    alpha, slope = ((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det) if det else (-1.0, 0.0)
    if alpha < 0 or slope <= 0:
        alpha, slope = 0.0, sxy / sxx
    return LinkFit(alpha_s=alpha, busbw_Bps=1.0 / slope)


def collective_seconds(op: str, payload_bytes: float, world_size: int, link: LinkFit, calls: int = 1) -> float:
    """``calls`` x alpha + S x bus_factor(op, N) / busbw [NCCL-TESTS][HOCKNEY]: the time of ``calls`` calls moving
    ``payload_bytes`` (S, summed over the calls) among N ranks; 0 on one rank."""
    if world_size <= 1 or calls == 0:
        return 0.0
    return calls * link.alpha_s + payload_bytes * bus_factor(op, world_size) / link.busbw_Bps


def two_level_seconds(op: str, payload_bytes: float, ranks_per_node: int, nodes: int, intra: LinkFit,
                      inter: LinkFit, calls: int = 1) -> float:
    """One collective over ``nodes`` x ``ranks_per_node`` ranks in two levels [HIER]: inside a node on the intra link
    (NVLink), across nodes on S / ranks_per_node per rank over the inter link (each rank its own NIC). all_reduce:
    intra reduce_scatter + inter all_reduce on S / g + intra all_gather; all_gather / reduce_scatter: the inter step on
    S / g (ranks of one local index) and the intra step on S; broadcast: inter pipeline then intra. One node: the intra ring alone."""
    g, m = ranks_per_node, nodes
    if m <= 1:
        return collective_seconds(op, payload_bytes, g, intra, calls)
    if g <= 1:
        return collective_seconds(op, payload_bytes, m, inter, calls)
    share = payload_bytes / g
    if op == "all_reduce":
        return (collective_seconds("reduce_scatter", payload_bytes, g, intra, calls)
                + collective_seconds("all_reduce", share, m, inter, calls)
                + collective_seconds("all_gather", payload_bytes, g, intra, calls))
    if op in ("all_gather", "reduce_scatter"):
        return collective_seconds(op, payload_bytes, g, intra, calls) + collective_seconds(op, share, m, inter, calls)
    return collective_seconds(op, payload_bytes, m, inter, calls) + collective_seconds(op, payload_bytes, g, intra,
                                                                                       calls)


@dataclass(frozen=True)
class ComputeRate:
    """Seconds of compute per unit of work on one rank: forward and backward per parameter x sample (a Linear's
    2 FLOPs per parameter per token forward, 4 backward [KAPLAN], so time scales with numel x samples), AdamW per
    parameter element it updates."""

    forward_s_per_param_sample: float
    backward_s_per_param_sample: float
    adamw_s_per_element: float

    @classmethod
    def from_peak(cls, peak_flops: float, efficiency: float, tokens_per_sample: int, adamw_bytes_per_s: float,
                  adamw_bytes_per_element: int = 16) -> ComputeRate:
        """A device known by its peak FLOP/s x ``efficiency`` [KAPLAN]: 2 FLOPs per parameter per token forward,
        4 backward; AdamW memory-bound: ``adamw_bytes_per_element`` (fp32 parameter, gradient, two moments, each
        read, here counted once) at ``adamw_bytes_per_s``."""
        flops = peak_flops * efficiency
        return cls(2 * tokens_per_sample / flops, 4 * tokens_per_sample / flops,
                   adamw_bytes_per_element / adamw_bytes_per_s)


def overlap_possible(device: str, cores: int, ranks_per_node: int, threads_per_rank: int) -> bool:
    """Whether communication can run beside compute. On CUDA, yes: NCCL kernels run on their own stream while the
    compute stream runs. On a CPU, only when cores are left over beyond every rank's compute threads (one per rank for
    its gloo thread): where all cores compute, the gloo thread time-slices with compute instead of hiding behind it,
    so every collective's time adds to the step."""
    if device == "cuda":
        return True
    return cores - ranks_per_node * threads_per_rank >= ranks_per_node


def steps_to_narrow(timed_steps: int, half_width: float, target: float) -> int:
    """Timed steps that would shrink a relative CI half-width ``half_width`` to ``target`` (a CI narrows as
    1 / sqrt(steps))."""
    return math.ceil(timed_steps * (half_width / target) ** 2)

