"""One rank of N on one device, planned beside measured: the CUDA-semantics peak of a rank of N=4 and N=8 on one GPU.

Each cell is played as rank 0 of ``world_size`` under torch's fake process group with real tensors
(``zeroexp.rank.dryrun.play_rank0``): the rank's shards, unsharded units, gradients, buffers and optimizer state are
really allocated, every collective returns at once. The memory probe measures the rank (on a GPU the caching
allocator's allocated and reserved bytes; on the CPU MemTracker), the planner predicts the same rank
(``python -m zeroexp.plan ... device=cuda|cpu format=json``), and the cell's own check
(``summary.json["plan"]["memory"]``'s rule, ``zeroexp.plan.check.memory.memory_section``) judges each phase. One JSON.

    python benchmarks/gpu_check.py --out gpu_check.json                 # on a GPU: seed_ch31, N=4 and 8
    python benchmarks/gpu_check.py --device cpu --model mlp --world-sizes 4 --out x.json   # the same on the CPU

The fake process group makes no backend buffer (NCCL's, gloo's): neither side counts one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: The strategies traced under the fake process group (StrategyAdapter.dry_run_traced), with FULL_SHARD's prefetch.
CELLS = [("fsdp_full", "pre"), ("fsdp_full", "post"), ("fsdp_full", "none"), ("fsdp_grad_op", "pre"),
         ("fsdp2_full", "pre"), ("fsdp2_grad_op", "pre")]


def _compose(config_name: str, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.config.schemas import register_schemas

    register_schemas()
    if config_name == "plan":
        from zeroexp.cli.plan import register

        register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def planned(model: str, strategy: str, prefetch: str, n: int, batch: int, device: str,
            extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The planner's row for the cell: steady, peak and (cuda) reserved bytes and each phase above steady (on a GPU
    with its compute capability: cuBLAS's workspace size)."""
    from zeroexp.cli.plan import run

    overrides = [f"model={model}", f"world_size={n}", f"batch_size={batch}", f"device={device}",
                 f"prefetch={prefetch}", f"strategies=[{strategy}]", *extra]
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            overrides.append("compute_capability={}.{}".format(*torch.cuda.get_device_capability()))
    records, notes = run(_compose("plan", overrides))
    r = records[0]
    keys = ("steady_bytes", "peak_bytes", "reserved_peak_bytes", "phase_bytes", "peak_phase", "workspace_bytes",
            "device_semantics", "peak_note")
    return {k: r.get(k) for k in keys}


def measured(model: str, strategy: str, prefetch: str, n: int, batch: int, device: str,
             extra: tuple[str, ...] = (), steps: int | None = None) -> dict[str, Any]:
    """Rank 0 of ``n`` played on ``device`` with real tensors: the memory probe's section and the cell's own check
    of it against the peak model (its phases, check and reasons)."""
    import torch
    from omegaconf import OmegaConf

    from zeroexp.config.schemas import validate
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.cell.resolved import Cell, layout_of
    from zeroexp.plan.check.expect import itemsize_of
    from zeroexp.plan.check.memory import memory_section
    from zeroexp.plan.shape import model_shape
    from zeroexp.rank.dryrun import play_rank0

    overrides = [f"model={model}", f"strategy={strategy}", f"world_size={n}", f"batch_size={batch}",
                 f"device={device}", "logger=none", *extra, *([f"steps={steps}"] if steps else [])]
    overrides += [f"prefetch={prefetch}"] if strategy == "fsdp_full" else []  # an axis of FULL_SHARD's alone
    cfg = _compose("config", overrides)
    validate(cfg)
    start = time.perf_counter()
    out = play_rank0(OmegaConf.to_container(cfg, resolve=True), torch.device(device))
    seconds = time.perf_counter() - start
    section = out["memory_section"]
    if section is None:
        return {"error": "the memory probe tracked no step", "seconds": seconds}
    cell = Cell.of(cfg)
    plan = memory_section(cell, {"memory": section}, layout_of(cfg)[0], cell_groups(cell), itemsize_of(cfg),
                          [import_class(p) for p in wrap_paths(cfg)], model_shape(cfg.model, wrap_paths(cfg)))
    keep = ("source", "steady_bytes", "peak_bytes", "phase_peak_bytes_max", "reserved_of_max_rank",
            "compute_capability")
    return {"memory": {k: section[k] for k in keep if k in section}, "check": plan["check"],
            "reasons": plan.get("reasons", []), "phases": plan.get("phases", {}), "seconds": round(seconds, 1)}


