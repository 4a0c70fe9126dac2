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
[PAV] Barlow, Bartholomew, Bremner, Brunk, "Statistical Inference under Order Restrictions", Wiley 1972: pool
adjacent violators, the least-squares monotone fit.
[ROOFLINE] Williams, Waterman, Patterson, "Roofline: an insightful visual performance model for multicore
architectures", CACM 52(4), 2009: a kernel of low arithmetic intensity runs at the bandwidth of the level its working
set lives in (the cache while it fits, memory beyond).
[KAPLAN] Kaplan et al. "Scaling Laws for Neural Language Models", arXiv:2001.08361, 2.1: forward 2N FLOPs per token,
backward twice that (6N in all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroexp.formulas.paper import bus_factor

__all__ = ["LinkFit", "fit_link", "collective_seconds", "measured_call_seconds", "isotonic", "WakeCurve",
           "two_level_seconds", "ComputeRate", "fit_calls", "split_cost", "split_cache",
           "ADAMW_STATE_BYTES", "overlap_possible", "CALIBRATED_OPS",
           "steps_to_narrow"]

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


def isotonic(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators [PAV]): where a value is below
    the one before it, the two are replaced by their mean, repeatedly."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def measured_call_seconds(op: str, size_bytes: float, world_size: int, table: list[tuple[int, float]],
                          table_world_size: int, link: LinkFit) -> float:
    """One call of ``size_bytes`` (S) from a calibration's measured (S, seconds) pairs at ``table_world_size`` ranks:
    linear between the two measured sizes around S (per segment a latency and a bandwidth [HOCKNEY]: the curve as
    measured rather than one line through all of it), the first size's time below it, the fit's bandwidth beyond
    the last; no pairs: the fit (:func:`collective_seconds`). The times are made non-decreasing in S first
    (:func:`isotonic`: a larger message is not faster; a dip or spike of one size is noise, not the link). At
    another N the bandwidth part scales with the ring's bus factor (busbw is N-independent [NCCL-TESTS]):
    ``alpha + (t(S) - alpha) x bus_factor(N) / bus_factor(N_cal)``."""
    if world_size <= 1:
        return 0.0
    if not table:
        return collective_seconds(op, size_bytes, world_size, link)
    pts = sorted(table)
    xs = [float(x) for x, _ in pts]
    ys = isotonic([float(y) for _, y in pts])
    if size_bytes <= xs[0]:
        t = ys[0]
    elif size_bytes >= xs[-1]:
        t = ys[-1] + (size_bytes - xs[-1]) * bus_factor(op, table_world_size) / link.busbw_Bps
    else:
        j = next(i for i in range(1, len(xs)) if xs[i] >= size_bytes)
        t = ys[j - 1] + (ys[j] - ys[j - 1]) * (size_bytes - xs[j - 1]) / (xs[j] - xs[j - 1])
    if world_size == table_world_size:
        return t
    alpha = min(link.alpha_s, t)
    return alpha + (t - alpha) * bus_factor(op, world_size) / bus_factor(op, table_world_size)


@dataclass(frozen=True)
class WakeCurve:
    """What a collective costs beyond its time from a synchronized start when the rank has computed for ``gap``
    seconds since its previous collective (the backend's idle threads must be woken and scheduled again: on the
    2-core host with gloo, a 64 KiB all_reduce after 16 ms of compute took ~2.5 ms more than one issued right
    after a barrier, ~1 ms more after 1 ms of compute). Measured by the calibration at ``gaps_s`` (``extra_s``: the
    call's mean less its mean at gap 0); between them linear, beyond the last its value. Waking does not fall as the
    gap grows (the idle threads only sleep deeper), so the means are made non-decreasing (:func:`isotonic`) and read
    from the fitted value at the first gap: a gap-0 baseline the noise put high is pooled with the gaps beside it
    rather than lowering every gap's waking (a calibration measured -0.38 and -0.45 ms at 0.25 and 0.5 ms)."""

    gaps_s: tuple[float, ...]
    extra_s: tuple[float, ...]

    def __call__(self, gap_s: float) -> float:
        xs, fitted = self.gaps_s, isotonic(list(self.extra_s))
        ys = [y - fitted[0] for y in fitted] if fitted else []
        if not xs or gap_s <= 0:
            return 0.0
        if gap_s >= xs[-1]:
            return ys[-1]
        j = next(i for i in range(len(xs)) if xs[i] >= gap_s)
        x0, y0 = (xs[j - 1], ys[j - 1]) if j else (0.0, 0.0)
        return y0 + (ys[j] - y0) * (gap_s - x0) / (xs[j] - x0) if xs[j] > x0 else ys[j]


