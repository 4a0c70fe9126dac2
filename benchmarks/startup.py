"""Start-up: a whole ``python -m zeroexp`` (the default cell) against a bare torch.multiprocessing DDP loop of the same
model, per-rank batch, steps and ranks, both whole processes timed from outside, alternating; median of the pairs.

    python benchmarks/startup.py               # 5 pairs of the default cell (4 ranks, 8 x 256^2, 30 steps, W&B offline)
    python benchmarks/startup.py --pairs 2 --sweep 0 --breakdown 0     # a quick run
    python benchmarks/startup.py --pairs 0 --breakdown 0 --answers 5   # --help and a refused override alone
    python benchmarks/startup.py --sweep 6     # also a 6-cell sweep (seed=0..5) against 6 bare loops in one process

``--breakdown 1`` (the default) also runs the default cell once with every rank timing its phases (process start to the
rank's entry, the rendezvous inside the strategy's setup, Lightning's Trainer, each probe's hooks, the training steps,
the results) and the launching process's own (imports, composing the config, the forkserver until the first rank runs,
waiting, writing the manifest, the cell's epilogue: its plan, summary.json and W&B run); each phase is measured
(``time.monotonic`` around the same calls the cell makes), printed in seconds. Not a test: it prints tables. The host's
load changes both runs alike; read the ratios, which are measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the default cell's work (conf/config.yaml, conf/model/mlp.yaml): what the bare loop repeats
DEFAULT = {"world_size": 4, "width": 256, "depth": 8, "batch_size": 8, "steps": 30, "seed": 0}


# --- the bare floor: torch only, one interpreter, mp.spawn of the ranks ------------------------------------
def _bare_rank(rank: int, world_size: int, port: int, a: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as zeroexp's worker does
    torch.manual_seed(a["seed"])
    net = nn.parallel.DistributedDataParallel(
        nn.Sequential(*(nn.Linear(a["width"], a["width"], bias=False) for _ in range(a["depth"]))))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for step in range(a["steps"]):
        g = torch.Generator().manual_seed(hash((a["seed"], step, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
        loss = net(torch.randn(a["batch_size"], a["width"], generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    dist.barrier()  # nobody tears gloo down while a peer is still in a collective
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown, as zeroexp's forked ranks (a spawned gloo rank sometimes aborts there)


def bare_child(a: dict, repeat: int) -> None:
    """The bare process: ``repeat`` DDP loops of ``world_size`` spawned ranks (a sweep's cells in one process)."""
    import socket

    import torch.multiprocessing as mp

    for _ in range(repeat):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_bare_rank, args=(a["world_size"], port, a), nprocs=a["world_size"])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB", "ZEROEXP"))}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH") or str(ROOT)  # the zeroexp this process imports
    return env


