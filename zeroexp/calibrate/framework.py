"""What one calibration rank measures of the framework's own per-step costs (:mod:`zeroexp.formulas.time.framework`),
every rank at once, apart from any cell: the training loop's cost on a trivial model, each wrapper's cost per
collective call on a tiny model and per byte of the call's payload from a wide one, AdamW's cost per DTensor
parameter (FSDP2's), and the rate of a copy between warm buffers.

Each figure is a difference of two measurements taken side by side in this process, the slowest rank's median.
A difference below zero (noise larger than the cost) is kept as measured in ``raw`` and used as 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from zeroexp.calibrate.calls import all_gather, from_barrier, reduce_scatter, slowest_each, sync, trimmed_mean
from zeroexp.results.calibration import call_table
from zeroexp.formulas import padded_numel
from zeroexp.formulas.time.rates import LinkFit, WakeCurve, measured_call_seconds

__all__ = ["measure_framework", "per_call", "per_byte_fit", "stream_floor", "dtensor_step", "TINY_UNITS", "TINY_WIDTH",
           "WIDE_WIDTH", "COPY_BYTES"]

#: The tiny model the wrappers run on: its compute and bytes are negligible beside each call's own cost.
TINY_UNITS, TINY_WIDTH, TINY_BATCH = 8, 16, 8
#: The wide model (the same 8 units, 512 x 512: 1 MiB a unit, an 8 MiB DDP bucket): with the tiny one, what a
#: wrapper's call costs per byte of its payload. A fixed size of no cell's choosing, in the range of real units.
WIDE_WIDTH = 512
#: The paths measured wide: ZeroRedundancyOptimizer's broadcasts write into the parameters themselves (no pass of its
#: own over their bytes), and its step, compared with DDP's, runs AdamW over 1/N of a wide model: not measured wide.
PER_CALL_KEYS = ("ddp_bucket_s", "zro_broadcast_s", "fsdp1_call_s", "fsdp1_orig_call_s", "fsdp2_call_s")
WIDE_PATHS = ("ddp_bucket_s", "fsdp1_call_s", "fsdp1_orig_call_s", "fsdp2_call_s")
#: Parameters of the DTensor optimizer measurement (:func:`dtensor_step`): small (their elements' cost negligible
#: beside the dispatch), many (the per-parameter cost summed over them, well above the thread clock's grain).
DTENSOR_PARAMS, DTENSOR_WIDTH = 64, 16
#: Bytes of the copy measurement: the size of a bucket (zeroexp's, 25 MiB cap) or a few FSDP units.
COPY_BYTES = 16 * 2**20
#: Steps of the loop's measurement at least: a step is about a millisecond, and a loaded host's stalls are long.
LOOP_STEPS = 60


def _slowest_median(own: list[float], device: torch.device) -> float:
    """Per step the slowest rank's seconds, then the median over steps."""
    return statistics.median(slowest_each(own, device))


def _stack(device: torch.device, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(TINY_UNITS))).to(device)


def _train_step(net: nn.Module, opt: Any, device: torch.device, width: int) -> Callable[[], None]:
    x = torch.randn(TINY_BATCH, width, device=device)

    def step() -> None:
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _paired(wrapped: Callable[[], None], base: Callable[[], None], calls: list[Callable[[], None]], steps: int,
            device: torch.device) -> dict[str, float]:
    """The wrapper's seconds beyond ``base`` and ``calls`` (each call timed alone from a barrier, summed), measured
    side by side: per round the wrapped step, the base step and each call, each from a barrier, the slowest rank's
    each; the trimmed mean over ``steps`` rounds (after two warm-up rounds) of the round's difference, and of each
    part. Taken in the same round, the three see the same regime of this host (timed in separate windows, the
    difference of FSDP1's 29 ms tiny step and its 24 calls moved 0.09-0.77 ms a call between calibrations)."""
    parts: dict[str, list[float]] = {"wrapped": [], "base": [], "calls": []}
    for i in range(steps + 2):
        round_ = (from_barrier(wrapped, device), from_barrier(base, device),
                  sum(from_barrier(call, device) for call in calls))
        if i >= 2:  # two warm-up rounds
            for k, v in zip(parts, round_):
                parts[k].append(v)
    n = len(parts["wrapped"])
    slowest = slowest_each([x for k in parts for x in parts[k]], device)  # per round and part, the slowest rank's
    wrapped_s, base_s, calls_s = (slowest[i * n:(i + 1) * n] for i in range(3))
    return {"extra_s": trimmed_mean([w - b - c for w, b, c in zip(wrapped_s, base_s, calls_s)]),
            "wrapped_s": trimmed_mean(wrapped_s), "base_s": trimmed_mean(base_s), "calls_s": trimmed_mean(calls_s)}


