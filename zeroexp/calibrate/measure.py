"""What one rank of ``python -m zeroexp.calibrate`` measures: each collective over a range of message sizes
(nccl-tests' convention) and the model's forward, backward and AdamW update, every rank at once, as a cell's ranks
share the machine.

[NCCL-TESTS] doc/PERFORMANCE.md: S is the full array (for all_gather the output, for reduce_scatter the input);
algbw = S / t, busbw = algbw x bus factor. Unlike nccl-tests, which times a loop of back-to-back calls, each call is
timed alone from a synchronized start (a barrier, then one call), the slowest rank's time; a size's time is the
median over its calls. Why: a training step issues a collective after compute, never right behind another of the
same size, and on gloo back-to-back calls pipeline (the next call's sends start while the last call's receives
finish): measured on the 2-core host at N=2, an 18.9 MB all_reduce took 11.3 ms per call in a loop and 13.6 ms
alone (14.8 ms inside a bare step), so a loop's figure under-predicts every step. Up to 32 MiB a size is also timed
in an async burst (calls issued together) and in a stream of sync calls each issued as the one before returns
(:func:`_stream`): below ~1 MiB a call behind another pays the peer's trailing work of that call, which the barrier
hides; the model gives such a call that floor.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeroexp.calibrate.calls import all_gather, reduce_scatter, slowest_each, sync, time_calls, trimmed_mean
from zeroexp.formulas import bus_factor
from zeroexp.hostload import activity, busy_cpu_s, own_cpu_s

__all__ = ["message_sizes", "rank_main", "cache_bytes", "MAX_BUFFERS"]

#: Rounds the wake curve's calls are spread over (each round visits every gap).
WAKE_ROUNDS = 6
#: Buffers a size's calls rotate over at most (4 KiB calls: 64 x 4 KiB, warm anyway in a step's small tensors).
MAX_BUFFERS = 64
#: Calls of one async burst (:func:`measure_collectives`' ``burst_mean_s``): ZeroRedundancyOptimizer's 8 parameter
#: broadcasts of the reference model, issued together after its step.
BURST = 8
#: The largest size timed in bursts (8 buffers of it a rank): above it the model's burst time is the largest burst
#: size's plus the fit's bandwidth (:meth:`~zeroexp.results.calibration.Calibration.seconds_at`, ``burst=True``).
BURST_MAX_BYTES = 32 * 2**20
#: Calls of one stream (:func:`measure_collectives`' ``stream_mean_s``): sync calls one right after another, as FSDP
#: issues its units' gathers and reduce-scatters with little compute between; timed up to :data:`BURST_MAX_BYTES`.
STREAM = 8


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes`` (both included when powers of two), as nccl-tests' -f 2."""
    sizes, s = [], int(min_bytes)
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def _slowest(seconds: float, device: torch.device) -> float:
    return slowest_each([seconds], device)[0]


