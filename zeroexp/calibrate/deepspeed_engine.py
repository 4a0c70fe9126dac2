"""What DeepSpeed's ZeRO engine costs a step beyond the bare step and beyond its collectives (calibration schema 10,
``framework.deepspeed_step_s`` and ``deepspeed_step_s_per_byte``): ``engine.backward`` and ``engine.step`` of stage 2
(DeepSpeed's ``DeepSpeedZeroOptimizer``, stages 1 and 2's engine: its backward hooks filling the contiguous
gradient buffer, the bucket's reduction bookkeeping, the gradient norm's pass, the fp32 partition's step and its
copy back into the flat parameters before their all-gather; ``deepspeed/runtime/zero/stage_1_and_2.py``), on the
framework's tiny and wide models, as zeroexp configures DeepSpeed (``zeroexp.strategies.deepspeed.ds_config``:
``overlap_comm`` off, ``contiguous_gradients`` on, no clipping, fp32).

Measured as every wrapper of :mod:`zeroexp.calibrate.framework` is: the engine's step less the bare step less its
collectives, each timed alone, side by side (:func:`~zeroexp.calibrate.framework._paired`). Its collectives are the
ones the engine issues, recorded on a warm step (each ``c10d`` op and its tensors' sizes) and replayed at the same
sizes; an op this module cannot replay leaves the term unmeasured (None), said in ``raw``.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeroexp._lib.dispatch import dispatch_mode_base
from zeroexp.calibrate.calls import all_gather, reduce_scatter

__all__ = ["CPU_ACCELERATOR_NOTICE", "deepspeed_engine", "deepspeed_terms", "engine_config",
           "quiet_cpu_accelerator_notice", "replay"]


class _Record(dispatch_mode_base()):  # torch's TorchDispatchMode (zeroexp._lib.dispatch)
    """While active, each ``c10d::*`` op's name and the numel of each tensor among its arguments, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            def numels(a: Any) -> list[int]:
                if isinstance(a, torch.Tensor):
                    return [a.numel()]
                return [n for v in a for n in numels(v)] if isinstance(a, (list, tuple)) else []
            self.calls.append((func.overloadpacket.__name__, numels(args)))
        return func(*args, **(kwargs or {}))


def replay(calls: list[tuple[str, list[int]]], device: torch.device) -> list[Callable[[], Any]] | None:
    """Each recorded call (its ``c10d`` op and its tensors' numels, fp32) as a call of the same op and sizes on
    buffers of its own; None where an op is not one of all_reduce, all_gather into a tensor, reduce_scatter of a
    tensor, broadcast, reduce."""
    out: list[Callable[[], Any]] = []
    for name, numels in calls:
        t = [torch.ones(n, device=device) for n in numels]
        if name == "allreduce_":
            out.append(lambda t=t: [dist.all_reduce(x) for x in t])
        elif name == "_allgather_base_" and len(t) == 2:
            out.append(lambda t=t: all_gather(t[0], t[1]))
        elif name == "_reduce_scatter_base_" and len(t) == 2:
            out.append(lambda t=t: reduce_scatter(t[0], t[1]))
        elif name == "broadcast_":
            out.append(lambda t=t: [dist.broadcast(x, src=0) for x in t])
        elif name == "reduce_":
            out.append(lambda t=t: [dist.reduce(x, dst=0) for x in t])
        else:
            return None
    return out


def engine_config(device_type: str) -> dict[str, Any]:
    """The DeepSpeed config the engine is measured under: a cell's (``zeroexp.strategies.deepspeed.ds_config``, the
    one place it is written) of ``strategy=deepspeed`` at its defaults (stage 2, zeroexp's bucket, no clipping), fp32,
    no offload, 8 samples a rank, one micro-batch."""
    from zeroexp.cell.strategy import BUCKET_CAP_MB
    from zeroexp.strategies.deepspeed import ds_config

    strategy = SimpleNamespace(stage=2, bucket_cap_mb=BUCKET_CAP_MB, clip_grad_norm=None,
                               stage3_prefetch_bucket_size=None, stage3_max_live_parameters=None,
                               stage3_param_persistence_threshold=None, stage3_max_reuse_distance=None,
                               overlap_comm=False)
    return ds_config(SimpleNamespace(strategy=strategy, precision=SimpleNamespace(name="fp32"), offload="none",
                                     batch_size=8, grad_accum=1), device_type)


#: DeepSpeed's notice that it found no GPU (deepspeed/accelerator/real_accelerator.py ``get_accelerator``), a
#: warning on its "DeepSpeed" logger: on a CPU rank zeroexp asked for, it says nothing the user did not choose.
CPU_ACCELERATOR_NOTICE = "Setting accelerator to CPU"