def stream_floor(collectives: dict[str, Any] | None, op: str, nbytes: int, world: int) -> float:
    """What a call of ``op`` of ``nbytes`` in a stream of sync calls costs beyond one alone on this calibration's
    measured sizes (``stream_mean_s`` less ``mean_s``, each read as the model reads it:
    :func:`~zeroexp.formulas.time.rates.measured_call_seconds`), at least 0; 0 where no stream was measured."""
    rows = [r for r in (collectives or {}).get(op, {}).get("sizes", []) if "stream_mean_s" in r]
    if not rows:
        return 0.0
    alone, stream = call_table(rows), call_table(rows, "stream_mean_s")  # as the model reads them, at these sizes
    link = LinkFit(0.0, float("inf"))  # read beyond the largest size only: no bandwidth term there
    return max(0.0, measured_call_seconds(op, nbytes, world, stream, world, link)
               - measured_call_seconds(op, nbytes, world, alone, world, link))


def dtensor_step(steps: int, device: torch.device) -> dict[str, Any]:
    """AdamW's step (``zero_grad(set_to_none=True)`` after it, as a cell's) over :data:`DTENSOR_PARAMS` DTensor
    parameters sharded on dim 0 over every rank (FSDP2's), less the same step over plain parameters of their local
    shapes, per parameter: each rank's thread CPU time of the two side by side (a loaded host's waits are not the
    step's), the median over ``steps`` rounds after two warm-up rounds of the per-round difference, the slowest
    rank's; below zero (noise) kept in ``raw``, used as 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    full = [torch.randn(DTENSOR_WIDTH, DTENSOR_WIDTH, device=device) for _ in range(DTENSOR_PARAMS)]
    dparams = [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    plain = [nn.Parameter(p.to_local().detach().clone()) for p in dparams]
    sets = [(dparams, torch.optim.AdamW(dparams, lr=1e-3)), (plain, torch.optim.AdamW(plain, lr=1e-3))]

    def step(params: list[nn.Parameter], opt: Any) -> float:
        for p in params:
            p.grad = torch.ones_like(p)
        t0 = time.thread_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.thread_time() - t0

    diffs, both = [], []
    for i in range(steps + 2):
        d_s, p_s = (step(*pair) for pair in sets)
        if i >= 2:
            diffs.append(d_s - p_s)
            both.append((d_s, p_s))
    per = _slowest_median([d / DTENSOR_PARAMS for d in diffs], device)
    return {"dtensor_param_step_s": max(0.0, per),
            "raw": {"dtensor_param_step_measured": per, "dtensor_params": DTENSOR_PARAMS,
                    "dtensor_step_s": statistics.median(d for d, _ in both),
                    "plain_step_s": statistics.median(p for _, p in both)}}


def _wrappers(world: int, steps: int, device: torch.device, wake: WakeCurve | None,
              collectives: dict[str, Any] | None = None, width: int = TINY_WIDTH,
              copy_s_per_byte: float = 0.0, paths: tuple[str, ...] = PER_CALL_KEYS,
              dtensor_s: float = 0.0) -> dict[str, Any]:
    """Per call of DDP's bucket all_reduce, ZeroRedundancyOptimizer's broadcast, FSDP1's all_gather /
    reduce_scatter (FULL_SHARD, BACKWARD_PRE, one unit per Linear; with the flat parameters and, apart, with the
    original ones kept: ``use_orig_params``) and FSDP2's (``fully_shard`` per Linear and the
    root, resharded after forward; net of its optimizer's DTensor cost, ``dtensor_s`` a parameter:
    :func:`dtensor_step`), on 8 Linear units of ``width``: the wrapper's
    step less the bare step (less DDP's, for ZeroRedundancyOptimizer) less its calls, each timed alone at the same
    payload, side by side (:func:`_paired`), less FSDP1's gradient copies (their own term, at ``copy_s_per_byte``),
    less each call's waking after the compute before it or its stream floor, the larger (:func:`per_call`; the
    floors from ``collectives``' streams: :func:`stream_floor`). Also each path's payload bytes per call
    (``bytes``). ``paths``: which of them (all three by default)."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    def adamw(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=1e-3)

    bare = _stack(device, width)
    bare_step = _train_step(bare, adamw(bare.parameters()), device, width)
    ddp = DDP(_stack(device, width))
    ddp_step = _train_step(ddp, adamw(ddp.parameters()), device, width)

    def zro_step() -> Callable[[], None]:  # built only where measured
        zro = DDP(_stack(device, width))
        zopt = ZeroRedundancyOptimizer(list(zro.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)
        return _train_step(zro, zopt, device, width)
    def fsdp1_step(orig: bool) -> Callable[[], None]:  # built only where measured
        fsdp = FSDP(_stack(device, width), sharding_strategy=ShardingStrategy.FULL_SHARD,
                    backward_prefetch=BackwardPrefetch.BACKWARD_PRE, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                    device_id=device, use_orig_params=orig)
        return _train_step(fsdp, adamw(fsdp.parameters()), device, width)

    def fsdp2_step() -> Callable[[], None]:  # built only where measured
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        net = _stack(device, width)
        for unit in net:
            fully_shard(unit, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return _train_step(net, adamw(net.parameters()), device, width)

    unit = width * width
    full = torch.ones(unit * TINY_UNITS, device=device)
    padded = padded_numel(unit, world)  # FSDP's calls move a unit padded to a multiple of N (N=3: 86 x 3 of 256)
    one, chunk = torch.ones(padded, device=device), torch.ones(padded // world, device=device)
    owners = [min(k * world // TINY_UNITS, world - 1) for k in range(TINY_UNITS)]  # each parameter from its owner
    params = [torch.ones(unit, device=device) for _ in owners]

    def broadcasts() -> None:  # ZeroRedundancyOptimizer._sync_params: every parameter from its owner, async, then
        for work in [dist.broadcast(p, src=src, async_op=True) for p, src in zip(params, owners)]:  # waited for
            work.wait()  # (parameters_as_bucket_view off): timed as the burst the model times it as
    fsdp_calls = ([lambda: all_gather(one, chunk)] * TINY_UNITS  # FULL_SHARD, no root parameters: per unit two
                  + [lambda: all_gather(one, chunk), lambda: reduce_scatter(chunk, one)] * TINY_UNITS)  # gathers, one
    made = {  # (the wrapper's step, the step it is compared with, its calls as timed, how many calls that is)
        "ddp_bucket_s": lambda: (ddp_step, bare_step, [lambda: dist.all_reduce(full)], 1),  # one bucket
        "zro_broadcast_s": lambda: (zro_step(), ddp_step, [broadcasts], len(owners)),  # one burst
        "fsdp1_call_s": lambda: (fsdp1_step(False), bare_step, fsdp_calls, len(fsdp_calls)),  # reduce_scatter
        "fsdp1_orig_call_s": lambda: (fsdp1_step(True), bare_step, fsdp_calls, len(fsdp_calls)),  # the same calls
        "fsdp2_call_s": lambda: (fsdp2_step(), bare_step, fsdp_calls, len(fsdp_calls)),  # as FSDP1's
    }
    runs = {k: make() for k, make in made.items() if k in paths}
    unit_bytes = one.numel() * 4  # FSDP1's calls: two all_gathers per reduce_scatter, each of one (padded) unit
    nbytes = {k: v for k, v in (("ddp_bucket_s", full.numel() * 4), ("zro_broadcast_s", unit * 4),
                                ("fsdp1_call_s", unit_bytes), ("fsdp1_orig_call_s", unit_bytes),
                                ("fsdp2_call_s", unit_bytes)) if k in runs}
    floors = {"ddp_bucket_s": stream_floor(collectives, "all_reduce", full.numel() * 4, world),
              "zro_broadcast_s": 0.0,  # a burst: its calls are timed as one, no stream floor
              "fsdp1_call_s": (2 * stream_floor(collectives, "all_gather", unit_bytes, world)
                               + stream_floor(collectives, "reduce_scatter", unit_bytes, world)) / 3}
    floors["fsdp2_call_s"] = floors["fsdp1_orig_call_s"] = floors["fsdp1_call_s"]  # the same calls
    copies = {"fsdp1_call_s": 2 * TINY_UNITS * unit_bytes * copy_s_per_byte,  # formulas.framework's own term
              "fsdp1_orig_call_s": 2 * TINY_UNITS * unit_bytes * copy_s_per_byte,
              "fsdp2_call_s": sum(1 for _ in bare.parameters()) * dtensor_s}  # each parameter a DTensor: its own
    raw: dict[str, float] = {}
    for key, (wrapped, base, calls, n) in runs.items():
        got = _paired(wrapped, base, calls, steps, device)
        name = key[:-len("_call_s")] if key.endswith("_call_s") else key.split("_")[0]  # fsdp1, fsdp1_orig, ddp
        raw.update({f"{name}_step_s": got["wrapped_s"], f"{name}_base_step_s": got["base_s"],
                    f"{name}_calls_s": got["calls_s"], f"{key}_measured": got["extra_s"] / n})
    back_to_back = {"zro_broadcast_s"}  # issued one after another after the step: only the first waits on compute
    bare_s = raw["fsdp1_base_step_s"]  # the bare step's compute, before each call's waking
    return {**{k: per_call(raw[f"{k}_measured"] * n - copies.get(k, 0.0), n, bare_s, wake, k in back_to_back,
                           floors[k]) for k, (_, _, _, n) in runs.items()},
            "bytes": nbytes, "raw": {**raw, **{f"{k}_floor": v for k, v in floors.items()}}}


def per_byte_fit(tiny: dict[str, Any], wide: dict[str, Any]) -> dict[str, float]:
    """Each path's cost per call and per byte of its payload from its per-call cost on the tiny and the wide model
    (:func:`_wrappers`' results): the line through the two, its slope at least 0 (noise larger than the bytes'
    cost), its cost at zero bytes at least 0: ``<path>_s`` and ``<path>_s_per_byte``; a path not measured wide,
    its tiny cost and no per-byte figure."""
    out: dict[str, float] = {key: tiny[key] for key in tiny["bytes"] if key not in wide["bytes"]}
    for key, bytes_w in wide["bytes"].items():
        bytes_t = tiny["bytes"][key]
        slope = max(0.0, (wide[key] - tiny[key]) / (bytes_w - bytes_t))
        out[key] = max(0.0, tiny[key] - slope * bytes_t)
        out[f"{key}_per_byte"] = slope
    return out


def per_call(extra_s: float, calls: int, compute_s: float, wake: WakeCurve | None,
             back_to_back: bool = False, floor_s: float = 0.0) -> float:
    """The wrapper's own seconds per call ``x``: its ``calls`` calls' share of ``extra_s`` once each call's waking
    is taken out, ``calls x x + sum of wake(gap) = extra_s`` (:class:`~zeroexp.formulas.WakeCurve`), by bisection;
    0 where the waking alone accounts for it (or noise made ``extra_s`` negative). The gaps as the step model has
    them (:func:`~zeroexp.formulas.channel_step`): each call after ``compute_s / calls`` of the step's compute plus
    the wrapper's own work ``x``; ``back_to_back`` (ZeroRedundancyOptimizer's broadcasts after the step): the first
    after the step's compute, each other after the wrapper's work alone. A call's extra is its waking or
    ``floor_s`` (its stream floor), the larger, as :func:`~zeroexp.formulas.channel_step` has it."""
    def f(x: float) -> float:
        gaps = ([compute_s + x] + [x] * (calls - 1)) if back_to_back else [compute_s / calls + x] * calls
        return calls * x + sum(max(wake(g) if wake else 0.0, floor_s) for g in gaps) - extra_s

    if f(0.0) >= 0:
        return 0.0
    low, high = 0.0, max(extra_s / calls, 0.0)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < 0 else (low, mid)
    return (low + high) / 2


def _copy(device: torch.device, reps: int) -> dict[str, Any]:
    """A copy between two warm :data:`COPY_BYTES` buffers, per byte: every rank at once, the median of ``reps``,
    the slowest rank's."""
    n = COPY_BYTES // 4
    dst, src = torch.ones(n, device=device), torch.ones(n, device=device)
    own = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        own.append(time.perf_counter() - t0)
    seconds = _slowest_median(own, device)
    return {"copy_s_per_byte": seconds / COPY_BYTES, "raw": {"copy_s": seconds, "copy_bytes": COPY_BYTES}}


def _loop(steps: int) -> dict[str, float]:
    """Lightning's per-step cost: the cell's ``CellModule`` on a one-parameter model under a ``Trainer`` set as the
    worker sets it (timed from ``on_train_batch_start`` to ``on_train_batch_end``, as the timing probe), less the
    same model's bare step. On this rank alone (no strategy, no collective)."""
    import lightning.pytorch as pl

    from zeroexp.models import LOSSES
    from zeroexp.models.module import CellModule, cell_trainer

    class Window(pl.Callback):
        def __init__(self) -> None:
            self.t0, self.seconds = 0.0, []

        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.seconds.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    batches = [torch.randn(TINY_BATCH, 1) for _ in range(steps + 2)]
    window = Window()
    module = CellModule(nn.Linear(1, 1, bias=False), "mean_square", lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                        log_loss=False)  # as a cell's without logger=csv (Cell.logs_loss)
    trainer = cell_trainer(accelerator="cpu", devices=1, max_steps=steps + 2, logger=False, callbacks=[window])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    net = nn.Linear(1, 1, bias=False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    bare = []
    for x in batches:
        t0 = time.perf_counter()
        LOSSES["mean_square"](net(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        bare.append(time.perf_counter() - t0)
    return {"lightning": window.seconds[2:], "bare": bare[2:]}


def measure_framework(world: int, steps: int, device: torch.device, wake: dict[str, Any] | None = None,
                      collectives: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every primitive of :class:`zeroexp.formulas.FrameworkCost`, with the measurements each is the difference of
    (``raw``); ``wake``: the calibration's wake curve (:func:`zeroexp.calibrate.measure.measure_wake`), taken out of
    the per-call costs with the stream floors of ``collectives`` (:func:`~zeroexp.calibrate.measure.
    measure_collectives`' result)."""
    times = _loop(max(steps, LOOP_STEPS))
    medians = torch.tensor([statistics.median(times[k]) for k in ("lightning", "bare")], dtype=torch.float64,
                           device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # each rank's loop runs on its own: the slowest rank's median
    lightning, plain = medians.tolist()
    loop = {"loop_s": max(0.0, lightning - plain), "raw": {"lightning_step_s": lightning, "bare_loop_step_s": plain}}
    copy = _copy(device, max(5, steps // 2))
    curve = WakeCurve(tuple(wake["gaps_s"]), tuple(wake["extra_s"])) if wake else None
    wrappers: dict[str, Any] = {"raw": {}}
    if world > 1:
        dt = dtensor_step(steps, device)
        dtensor_s = dt["dtensor_param_step_s"]
        tiny = _wrappers(world, steps, device, curve, collectives, dtensor_s=dtensor_s)
        wide = _wrappers(world, steps, device, curve, collectives, WIDE_WIDTH, copy["copy_s_per_byte"], WIDE_PATHS,
                         dtensor_s)
        wrappers = {**per_byte_fit(tiny, wide), "dtensor_param_step_s": dtensor_s,
                    "raw": {**tiny["raw"], **dt["raw"], **{f"{k}_tiny": tiny[k] for k in tiny["bytes"]},
                            **{f"{k}_wide": wide[k] for k in wide["bytes"]},
                            **{f"wide_{k}": v for k, v in wide["raw"].items()},
                            "tiny_width": TINY_WIDTH, "wide_width": WIDE_WIDTH}}
    out = {k: v for part in (loop, copy, wrappers) for k, v in part.items() if k != "raw"}
    out["raw"] = {**loop["raw"], **copy["raw"], **wrappers["raw"]}
    return out