def cache_bytes(device: torch.device) -> int:
    """The last-level cache a call's buffers must not fit in: the GPU's L2, or the CPU's largest cache
    (``/sys/devices/system/cpu/cpu0/cache``); 32 MiB where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG") or 0) * unit)
    return max(sizes, default=32 * 2**20) or 32 * 2**20


def _call(op: str, nbytes: int, world: int, device: torch.device, cold_bytes: int = 0,
          async_op: bool = False) -> Callable[[], Any]:
    """Calls of ``op`` with payload S = ``nbytes`` (fp32, rounded down to a multiple of N elements), each on the
    next of enough buffers to span ``cold_bytes`` (at most :data:`MAX_BUFFERS`), so that a call finds its buffer out
    of the cache as a step finds its parameters and gradients (measured on the 2-core host: a 2.25 MiB broadcast
    0.47-0.57 ms on one warm buffer, 0.63-0.70 ms rotating over 64)."""
    numel = max(world, nbytes // 4 // world * world)
    k = max(1, min(MAX_BUFFERS, -(-int(cold_bytes) // (numel * 4))))
    fulls = [torch.ones(numel, dtype=torch.float32, device=device) for _ in range(k)]
    chunks = [torch.ones(numel // world, dtype=torch.float32, device=device) for _ in range(k)]
    turn = iter(range(2**62))

    def call() -> Any:
        i = next(turn) % k
        full, chunk = fulls[i], chunks[i]
        if op == "all_reduce":
            return dist.all_reduce(full, async_op=async_op)
        if op == "broadcast":
            return dist.broadcast(full, src=0, async_op=async_op)
        if op == "all_gather":
            return all_gather(full, chunk, async_op=async_op)
        return reduce_scatter(chunk, full, async_op=async_op)
    return call


def _burst(op: str, nbytes: int, world: int, device: torch.device, cold_bytes: int) -> Callable[[], None]:
    """:data:`BURST` async calls of ``op`` issued together, each on its own buffer, then waited for: how a strategy
    issues calls that nothing separates (ZeroRedundancyOptimizer's parameter broadcasts after its step). On the
    2-core host gloo's two worker threads then run two at once: 8 broadcasts of 2.25 MiB took 1.0-1.14 ms a call
    where one alone took 0.75-0.83."""
    one = _call(op, nbytes, world, device, max(int(cold_bytes), BURST * nbytes), async_op=True)

    def burst() -> None:
        for work in [one() for _ in range(BURST)]:
            work.wait()
    return burst


def _stream(op: str, nbytes: int, world: int, device: torch.device, cold_bytes: int) -> Callable[[], float]:
    """One call of ``op`` (untimed: it leaves the barrier's synchronized start behind), then :data:`STREAM` sync
    calls each issued as the one before returns, each on its own buffer; this rank's seconds of those. How a step
    issues calls with little compute between (FSDP's units): measured on the 2-core host at N=2, 2.25 MiB
    all_gathers cost 2.1-2.5 ms a call in a stream where one alone from a barrier took 1.3-1.4; 256 KiB
    all_reduces 2.2 vs 0.7; 16 MiB calls the same either way (the peer's trailing work of the call before,
    hidden by a barrier, is paid by the next call of a stream)."""
    one = _call(op, nbytes, world, device, max(int(cold_bytes), (STREAM + 1) * nbytes))

    def stream() -> float:
        dist.barrier()
        sync(device)
        one()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(STREAM):
            one()
        sync(device)
        return time.perf_counter() - t0
    return stream


def measure_collectives(c: Any, world: int, device: torch.device) -> dict[str, Any]:
    """Per op, per size: S, the time of one call (median and trimmed mean over ``iters`` x ``repeats`` calls, each
    timed alone from a barrier, the slowest rank's), algbw and busbw in bytes/s; up to :data:`BURST_MAX_BYTES`,
    ``burst_mean_s``, a call's share of :data:`BURST` async calls issued together (:func:`_burst`; ``iters / BURST``
    bursts a round, at least one), and ``stream_mean_s``, a call's share of :data:`STREAM` sync calls one after
    another (:func:`_stream`, as many a round). The repeats are rounds over every
    size (a size's calls come from ``repeats`` windows apart, not one: the host's scheduling settles into regimes
    lasting seconds), each call on a buffer out of the cache (:func:`_call`, twice :func:`cache_bytes`)."""
    cold = 2 * cache_bytes(device)
    out: dict[str, Any] = {}
    sizes = message_sizes(c.min_bytes, c.max_bytes)
    for op in c.ops:
        iters, calls, bursts = {}, {n: [] for n in sizes}, {n: [] for n in sizes}
        streams: dict[int, list[float]] = {n: [] for n in sizes}
        for nbytes in sizes:
            first = time_calls(_call(op, nbytes, world, device), 1, device)[0]  # warm-up; every rank agrees on it
            iters[nbytes] = max(int(c.min_iters), min(int(c.max_iters), int(c.target_s / max(first, 1e-9))))
        for _ in range(int(c.repeats)):
            for nbytes in sizes:
                fn = _call(op, nbytes, world, device, cold)
                fn()
                calls[nbytes] += time_calls(fn, iters[nbytes], device)
                if nbytes <= BURST_MAX_BYTES:
                    burst = _burst(op, nbytes, world, device, cold)
                    burst()
                    bursts[nbytes] += [t / BURST for t in time_calls(burst, max(1, iters[nbytes] // BURST), device)]
                    del burst  # its buffers (up to 8 x 32 MiB) go before the next size's are made
                    stream = _stream(op, nbytes, world, device, cold)
                    own = [stream() for _ in range(max(1, iters[nbytes] // STREAM))]
                    streams[nbytes] += [x / STREAM for x in slowest_each(own, device)]  # per stream
                    del stream
                del fn
        rows = []
        for nbytes in sizes:
            t = statistics.median(calls[nbytes])
            s = max(world, nbytes // 4 // world * world) * 4
            rows.append({"bytes": s, "seconds": t, "mean_s": trimmed_mean(calls[nbytes]), "iters": len(calls[nbytes]),
                         **({"burst_mean_s": trimmed_mean(bursts[nbytes]), "burst_iters": len(bursts[nbytes])}
                            if bursts[nbytes] else {}),
                         **({"stream_mean_s": trimmed_mean(streams[nbytes]), "stream_iters": len(streams[nbytes])}
                            if streams[nbytes] else {}),
                         "algbw_Bps": s / t, "busbw_Bps": s / t * bus_factor(op, world)})
        out[op] = {"sizes": rows, "cold_bytes": cold}
    return out


def measure_wake(c: Any, device: torch.device) -> dict[str, Any]:
    """A collective's cost after the rank computed for a while (:class:`~zeroexp.formulas.WakeCurve`): per gap of
    ``wake_gaps_ms``, ``wake_calls`` calls of an all_reduce of ``wake_bytes``, each after a barrier and then that
    much compute (matmuls of a unit's shape, as a step computes between its collectives; a fixed count per gap, the
    same on every rank, timed to the gap on the faster rank), the slowest rank's, in
    :data:`WAKE_ROUNDS` rounds over every gap (gap 0, the baseline, measured in the same windows as the others);
    the trimmed mean per gap less the one at gap 0."""
    a, w = torch.randn(8, 768, device=device), torch.randn(768, 768, device=device)
    buf = torch.ones(max(1, int(c.wake_bytes) // 4), device=device)
    time_calls(lambda: dist.all_reduce(buf), 10, device)  # warm-up: the first calls of a size set up buffers
    gaps = [float(g) for g in c.wake_gaps_ms]
    # A fixed amount of work per gap, the same on every rank, as a step computes between its calls (not a fixed
    # time): each rank's share of the host then differs as in a step, and the call pays the ranks' skew too.
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ w
    sync(device)
    per = torch.tensor([(time.perf_counter() - t0) / 50], dtype=torch.float64, device=device)
    dist.all_reduce(per, op=dist.ReduceOp.MIN)  # every rank the same count: the faster rank's matmul
    matmuls = {g: int(round(g / 1e3 / float(per.item()))) for g in gaps}
    own: dict[float, list[float]] = {g: [] for g in gaps}
    rounds = min(WAKE_ROUNDS, int(c.wake_calls))
    for r in range(rounds):  # rounds over every gap: a gap's calls come from windows apart, as the sizes'
        for gap_ms in gaps:
            for _ in range(int(c.wake_calls) // rounds + (r < int(c.wake_calls) % rounds)):
                dist.barrier()
                sync(device)
                for _ in range(matmuls[gap_ms]):
                    a @ w
                sync(device)
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                sync(device)
                own[gap_ms].append(time.perf_counter() - t0)
    means = []
    for gap_ms in gaps:
        means.append(trimmed_mean(slowest_each(own[gap_ms], device)))
    zero = means[0]
    return {"op": "all_reduce", "bytes": buf.numel() * 4, "calls": int(c.wake_calls),
            "matmuls": [matmuls[g] for g in gaps],
            "gaps_s": [float(g) / 1e3 for g in c.wake_gaps_ms], "mean_s": means, "extra_s": [m - zero for m in means]}


def fit_sizes(batch_size: int) -> tuple[int, int]:
    """The two micro-batch sizes compute is timed at: a quarter of ``batch_size`` (at least 1) and ``batch_size``
    itself (1 and 2 where it is 1): the spread that separates a call's own cost from its per-sample cost."""
    b = int(batch_size)
    return (1, 2) if b == 1 else (max(1, b // 4), b)


#: The stacks a call's fixed cost and its cost per operator are timed on (:func:`ops_stack`): zeroexp's mlp of
#: Linear(8, 8) at 16 and at 64 layers, one sample: at 64, 130 forward and 452 backward operators over 4,096
#: parameters, whose parameters' and sample's cost is negligible beside the operators' own (on the 2-core host
#: 1.7 ms forward, of which 8 x 4,096 x 1e-10 s). Their difference over their operators' is a call's cost per
#: operator; what the shallow one costs beyond its operators, the call's fixed cost (measured on the 2-core host,
#: one thread: 11.5 us an operator forward, 5.4 backward, and 0.27 ms a call each). AdamW's step over their 16 and
#: 64 tensors likewise: a cost per tensor and a fixed one (torch.optim.AdamW on 8 tensors of the 2-core host: 2.6 ms
#: for 64,800 elements, 6.1 for 524,288, 40.6 for 4,718,592: 8.2 ns an element beside ~1.8 ms a step).
OPS_WIDTH, OPS_DEPTHS = 8, (16, 64)


def ops_stack(depth: int) -> Any:
    """The model config of an operator stack of ``depth`` layers (:data:`OPS_WIDTH`, :data:`OPS_DEPTHS`)."""
    from omegaconf import OmegaConf

    from zeroexp.models.schemas import MLPConfig

    return OmegaConf.structured(MLPConfig(name="ops_stack", width=OPS_WIDTH, depth=depth, input_shape=[OPS_WIDTH]))


#: The working set AdamW is also timed on, in times the rank's share of the last-level cache (:func:`adamw_beyond`):
#: its elements mostly beyond the cache, so that with the model's step it gives a rate in the cache and one beyond.
BEYOND_CACHE = 8


def cache_share(device: torch.device, world: int) -> int:
    """The last-level cache one rank has (:func:`cache_bytes`): a GPU's L2 its own, a CPU's shared by the host's
    ``world`` ranks."""
    return cache_bytes(device) // (1 if device.type == "cuda" else max(1, int(world)))


def adamw_beyond(share: int, device: torch.device, lr: float = 1e-3) -> tuple[int, Callable[[], float]]:
    """(elements, step): AdamW over 8 tensors whose working set (:data:`~zeroexp.formulas.time.rates.ADAMW_STATE_BYTES`
    an
    element) is :data:`BEYOND_CACHE` times ``share``; ``step()`` gives each its gradient, then times the step and
    ``zero_grad`` as the model's are timed."""
    from zeroexp.formulas.time.rates import ADAMW_STATE_BYTES

    per = max(1, BEYOND_CACHE * share // ADAMW_STATE_BYTES // 8)
    params = [torch.nn.Parameter(torch.zeros(per, device=device)) for _ in range(8)]
    grads = [torch.full_like(p, 1e-3) for p in params]
    opt = torch.optim.AdamW(params, lr=lr)

    def step() -> float:
        for p, g in zip(params, grads):
            p.grad = g
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0
    return 8 * per, step


def _stack_line(shallow: tuple[int, float], deep: tuple[int, float]) -> tuple[float, float]:
    """(fixed, per unit) seconds of the operator stacks, each (its units: operators or tensors, its seconds): the
    line through the two, each part held at >= 0 (noise larger than it)."""
    per_unit = max(0.0, (deep[1] - shallow[1]) / (deep[0] - shallow[0]))
    return max(0.0, shallow[1] - per_unit * shallow[0]), per_unit


def _phases(net: torch.nn.Module, loss_fn: Any, opt: Any, batch: torch.Tensor, device: torch.device
            ) -> list[tuple[str, float]]:
    """Forward (with the loss), backward, and the AdamW step with zero_grad, each timed from a sync."""
    marks = []
    for phase in ("forward", "backward", "optimizer"):
        sync(device)
        t0 = time.perf_counter()
        if phase == "forward":
            loss = loss_fn(net(batch), batch)
        elif phase == "backward":
            loss.backward()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
        marks.append((phase, time.perf_counter() - t0))
    return marks


def measure_compute(model_cfg: Any, batch_size: int, steps: int, device: torch.device, lr: float = 1e-3
                    ) -> dict[str, Any]:
    """Forward (with the loss), backward and AdamW step + zero_grad of the whole model on this rank, the median over
    ``steps`` after one warm-up, at the two micro-batch sizes of :func:`fit_sizes`; forward and backward fitted as a
    call's own cost plus seconds per parameter x sample (:func:`~zeroexp.formulas.time.rates.fit_calls`; where the fit
    is not a cost, timing noise above the call, no call cost and ``batch_size``'s own rate, said in ``fit``), AdamW
    per updated element. In the same steps the operator stacks (:func:`ops_stack`) at one sample: their difference
    over their operators' (counted, ``zeroexp.plan.flops.step_ops``) is a call's cost per operator, what the shallow
    one costs beyond its operators a call's fixed cost, and the model's call cost beyond both is per parameter
    (:func:`~zeroexp.formulas.time.rates.split_cost`); likewise AdamW's step: the stacks' difference over their tensors'
    is its cost per tensor, the shallow one's beyond its tensors its fixed cost, the model's beyond both per
    element, in the rank's share of the cache and beyond it with a step of :data:`BEYOND_CACHE` times that share
    (:func:`adamw_beyond`, :func:`~zeroexp.formulas.time.rates.split_cache`)."""
    from zeroexp.formulas.time.rates import ADAMW_STATE_BYTES, fit_calls, split_cache, split_cost
    from zeroexp.models import build_model, loss_of, make_batch
    from zeroexp.plan.flops import step_ops
    from zeroexp.results.calibration import NO_CALL_COST

    torch.manual_seed(0)
    net = build_model(model_cfg).to(device)
    loss_fn = loss_of(model_cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    psi = sum(p.numel() for p in net.parameters() if p.requires_grad)
    stacks = {}
    for depth in OPS_DEPTHS:
        stack_cfg = ops_stack(depth)
        stack = build_model(stack_cfg).to(device)
        stacks[f"stack{depth}"] = (stack_cfg, stack, torch.optim.AdamW(stack.parameters(), lr=lr))

    share = cache_share(device, dist.get_world_size())
    beyond_elements, beyond_step = adamw_beyond(share, device, lr)
    beyond: list[float] = []
    sizes = fit_sizes(batch_size)
    times = {size: {"forward": [], "backward": [], "optimizer": []} for size in (*sizes, *stacks)}
    for step in range(steps + 1):
        # the sizes and the stacks step by step in turn: a drift of the host's speed reaches each alike
        for size in (*sizes, *stacks):
            if size in stacks:
                stack_cfg, stack, stack_opt = stacks[size]
                marks = _phases(stack, loss_of(stack_cfg), stack_opt,
                                make_batch(stack_cfg, 1, 0, step, dist.get_rank()).to(device), device)
            else:
                marks = _phases(net, loss_fn, opt, make_batch(model_cfg, size, 0, step, dist.get_rank()).to(device),
                                device)
            if step:  # step 0 is warm-up (Adam creates its moments; each batch shape's first run)
                for phase, t in marks:
                    times[size][phase].append(t)
        t = beyond_step()
        beyond += [t] if step else []
    at = {size: {k: _slowest(statistics.median(v), device) for k, v in ts.items()} for size, ts in times.items()}
    med = at[int(batch_size)]
    phases = ("forward", "backward")
    ops = dict(zip(phases, step_ops(model_cfg, device.type, int(batch_size))))
    stack_ops = {name: dict(zip(phases, step_ops(cfg, device.type))) for name, (cfg, _, _) in stacks.items()}
    shallow, deep = (f"stack{d}" for d in OPS_DEPTHS)
    out: dict[str, Any] = {"dispatch": {}}
    fit: dict[str, str] = {}
    for phase in phases:
        calls = fit_calls([(size, at[size][phase]) for size in sizes])
        call, slope = calls if calls is not None else (0.0, med[phase] / batch_size)
        fixed, per_op = _stack_line((stack_ops[shallow][phase], at[shallow][phase]),
                                    (stack_ops[deep][phase], at[deep][phase]))
        out["dispatch"][phase] = {"fixed_s": fixed, "s_per_op": per_op}  # the op-level compute's, whatever the fit
        per_param, why = split_cost(call, ops[phase], psi, fixed, per_op) if calls is not None else (0.0, None)
        out.update({f"{phase}_call_s": call, f"{phase}_s_per_param_sample": slope / psi,
                    f"{phase}_call_fixed_s": fixed if calls is not None else 0.0,
                    f"{phase}_s_per_op": per_op if calls is not None else 0.0,
                    f"{phase}_call_s_per_param": per_param})
        split = "fixed + per operator alone: " + why if why else "fixed + per operator + per parameter"
        fit[phase] = ((f"a call's cost + per sample, over micro-batches {sizes[0]} and {sizes[1]}; the call's "
                       f"cost {split}")
                      if calls is not None else
                      f"{NO_CALL_COST} (micro-batches {sizes[0]} and {sizes[1]} fit none: timing noise above it): "
                      f"the rate at {batch_size}")
    tensors = sum(1 for p in net.parameters() if p.requires_grad)
    step, per_tensor = _stack_line((OPS_DEPTHS[0], at[shallow]["optimizer"]), (OPS_DEPTHS[1], at[deep]["optimizer"]))
    per_element, why = split_cost(med["optimizer"], tensors, psi, step, per_tensor, "tensors")
    if why:  # the stacks alone reach the model's step: its rate per element as measured, nothing apart
        step, per_tensor, per_element = 0.0, 0.0, med["optimizer"] / psi
    t_beyond = _slowest(statistics.median(beyond), device)
    cache_elements = share // ADAMW_STATE_BYTES
    rates = None if why else split_cache((psi, per_element * psi),
                                         (beyond_elements, t_beyond - step - 8 * per_tensor), cache_elements)
    in_cache, per_beyond = rates if rates is not None else (per_element, per_element)
    out.update(adamw_step_s=step, adamw_s_per_tensor=per_tensor, adamw_s_per_element=in_cache,
               adamw_cache_elements=cache_elements if rates is not None else 0,
               adamw_s_per_element_beyond=per_beyond,
               adamw_beyond={"elements": beyond_elements, "tensors": 8, "optimizer_s": t_beyond,
                             "cache_share_bytes": share})
    fit["optimizer"] = (f"per element alone: {why}" if why else
                        f"fixed + per tensor (the stacks) + per element ({tensors} tensors, {psi} elements), "
                        + (f"in the rank's {share} B of cache and beyond it (with {beyond_elements} elements)"
                           if rates is not None else "one rate in and beyond the cache (the two steps solve to "
                                                     "none, or to a cache slower than memory: noise above the "
                                                     "difference)"))
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    return {"model": str(model_cfg.get("name")), "model_config": config, "batch_size": batch_size, "numel": psi,
            "steps": steps,
            "forward_s": med["forward"], "backward_s": med["backward"], "optimizer_s": med["optimizer"],
            "points": [{"batch_size": size, **{f"{k}_s": v for k, v in at[size].items()}} for size in sizes],
            "ops": ops, "ops_stacks": [{"width": OPS_WIDTH, "depth": int(name[5:]), "batch_size": 1,
                                        "ops": stack_ops[name], **{f"{k}_s": v for k, v in at[name].items()}}
                                       for name in stacks],
            "tensors": tensors, "fit": fit, **out}


def host_activity(start: tuple[float, float | None, float], device: torch.device) -> dict[str, Any] | None:
    """What else ran on the host while the ranks measured (:func:`zeroexp.hostload.activity`), from ``start`` (wall,
    the host's busy CPU seconds, this rank's CPU seconds, each taken when measuring began): every rank's own CPU
    seconds summed by an all_reduce (each rank's window is the same to a barrier)."""
    wall0, busy0, own0 = start
    busy1 = busy_cpu_s()
    ranks = torch.tensor([own_cpu_s() - own0], dtype=torch.float64, device=device)
    dist.all_reduce(ranks)
    busy = None if busy0 is None or busy1 is None else busy1 - busy0
    return activity(time.perf_counter() - wall0, busy, float(ranks.item()))


def rank_main(rank: int, world: int, port: int, backend: str, device_type: str, cfg: dict[str, Any],
              out: str) -> None:
    """One calibration rank: join the group, set this rank's threads as a cell does, measure, rank 0 writes ``out``."""
    from omegaconf import OmegaConf

    c = OmegaConf.create(cfg)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from zeroexp.devices import pin_host_allocator, rank_threads

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    allocator = pin_host_allocator()  # as zeroexp.rank.worker: a rank's compute rate must not depend on what ran before
    if device.type == "cpu":  # as zeroexp.rank.worker: the ranks share the cores
        torch.set_num_threads(rank_threads(world))
    else:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        from zeroexp.calibrate.framework import measure_framework
        from zeroexp.calibrate.deepspeed_engine import deepspeed_terms
        from zeroexp.calibrate.kernels import measure_kernels

        dist.barrier()
        start = (time.perf_counter(), busy_cpu_s(), own_cpu_s())
        collectives = measure_collectives(c.calibrate, world, device) if world > 1 else {}
        wake = measure_wake(c.calibrate, device) if world > 1 else None
        result = {"threads_per_rank": torch.get_num_threads(), "host_allocator": allocator,
                  "collectives": collectives, "wake": wake,
                  "compute": {**measure_compute(c.model, int(c.batch_size), int(c.calibrate.compute_steps), device),
                              "kernels": measure_kernels(device)},
                  "framework": measure_framework(world, int(c.calibrate.compute_steps), device, wake, collectives)}
        if world > 1:  # DeepSpeed's engine beside the wrappers (zeroexp.calibrate.deepspeed_engine)
            ds = deepspeed_terms(int(c.calibrate.compute_steps), device, wake)
            result["framework"].update({k: v for k, v in ds.items() if k != "raw"})
            result["framework"]["raw"].update(ds["raw"])
        dist.barrier()
        result["host_activity"] = host_activity(start, device)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
