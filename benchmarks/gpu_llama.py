"""A ~1.1 B Llama trained on one GPU (N=1, bf16), planned beside measured: what the device really uses and takes.

Each activation checkpointing option (``full``, ``selective_op``) runs as a real cell (``python -m zeroexp``, a
process of its own, DDP at one rank: no collective), whose probes measure torch.cuda's allocated bytes per phase, the
caching allocator's reserved peak, NVML's used bytes (``memory.device_by_rank``) and each phase's time
(``timing.phase_ms``); the planner predicts the same cell on the preset of the GPU it runs on (``h200_ib`` on an
H200, ``h100_ib`` on an H100, else none: memory only) with the op-level step. One JSON, every figure under
``measured`` or ``planned`` with the field it came from.

    python benchmarks/gpu_llama.py --out gpu_llama.json            # on a GPU; without one it says so and exits 0

The CPU side (the commands and the pairing of figures) is tests/test_gpu_llama.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model=llama_1b", "model.seq_len=2048", "batch_size=4", "precision=bf16", "world_size=1", "strategy=ddp"]
OPTIONS = ("full", "selective_op")
#: GPU name fragment -> the preset the planner times it on
PRESETS = {"H200": "h200_ib", "H100": "h100_ib", "A100": "a100_ib"}


def cell_command(option: str, run_dir: str, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The cell's command line: the model at one rank on CUDA with ``activation_checkpointing=option``."""
    return [sys.executable, "-m", "zeroexp", *MODEL, f"activation_checkpointing={option}", "device=cuda",
            f"steps={steps}", "logger=csv", f"hydra.run.dir={run_dir}", *extra]


def plan_overrides(option: str, preset: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    """The planner's overrides for the same cell: its preset's network (or ``device=cuda`` alone without one)."""
    network = [f"network={preset}"] if preset else ["device=cuda"]
    return [*MODEL, f"activation_checkpointing={option}", *network, "format=json", *extra]


def pair(summary: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """One cell's measured figures (its summary.json) beside the planner's record of it, each named by its field."""
    memory = summary.get("memory") or {}
    reading = (memory.get("device_by_rank") or [{}])[0]
    reserved = (memory.get("reserved_of_max_rank") or {}).get("phases") or {}
    timing = summary.get("timing") or {}
    measured = {"peak_bytes (memory.peak_bytes_max)": memory.get("peak_bytes_max"),
                "reserved_peak_bytes (memory.reserved_of_max_rank)": max(reserved.values(), default=None),
                "device_used_bytes (memory.device_by_rank: NVML)": reading.get("nvml_used_bytes"),
                "step_ms (timing.median_ms)": timing.get("median_ms"),
                "phase_ms (timing.phase_ms)": timing.get("phase_ms")}
    planned = {"peak_bytes": record.get("peak_bytes"), "reserved_peak_bytes": record.get("reserved_peak_bytes"),
               "device_total_bytes": record.get("device_total_bytes"), "step_ms": record.get("step_ms"),
               "recompute_ms": record.get("recompute_ms"), "network_source": record.get("network_source")}
    pairs = {"peak": ("peak_bytes (memory.peak_bytes_max)", "peak_bytes"),
             "reserved": ("reserved_peak_bytes (memory.reserved_of_max_rank)", "reserved_peak_bytes"),
             "device": ("device_used_bytes (memory.device_by_rank: NVML)", "device_total_bytes"),
             "step": ("step_ms (timing.median_ms)", "step_ms")}
    ratios = {k: planned[p] / measured[m] for k, (m, p) in pairs.items() if planned[p] and measured[m]}
    return {"measured": measured, "planned": planned, "planned_over_measured": ratios,
            "plan_memory_check": ((summary.get("plan") or {}).get("memory") or {}).get("check")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_llama.json")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--set", action="append", default=[], help="an override for both sides (repeatable)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device here (torch.cuda.is_available() is False): the 1.1 B Llama needs one GPU",
              flush=True)
        return 0
    from zeroexp.cli.plan import run as plan

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import _compose

    name = torch.cuda.get_device_name()
    preset = next((v for k, v in PRESETS.items() if k in name), None)
    result: dict[str, Any] = {"gpu": name, "torch": torch.__version__, "preset": preset, "model": MODEL, "cells": {}}
    extra = tuple(args.set)
    for option in OPTIONS:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = str(Path(tmp) / "cell")
            done = subprocess.run(cell_command(option, run_dir, args.steps, extra), cwd=ROOT, capture_output=True,
                                  text=True, timeout=420, env=dict(os.environ))
            summary_path = Path(run_dir) / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        (record,), _ = plan(_compose("plan", plan_overrides(option, preset, extra)))
        row = pair(summary, record) if summary else {"error": f"exit {done.returncode}: "
                                                              f"{done.stderr.strip().splitlines()[-3:]}"}
        result["cells"][option] = {"exit": done.returncode, **row}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({option: row.get("planned_over_measured", row.get("error"))}), flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