def timed(cmd: list[str], cwd: Path, rc: int = 0) -> float:
    """Wall seconds of the whole process ``cmd``; it must exit ``rc``."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != rc:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return seconds


def pairs(n: int, tmp: Path, sweep: int) -> tuple[list[float], list[float]]:
    """``n`` alternating pairs (zeroexp first on even pairs): wall seconds of each."""
    zx, bare = [], []
    for i in range(n):
        if sweep:
            z_cmd = [sys.executable, "-m", "zeroexp", "--multirun", "seed=" + ",".join(map(str, range(sweep))),
                     f"hydra.sweep.dir={tmp}/sweep{i}"]
        else:
            z_cmd = [sys.executable, "-m", "zeroexp", f"hydra.run.dir={tmp}/cell{i}"]
        b_cmd = [sys.executable, __file__, "--bare-child", str(max(sweep, 1))]
        runs = [(zx, z_cmd), (bare, b_cmd)] if i % 2 == 0 else [(bare, b_cmd), (zx, z_cmd)]
        for out, cmd in runs:
            out.append(timed(cmd, tmp))
        print(f"pair {i}: zeroexp {zx[-1]:6.2f} s  bare {bare[-1]:6.2f} s  ratio {zx[-1] / bare[-1]:.2f}", flush=True)
    return zx, bare


# --- answers: --help and a refused override, against `import hydra` ----------------------------------------
#: What a mistake costs: each command (its exit code) against ``python -c "import hydra"``, alternating.
ANSWERS = {"--help": (["--help"], 0), "+stepz=10 (refused)": (["+stepz=10"], 2)}
ANSWER_TARGET_S = 1.5


def answers(n: int, tmp: Path) -> None:
    """``n`` alternating pairs of each :data:`ANSWERS` command and ``import hydra``; medians, and the target."""
    floor_cmd = [sys.executable, "-c", "import hydra"]
    for label, (argv, rc) in ANSWERS.items():
        zx, floor = [], []
        for i in range(n):
            runs = [(zx, [sys.executable, "-m", "zeroexp", *argv], rc), (floor, floor_cmd, 0)]
            for out, cmd, code in runs if i % 2 == 0 else runs[::-1]:
                out.append(timed(cmd, tmp, code))
        z = statistics.median(zx)
        print(f"python -m zeroexp {label}: median {z:.2f} s, import hydra {statistics.median(floor):.2f} s "
              f"(target < {ANSWER_TARGET_S} s: {'met' if z < ANSWER_TARGET_S else 'NOT met'})", flush=True)


# --- the breakdown: the default cell once, its phases timed where they run --------------------------------
_MARKS: dict[str, float] = {}


def _mark(name: str, seconds: float) -> None:
    _MARKS[name] = _MARKS.get(name, 0.0) + seconds


def _timing(obj, attr: str, name: str, into: dict[str, float] | None = None) -> None:
    """Wrap ``obj.attr`` so that each call adds its wall time to phase ``name`` (of ``into``, else the rank's)."""
    original = getattr(obj, attr)
    marks = _MARKS if into is None else into

    def wrapped(*args, **kwargs):
        t0 = time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            marks[name] = marks.get(name, 0.0) + time.monotonic() - t0

    setattr(obj, attr, wrapped)


def timed_rank_entry(rank, world_size, port, cfg, cell_dir, run_info, environ, cell=None) -> None:
    """zeroexp.rank.worker.rank_entry with its phases timed; writes ``.startup/rank<r>.json`` in the cell."""
    entered = time.time()
    import lightning.pytorch as pl

    import zeroexp.probes as probes
    import zeroexp.rank.worker as worker

    t_start = time.monotonic()
    _timing(pl.Trainer, "__init__", "Lightning Trainer()")
    _timing(pl.Trainer, "fit", "trainer.fit (all below)")
    _timing(worker, "finalize", "finalize: probes' tables, the measured summary (rank 0)")
    _timing(worker, "build_model", "build the model")
    original_probes_for = probes.probes_for

    def probes_for(cfg):
        classes = original_probes_for(cfg)
        for cls in classes:
            for hook in [h for h in vars(cls) if h.startswith("on_")]:
                if not getattr(getattr(cls, hook), "_startup_timed", False):
                    _timing(cls, hook, f"  probe {cls.name} (hooks)")
                    getattr(cls, hook)._startup_timed = True
        return classes

    worker.probes_for = probes_for
    from lightning.pytorch.strategies import DDPStrategy

    _timing(DDPStrategy, "setup_environment", "rendezvous + process group (strategy setup)")
    try:
        worker.rank_entry(rank, world_size, port, cfg, cell_dir, run_info, environ, cell)
    finally:
        _mark("rank total (entry to exit)", time.monotonic() - t_start)
        out = Path(cell_dir, ".startup")
        out.mkdir(exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps({"entered": entered, "marks": _MARKS}))


def breakdown_child(cell_dir: str) -> None:
    """The launching process of the default cell, timed: imports, compose, validate, launch, wait, write."""
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    from zeroexp.launch.local import start_forkserver_for

    start_forkserver_for([])  # first thing, as `python -m zeroexp` does (zeroexp/__main__.py)
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR, register
    import zeroexp.launch.local as launch
    import zeroexp.launch.runner as runner

    marks["imports (zeroexp.cli.run, runner, hydra)"] = time.monotonic() - t0
    t = time.monotonic()
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config")
    marks["compose the config"] = time.monotonic() - t
    original = launch.launch_local
    seen: dict[str, float] = {}

    def launch_local(resolved, cell_dir, run_info, rank_entry, on_started=None, cell=None):
        seen["launch"] = time.time()
        try:
            return original(resolved, cell_dir, run_info, timed_rank_entry, on_started, cell)
        finally:
            seen["joined"] = time.time()

    launch.launch_local = launch_local
    import zeroexp.launch.epilogue as epilogue
    import zeroexp.launch.wandb_cell as wandb_cell

    _timing(epilogue, "finish_cell", "  the cell's epilogue: the plan, summary.json, the W&B run", into=marks)
    _timing(wandb_cell, "log_cell_run", "    of which the W&B run (offline)", into=marks)
    t = time.monotonic()
    seen["run_cell"] = time.time()
    result = runner.run_cell(cfg, Path(cell_dir))
    marks["run_cell (validate, manifest, launch, wait, epilogue, record)"] = time.monotonic() - t
    if result.status != "ok":
        raise SystemExit(f"cell failed: {result.error}")
    ranks = [json.loads(p.read_text()) for p in sorted(Path(cell_dir, ".startup").glob("rank*.json"))]
    marks["  run_cell start -> launch (validate, manifest)"] = seen["launch"] - seen["run_cell"]
    marks["  launch -> first rank runs (what is left of the forkserver's preloads, the fork)"] = (
        min(r["entered"] for r in ranks) - seen["launch"])
    marks["  launch -> every rank joined"] = seen["joined"] - seen["launch"]
    print(json.dumps({"main": marks, "main_total": time.monotonic() - t0, "launch": seen, "ranks": ranks}))


def print_breakdown(tmp: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--breakdown-child", str(tmp / "breakdown")], cwd=tmp,
                          env=_env(), capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    main_total = data["main_total"]
    print(f"\nbreakdown of one default cell ({wall:.2f} s whole process; {main_total:.2f} s inside Python's main, so "
          f"{wall - main_total:.2f} s interpreter start and exit):")
    for name, s in data["main"].items():
        print(f"  main   {name:<66} {s:7.2f} s")
    r0 = data["ranks"][0]["marks"]
    others = [r["marks"] for r in data["ranks"][1:]]
    print(f"  {'rank 0 (other ranks: median)':<73} rank0   others")
    for name, s in sorted(r0.items(), key=lambda kv: -kv[1]):
        rest = [m.get(name, 0.0) for m in others]
        print(f"  rank   {name:<66} {s:7.2f} {statistics.median(rest) if rest else float('nan'):7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating pairs of the default cell (median over them)")
    p.add_argument("--sweep", type=int, default=0, help="also time an N-cell sweep (seed=0..N-1) in --pairs pairs")
    p.add_argument("--breakdown", type=int, default=1, help="1: also time the phases of one default cell")
    p.add_argument("--answers", type=int, default=5, help="alternating pairs of --help / a refused override "
                   "against `import hydra` (0: none)")
    p.add_argument("--bare-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--breakdown-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_child:
        return bare_child(DEFAULT, args.bare_child)
    if args.breakdown_child:
        return breakdown_child(args.breakdown_child)
    a = DEFAULT
    print(f"default cell: {a['world_size']} gloo ranks, {a['depth']} x Linear({a['width']}, {a['width']}), batch "
          f"{a['batch_size']}/rank, {a['steps']} steps, W&B offline; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.answers:
            answers(args.answers, tmp)
        if args.pairs:
            zx, bare = pairs(args.pairs, tmp, 0)
            print(f"single cell: zeroexp median {statistics.median(zx):.2f} s, bare median "
                  f"{statistics.median(bare):.2f} s, ratio of medians "
                  f"{statistics.median(zx) / statistics.median(bare):.2f} (per pair: "
                  f"{', '.join(f'{z / b:.2f}' for z, b in zip(zx, bare))}; target <= 1.5)", flush=True)
        if args.sweep:
            zx, bare = pairs(max(1, args.pairs), tmp, args.sweep)
            n = args.sweep
            print(f"{n}-cell sweep: zeroexp median {statistics.median(zx):.2f} s "
                  f"({statistics.median(zx) / n:.2f} s per cell), bare {statistics.median(bare):.2f} s "
                  f"({statistics.median(bare) / n:.2f} s per loop), ratio "
                  f"{statistics.median(zx) / statistics.median(bare):.2f}", flush=True)
        if args.breakdown:
            print_breakdown(tmp)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
