"""A calibration file (written by ``python -m zeroexp.calibrate``): what it holds, where it lives, which one a cell
uses. Schema in docs/results.md (Calibration files).

A calibration knows nothing of the cells: the collectives' latency and bus bandwidth on this machine, backend and
world size, and the compute rate of one model's forward, backward and AdamW update. A cell uses the newest file
of its machine, backend and world size in :func:`calibration_directory` (``$ZEROEXP_CALIBRATION_DIR`` where set, else
:data:`DEFAULT_DIR`), or the file ``calibration=PATH`` names.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zeroexp.formulas.time.framework import PER_CALL_PATHS, SCHEMA_7_TERMS, FrameworkCost
from zeroexp.formulas.time.kernels import MeasuredKernels
from zeroexp.formulas.time.rates import CALIBRATED_OPS, ComputeRate, LinkFit, WakeCurve, measured_call_seconds

__all__ = ["DEFAULT_DIR", "ENV", "SCHEMA", "calibration_directory", "Calibration", "call_table", "machine",
           "find_calibration", "load_calibration",
           "NO_CALL_COST", "call_cost_fitted"]

#: Where ``python -m zeroexp.calibrate`` writes and cells look (relative to the working directory, like outputs/runs).
DEFAULT_DIR = Path("outputs") / "calibration"
#: The environment variable that moves that directory, for calibrate's writes and the cells' reads alike (the test
#: suite points it at an empty directory of its own, so a user's calibrations never reach its cells).
ENV = "ZEROEXP_CALIBRATION_DIR"
#: 2: collectives timed one call at a time from a barrier (1 timed back-to-back loops), and ``framework``;
#: 3: each size's trimmed mean (``mean_s``, what the model uses) and the ``wake`` curve; 4: each size's share of an
#: async burst (``burst_mean_s``), the framework's wrappers measured side by side; 5: each size's share of a stream
#: of sync calls (``stream_mean_s``), the floor of a call that follows another (the framework's figures net of it);
#: 6: the wrappers measured on a wide model too, their cost per byte of a call's payload (``<path>_s_per_byte``);
#: 7: FSDP2's per-call costs and AdamW's per-DTensor-parameter step (:data:`~zeroexp.formulas.time.framework.
#: SCHEMA_7_TERMS`), and the compute model's resolved config (``compute.model_config``); 8: compute timed at two
#: micro-batch sizes, a forward's and a backward's own cost per call beside the per-sample rates
#: (``compute.forward_call_s``, ``backward_call_s``, ``points``, ``fit``); 9: that call cost split into a fixed
#: part, a part per operator and a part per parameter (``compute.ops``, ``ops_stacks``, ``forward_call_fixed_s``,
#: ``forward_s_per_op``, ``forward_call_s_per_param``, backward's too), and AdamW's step into a fixed part, a part
#: per tensor and one per element, in the rank's share of the cache and beyond it (``adamw_step_s``,
#: ``adamw_s_per_tensor``, ``compute.tensors``, ``adamw_cache_elements``, ``adamw_s_per_element_beyond``,
#: ``adamw_beyond``), so that both carry to a model of other operators, tensors and size; and FSDP1's per-call
#: cost with its original parameters kept (``framework.fsdp1_orig_call_s``, ``_per_byte``; before it: a cell of
#: ``use_orig_params=true`` timed at the flat parameters' cost, and says so); 10: the op-level compute's microbenchmarks
#: (``compute.kernels``: ``torch.mm`` over a grid of shapes, ``torch.add`` over a range of sizes, and the operator
#: stacks' dispatch, ``compute.dispatch``, kept whatever the model's fit), so that a model never calibrated is costed
#: from its traced operations (:class:`~zeroexp.formulas.time.kernels.MeasuredKernels`); 11: the operations a CPU
#: computes rather than streams timed on their own (``compute.kernels.pointwise``: GELU, SiLU, softmax, layer norm,
#: forward and backward) and the fused attention kernel over sequence lengths and head dimensions
#: (``compute.kernels.attention``); before it they cost their bytes at ``torch.add``'s times and their FLOPs as a
#: square matmul's.
SCHEMA = 11
#: The schemas a cell reads: 2's collectives have no mean (their median is used) and no wake curve (no wake term);
#: 2's and 3's no bursts (a burst's call is timed as one alone); 2-4 no streams (a call in a stream pays its waking
#: only); 2-5 no wrapper cost per byte (0); 2-6 no FSDP2 terms (0, and a cell of FSDP2 says so:
#: :meth:`Calibration.missing_terms`); 2-7 no call cost (0: their rate, timed at one micro-batch size, holds the
#: call's cost spread over that size's samples); 8 a call cost of its own model, fixed (carried to no other model);
#: 2-9 no operation microbenchmarks (compute at the calibrated model's rates per parameter x sample and its call
#: costs: :attr:`Calibration.kernels` None); 10 no pointwise or attention tables (their bytes and FLOPs costed).
READS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
#: How ``compute.fit`` begins for a phase whose two micro-batch sizes fit no call cost (schema 8).
NO_CALL_COST = "no call cost"


def call_cost_fitted(compute: dict[str, Any]) -> bool:
    """Whether a calibration's ``compute`` was fitted over two micro-batch sizes, a call's cost beside the per-sample
    rate, for both forward and backward (schema 8, ``compute.fit``): then it times any micro-batch of its model."""
    fit = compute.get("fit")
    return isinstance(fit, dict) and all(isinstance(fit.get(p), str) and not fit[p].startswith(NO_CALL_COST)
                                         for p in ("forward", "backward"))


def machine() -> dict[str, Any]:
    """This machine: host name, CPU model, cores, GPU (if any); ``id`` is what calibrations are matched on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a machine without a working CUDA has no GPU here
        gpu = None
    host, cores = socket.gethostname(), os.cpu_count() or 1
    return {"id": f"{host}|{cpu}|{cores}|{gpu or 'cpu'}", "hostname": host, "cpu": cpu, "cores": cores, "gpu": gpu,
            "platform": platform.platform()}