def measured_apart(model: str, strategy: str, prefetch: str, n: int, batch: int, device: str,
                   extra: tuple[str, ...] = (), steps: int | None = None) -> dict[str, Any]:
    """:func:`measured` in a process of its own, as a real rank is: nothing an earlier cell or the planner left alive
    in this process (the memory probe registers every live tensor at a tracked step's start) is in its figures, and
    the device's memory is the cell's alone."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-one", f"{strategy}:{prefetch}:{n}",
               "--model", model, "--batch-size", str(batch), "--device", device, "--out", str(out),
               *(f"--set={o}" for o in extra), *(["--steps", str(steps)] if steps else [])]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if not out.exists():
            return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
        return json.loads(out.read_text())


def run(model: str, world_sizes: list[int], batch: int, device: str, cells: list[tuple[str, str]],
        extra: tuple[str, ...] = (), out: Path | None = None, steps: int | None = None) -> dict[str, Any]:
    """Every cell at every world size, planned beside measured, as one JSON-able record; written to ``out`` after
    each cell (a check stopped by its time limit leaves the cells it finished)."""
    import torch

    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    rows: list[dict[str, Any]] = []
    fsdp1 = bool(_compose("config", ["strategy=fsdp_full"]).strategy.use_orig_params)  # the cells' FSDP1 default
    result = {"device": device, "gpu": gpu, "torch": torch.__version__, "model": model, "overrides": list(extra),
              "use_orig_params": fsdp1,
              "batch_size": batch, "backend": "fake (torch's fake process group: collectives faked, tensors real)",
              "cells": rows}
    for n in world_sizes:
        for strategy, prefetch in cells:
            row = {"strategy": strategy, "prefetch": prefetch, "world_size": n,
                   "planned": planned(model, strategy, prefetch, n, batch, device, extra)}
            row["measured"] = measured_apart(model, strategy, prefetch, n, batch, device, extra, steps)
            rows.append(row)
            if out is not None:
                out.write_text(json.dumps(result, indent=1))
            print(json.dumps({k: row[k] for k in ("strategy", "prefetch", "world_size")}
                             | {"check": row["measured"].get("check", row["measured"].get("error"))}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="seed_ch31")
    p.add_argument("--world-sizes", default="4,8")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--strategies", default=None, help="comma-separated strategy[:prefetch]; default: every traced one")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--set", action="append", default=[], help="a model override for both sides (repeatable)")
    p.add_argument("--measure-one", default=None, help="strategy:prefetch:world_size: one cell's measured side")
    p.add_argument("--steps", type=int, default=None, help="the cells' steps (default: the config's)")
    args = p.parse_args(argv)
    if args.measure_one:
        strategy, prefetch, n = args.measure_one.split(":")
        if args.device == "cpu":  # the threads a rank of n gets on this host (zeroexp.rank.worker), set before torch's
            import os             # import: the OpenMP pool is sized then, and a larger one spins beside a busy core

            from zeroexp.devices import rank_threads

            os.environ["OMP_NUM_THREADS"] = str(rank_threads(int(n)))
        try:
            got = measured(args.model, strategy, prefetch, int(n), args.batch_size, args.device, tuple(args.set),
                           args.steps)
        except Exception as e:  # noqa: BLE001 - one cell's failure is a row, not the end of the check
            got = {"error": f"{type(e).__name__}: {e}"}
        Path(args.out).write_text(json.dumps(got))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("SKIP: no CUDA device here (torch.cuda.is_available() is False): nothing measured", flush=True)
            return 0
    cells = CELLS if args.strategies is None else [
        (s.split(":")[0], s.split(":")[1] if ":" in s else "pre") for s in args.strategies.split(",")]
    result = run(args.model, [int(n) for n in args.world_sizes.split(",")], args.batch_size, args.device, cells,
                 tuple(args.set), Path(args.out), args.steps)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