def quiet_cpu_accelerator_notice() -> None:
    """Drop :data:`CPU_ACCELERATOR_NOTICE` from DeepSpeed's logger (a filter: its other records pass), before
    DeepSpeed is first imported in a process whose output is the user's console (a calibration's ranks)."""
    log = logging.getLogger("DeepSpeed")
    if not any(getattr(f, "_zeroexp", False) for f in log.filters):
        def drop(record: logging.LogRecord) -> bool:
            return CPU_ACCELERATOR_NOTICE not in record.getMessage()
        drop._zeroexp = True  # type: ignore[attr-defined]
        log.addFilter(drop)


def deepspeed_engine(steps: int, device: torch.device, width: int, bare_step: Callable[[], None]) -> dict[str, Any]:
    """The engine's seconds a step beyond ``bare_step`` and its collectives on the framework's 8 Linear units of
    ``width`` (``extra_s``), the model's parameter bytes (``bytes``) and the measurements (``raw``); ``extra_s`` None
    where its collectives could not be replayed."""
    from zeroexp.strategies.deepspeed import _no_shm_comm

    quiet_cpu_accelerator_notice()  # the ranks print to the console
    import deepspeed

    from zeroexp.calibrate.framework import _paired, _stack

    _no_shm_comm(deepspeed)
    # DeepSpeed's sanity check wants a launcher's variables (this rank's, as a cell's worker sets them)
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    net = _stack(device, width)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                                           config=engine_config(device.type), dist_init_required=False)
    x = torch.randn(8, width, device=device)

    def step() -> None:
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    for _ in range(2):  # warm: the engine's buffers made
        step()
    record = _Record()
    with record:
        step()
    calls = replay(record.calls, device)
    nbytes = sum(p.numel() for p in net.parameters()) * 4
    raw: dict[str, Any] = {"deepspeed_calls": [f"{n}{s}" for n, s in record.calls]}
    if calls is None:
        return {"extra_s": None, "bytes": nbytes, "raw": raw}
    got = _paired(step, bare_step, calls, steps, device)
    raw.update(deepspeed_step_s=got["wrapped_s"], deepspeed_base_step_s=got["base_s"],
               deepspeed_calls_s=got["calls_s"], deepspeed_step_s_measured=got["extra_s"])
    return {"extra_s": got["extra_s"], "bytes": nbytes, "raw": raw}


def deepspeed_terms(steps: int, device: torch.device, wake: dict[str, Any] | None) -> dict[str, Any]:
    """``deepspeed_step_s`` and ``deepspeed_step_s_per_byte`` (the line through the engine's cost on the tiny and the
    wide model, per byte of the model's fp32 parameters, :func:`~zeroexp.calibrate.framework.per_byte_fit`), each
    model's cost net of its first collective's waking after the step's compute
    (:func:`~zeroexp.calibrate.framework.per_call`, on the calibration's ``wake`` curve), and ``raw``; both None
    where DeepSpeed is not installed or its collectives could not be replayed (said in ``raw.deepspeed``)."""
    from zeroexp.calibrate.framework import TINY_WIDTH, WIDE_WIDTH, _stack, _train_step, per_byte_fit, per_call
    from zeroexp.formulas.time.rates import WakeCurve
    from zeroexp.strategies.deepspeed import deepspeed_available

    curve = WakeCurve(tuple(wake["gaps_s"]), tuple(wake["extra_s"])) if wake else None

    none = {"deepspeed_step_s": None, "deepspeed_step_s_per_byte": None}
    if not deepspeed_available():
        return {**none, "raw": {"deepspeed": "not installed: DeepSpeed's engine not calibrated"}}
    fits, raw = {}, {}
    for name, width in (("tiny", TINY_WIDTH), ("wide", WIDE_WIDTH)):
        bare = _stack(device, width)
        got = deepspeed_engine(steps, device, width, _train_step(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3),
                                                                 device, width))
        raw.update({(k if name == "tiny" else f"wide_{k}"): v for k, v in got["raw"].items()})
        if got["extra_s"] is None:
            return {**none, "raw": {**raw, "deepspeed": f"a collective of the engine's step ({name}) not replayed"}}
        fits[name] = {"deepspeed_step_s": per_call(got["extra_s"], 1, got["raw"]["deepspeed_base_step_s"], curve),
                      "bytes": {"deepspeed_step_s": got["bytes"]}}
        raw[f"deepspeed_step_s_{name}"] = fits[name]["deepspeed_step_s"]
    return {**per_byte_fit(fits["tiny"], fits["wide"]), "raw": raw}