def two_level_seconds(op: str, payload_bytes: float, ranks_per_node: int, nodes: int, intra: LinkFit,
                      inter: LinkFit, calls: int = 1) -> float:
    """One collective over ``nodes`` x ``ranks_per_node`` ranks in two levels [HIER]: inside a node on the intra link
    (NVLink), across nodes on S / ranks_per_node per rank over the inter link (each rank its own NIC). all_reduce:
    intra reduce_scatter + inter all_reduce on S / g + intra all_gather; all_gather / reduce_scatter: the inter step on
    S / g (ranks of one local index) and the intra step on S; broadcast: inter pipeline then intra. One node: the
    intra ring alone."""
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
    parameter element it updates (beside a fixed cost per step and per tensor: :meth:`optimizer_seconds`); and each
    forward and backward call's own cost whatever its micro-batch, paid once
    per micro-batch (:meth:`call_seconds`): per operator it dispatches (``*_s_per_op``: the dispatch, the kernel's
    launch, the autograd node) and per parameter it runs over (``*_call_s_per_param``: each weight read, each
    gradient written, whatever the samples), so a call's cost carries to a model of other operators and size; plus
    a fixed part (``*_call_s``: the autograd engine's start, the loss; a schema-8 calibration's whole call cost of
    its own model, which carries to no other). A calibration fits them (:func:`fit_calls`, :func:`split_cost`); 0
    for a device preset."""

    forward_s_per_param_sample: float
    backward_s_per_param_sample: float
    adamw_s_per_element: float
    forward_call_s: float = 0.0
    backward_call_s: float = 0.0
    forward_s_per_op: float = 0.0
    backward_s_per_op: float = 0.0
    forward_call_s_per_param: float = 0.0
    backward_call_s_per_param: float = 0.0
    adamw_step_s: float = 0.0
    adamw_s_per_tensor: float = 0.0
    #: AdamW's elements that fit in the rank's share of the last-level cache (:data:`ADAMW_STATE_BYTES` each), at
    #: ``adamw_s_per_element``; those beyond it at ``adamw_s_per_element_beyond`` (from memory); 0: one rate for all
    adamw_cache_elements: int = 0
    adamw_s_per_element_beyond: float = 0.0

    def call_seconds(self, phase: str, ops: int, numel: int) -> float:
        """One ``phase`` call's own cost (``forward`` with the loss, or ``backward``) of a model whose call
        dispatches ``ops`` operators over ``numel`` parameters."""
        return (getattr(self, f"{phase}_call_s") + getattr(self, f"{phase}_s_per_op") * ops
                + getattr(self, f"{phase}_call_s_per_param") * numel)

    def optimizer_seconds(self, tensors: int, elements: int) -> float:
        """AdamW's step (with ``zero_grad``) over ``tensors`` parameter tensors of ``elements`` elements in all: a
        fixed cost (``adamw_step_s``), one per tensor (``adamw_s_per_tensor``: its ops, as ``torch.optim.AdamW``
        updates each tensor with its own calls where it does not fuse them) and one per element, at the cache's rate
        for those that fit in the rank's share of it and at memory's beyond (a memory-bound update [ROOFLINE])."""
        inside = min(elements, self.adamw_cache_elements) if self.adamw_cache_elements else elements
        return (self.adamw_step_s + self.adamw_s_per_tensor * tensors + self.adamw_s_per_element * inside
                + self.adamw_s_per_element_beyond * (elements - inside))

    @property
    def counts_ops(self) -> bool:
        """Whether a call's cost depends on its operators (then a prediction needs the model's counts)."""
        return bool(self.forward_s_per_op or self.backward_s_per_op)

    @classmethod
    def from_peak(cls, peak_flops: float, efficiency: float, tokens_per_sample: int, adamw_bytes_per_s: float,
                  adamw_bytes_per_element: int = 16) -> ComputeRate:
        """A device known by its peak FLOP/s x ``efficiency`` [KAPLAN]: 2 FLOPs per parameter per token forward,
        4 backward; AdamW memory-bound: ``adamw_bytes_per_element`` (fp32 parameter, gradient, two moments, each
        read, here counted once) at ``adamw_bytes_per_s``."""
        flops = peak_flops * efficiency
        return cls(2 * tokens_per_sample / flops, 4 * tokens_per_sample / flops,
                   adamw_bytes_per_element / adamw_bytes_per_s)


#: Bytes of AdamW's working set per element in fp32: the parameter, its gradient and the two moments [ZeRO 5.1].
ADAMW_STATE_BYTES = 16


def split_cache(inside: tuple[int, float], beyond: tuple[int, float], cache_elements: int
                ) -> tuple[float, float] | None:
    """AdamW's seconds per element in the cache and beyond it, from two steps' per-element parts (each: its
    elements, its seconds less its fixed and per-tensor parts), the first the model's, the second a working set
    several times the cache: ``t = min(E, C) x in + max(0, E - C) x beyond`` [ROOFLINE] for both, solved; None where
    they solve to no rates, or to a cache slower than memory (timing noise above the difference: the caller keeps
    one rate)."""
    (e1, t1), (e2, t2) = inside, beyond
    a1, b1 = min(e1, cache_elements), max(0, e1 - cache_elements)
    a2, b2 = min(e2, cache_elements), max(0, e2 - cache_elements)
    det = a1 * b2 - a2 * b1
    if det == 0:
        return None
    rate_in, rate_beyond = (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det
    return (rate_in, rate_beyond) if 0 < rate_in <= rate_beyond else None


def fit_calls(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """A call's seconds at micro-batches of ``points`` (size, seconds; two sizes or more) as ``call + slope x size``
    by least squares: (call, slope); None where the fit is not a cost (fewer than two sizes, a slope that is not
    positive or a call below zero: timing noise larger than the call), the caller then keeps one point's rate."""
    sizes = sorted({b for b, _ in points})
    if len(sizes) < 2:
        return None
    n = len(points)
    mx, my = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    call = my - slope * mx
    return (call, slope) if slope > 0 and call >= 0 else None


def split_cost(total_s: float, units: int, numel: int, fixed_s: float, per_unit_s: float, unit: str = "operators"
               ) -> tuple[float, str | None]:
    """The per-element part of a model's measured cost ``total_s`` (a forward's or backward's fitted call over its
    ``units`` operators, or AdamW's step over its ``units`` tensors; ``numel`` parameters), its fixed cost
    ``fixed_s`` and its cost per unit ``per_unit_s`` timed apart (stacks whose elements and samples cost nothing
    beside their units): ``total = fixed + units x per_unit + numel x per_element``. Where the fixed and per-unit
    parts alone reach the total (timing noise above the elements' part), none (0.0) and the second value says so;
    else it is None."""
    rest = total_s - fixed_s - per_unit_s * units
    if rest <= 0 or numel <= 0:
        return 0.0, (f"the fixed {fixed_s * 1e3:.3f} ms and {units} {unit} at {per_unit_s * 1e6:.2f} us reach the "
                     f"measured {total_s * 1e3:.3f} ms: no per-element part (noise above it)")
    return rest / numel, None


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