def call_table(rows: list[dict[str, Any]], key: str | None = None) -> list[tuple[int, float]]:
    """A measured op's (S, seconds of one call) pairs: each size's ``key`` (``burst_mean_s``, ``stream_mean_s``)
    where measured, else each size's mean alone (schema 2: its median)."""
    special = [(r["bytes"], r[key]) for r in rows if key in r] if key else []
    return special or [(r["bytes"], r.get("mean_s", r["seconds"])) for r in rows]


@dataclass(frozen=True)
class Calibration:
    """A calibration file, read: per op its fit, the compute rate, and where it was measured."""

    path: str
    data: dict[str, Any]

    @property
    def world_size(self) -> int:
        return int(self.data["world_size"])

    def link(self, op: str) -> LinkFit:
        fit = self.data["collectives"][op]["fit"]
        return LinkFit(float(fit["alpha_s"]), float(fit["busbw_Bps"]))

    def seconds_at(self, world_size: int, burst: bool = False, stream: bool = False
                   ) -> Callable[[str, float, float], float]:
        """(op, S, calls) -> seconds at ``world_size`` ranks: ``calls`` calls of S / calls bytes each, every call
        from the op's measured sizes (:func:`~zeroexp.formulas.time.rates.measured_call_seconds`: the measured curve of
        each size's mean (schema 2: median), the
        fit beyond it; at another N scaled by the ring's bus factor); an op never calibrated (reduce, all_to_all)
        as an all_reduce of its payload (an upper bound for those). ``burst``: a call's share of an async burst
        from the sizes measured in bursts (``burst_mean_s``; beyond the largest, the fit's bandwidth), else (schema
        2 and 3) one call alone; ``stream``: a call's share of a stream of sync calls (``stream_mean_s``, likewise;
        schema 2-4: one call alone)."""
        n_cal = int(self.data["world_size"])

        def seconds(op: str, payload_bytes: float, calls: float) -> float:
            if world_size <= 1 or calls <= 0:
                return 0.0  # one rank sends nothing (and an N=1 calibration has no collectives)
            measured = op if op in self.data["collectives"] else "all_reduce"
            rows = self.data["collectives"][measured]["sizes"]
            table = call_table(rows, "burst_mean_s" if burst else "stream_mean_s" if stream else None)
            return calls * measured_call_seconds(measured, payload_bytes / calls, world_size, table, n_cal,
                                                 self.link(measured))
        return seconds

    @property
    def wake(self) -> WakeCurve | None:
        """A call's extra cost after the rank computed since its last call; None where not measured (one rank,
        schema 2)."""
        w = self.data.get("wake")
        return WakeCurve(tuple(w["gaps_s"]), tuple(w["extra_s"])) if w else None

    @property
    def rate(self) -> ComputeRate:
        """The compute rate: schema 9 a call's fixed cost, its cost per operator and per parameter (its model's
        fitted call cost, ``*_call_s``, is what they sum to there); schema 8 that call cost itself, fixed; before
        it none."""
        c = self.data["compute"]
        split, phases = "forward_s_per_op" in c, ("forward", "backward")
        return ComputeRate(c["forward_s_per_param_sample"], c["backward_s_per_param_sample"],
                           c["adamw_s_per_element"],
                           *(c.get(f"{p}_call_fixed_s" if split else f"{p}_call_s", 0.0) for p in phases),
                           **({f"{p}{k}": float(c[f"{p}{k}"]) for p in ("forward", "backward")
                               for k in ("_s_per_op", "_call_s_per_param")} if split else {}),
                           **{k: float(c[k]) for k in ("adamw_step_s", "adamw_s_per_tensor",
                                                       "adamw_s_per_element_beyond") if k in c},
                           adamw_cache_elements=int(c.get("adamw_cache_elements", 0)))

    @property
    def kernels(self) -> MeasuredKernels | None:
        """The operation microbenchmarks and the operator stacks' dispatch (schema 10; the pointwise operations and the
        attention kernel from schema 11, before it costed by their bytes and FLOPs), what the op-level compute costs a
        traced step with; None before them."""
        c = self.data["compute"]
        k, dispatch = c.get("kernels"), c.get("dispatch")
        if not k or not dispatch:
            return None
        mm, mem, att = k["matmul"], k["memory"], k.get("attention")
        return MeasuredKernels(tuple(int(d) for d in mm["dims"]),
                               tuple(tuple(tuple(float(x) for x in row) for row in plane) for plane in mm["seconds"]),
                               tuple(int(b) for b in mem["bytes"]), tuple(float(x) for x in mem["seconds"]),
                               **{f"{p}{k}": float(dispatch[p][f"{k[1:]}"]) for p in ("forward", "backward")
                                  for k in ("_fixed_s", "_s_per_op")},
                               pointwise=tuple((name, tuple(int(b) for b in t["bytes"]),
                                                tuple(float(x) for x in t["seconds"]))
                                               for name, t in sorted((k.get("pointwise") or {}).items())),
                               **({"attention_heads": tuple(int(h) for h in att["heads"]),
                                   "attention_seq": tuple(int(x) for x in att["seq"]),
                                   "attention_dims": tuple(int(x) for x in att["head_dim"]),
                                   "attention_seconds": tuple(
                                       (name, tuple(tuple(tuple(float(x) for x in row) for row in grid) for grid in g))
                                       for name, g in sorted(att["seconds"].items()))}
                                  if att else {}))

    @property
    def framework(self) -> FrameworkCost:
        """The framework's calibrated per-step primitives (:mod:`zeroexp.formulas.time.framework`)."""
        f = self.data["framework"]
        return FrameworkCost(loop_s=f["loop_s"], copy_s_per_byte=f["copy_s_per_byte"],
                             dtensor_param_step_s=f.get("dtensor_param_step_s", 0.0),
                             **{f"{k}_s{per}": f.get(f"{k}_s{per}", None if k == "fsdp1_orig_call" else 0.0)
                                for k in PER_CALL_PATHS for per in ("", "_per_byte")},
                             deepspeed_step_s=f.get("deepspeed_step_s"),
                             deepspeed_step_s_per_byte=f.get("deepspeed_step_s_per_byte"))

    def missing_terms(self) -> str | None:
        """A note naming the framework terms this calibration lacks (read as 0), None when it has them all."""
        absent = [k for k in SCHEMA_7_TERMS if k not in self.data["framework"]]
        if not absent or int(self.data["world_size"]) <= 1:
            return None
        return (f"calibration schema {self.data['schema']} lacks {', '.join(absent)} (read as 0: FSDP2's own costs "
                f"not in this prediction); recalibrate (python -m zeroexp.calibrate) for them")

    def summary(self) -> dict[str, Any]:
        """What ``plan.time.calibration`` shows of it."""
        d = self.data
        return {"path": self.path, "created": d["created"], "machine": d["machine"]["id"], "backend": d["backend"],
                "world_size": d["world_size"], "model": d["compute"]["model"],
                "batch_size": d["compute"]["batch_size"], "overlap": d["overlap"]}


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file; ``ValueError`` naming what is wrong."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {p}: {e}") from e
    missing = [k for k in ("schema", "created", "machine", "backend", "world_size", "collectives", "compute",
                           "framework", "overlap") if k not in data]
    if missing or data.get("schema") not in READS:
        raise ValueError(f"{p} is no zeroexp calibration (schema {' or '.join(map(str, READS))}): missing "
                         f"{missing or 'nothing'}, schema {data.get('schema')!r}")
    absent = [op for op in CALIBRATED_OPS if op not in data["collectives"]]
    if absent and int(data["world_size"]) > 1:
        raise ValueError(f"{p} lacks the ops {absent}")
    return Calibration(str(p), data)


def calibration_directory() -> Path:
    """Where calibrations are written and looked for: ``$ZEROEXP_CALIBRATION_DIR`` where set and not empty, else
    :data:`DEFAULT_DIR` (read at each call, not at import)."""
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


def find_calibration(backend: str, world_size: int | None, directory: Path | None = None,
                     machine_id: str | None = None, model: Callable[[Calibration], bool] | None = None
                     ) -> Calibration | None:
    """The newest calibration in ``directory`` (None: :func:`calibration_directory`) of this machine (or
    ``machine_id``), ``backend`` and ``world_size`` (None: any), and, given ``model``, one it accepts."""
    directory = calibration_directory() if directory is None else directory
    want = machine_id or machine()["id"]
    found = []
    for p in sorted(Path(directory).glob("*.json")) if Path(directory).is_dir() else []:
        try:
            cal = load_calibration(p)
        except ValueError:
            continue
        d = cal.data
        if (d["machine"]["id"] == want and d["backend"] == backend and world_size in (None, int(d["world_size"]))
                and (model is None or model(cal))):
            found.append((d["created"], str(p), cal))
    return max(found)[2] if found else None
