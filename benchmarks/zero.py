"""zeroexp's own ZeRO-1 / ZeRO-2 against ddp and zro: step time, bus bytes and optimizer bytes per rank.

One invocation runs ddp, zro, zero1, zero2 and zero1 with ``strategy.reduce=allreduce`` as zeroexp cells on the
same model, rank count and per-rank batch, interleaved over rounds (the strategy order rotates each round), and
prints per strategy: the median step time (timing probe: slowest rank per timed step) as a ratio to ddp's, the
bus bytes per step (collectives probe, measured payload x nccl-tests bus factor) and the optimizer-side bytes of
the largest rank (state probe: Adam moments, and the fp32 master shard where there is one). Not a test.

Targets: zero1 and zero2 step time within 1.05 of ddp on a backend with a native reduce_scatter; bus
bytes equal to ddp's plus the all_gather on gloo, moments per rank 1/N of ddp's; their extra time over ddp at most
0.5x a lone all_gather of the same buckets on the same backend (the parameter all_gather overlaps the next
forward). Each round also times that lone all_gather (one process per rank, gloo, the buckets zero1 makes of the
model), and the extra-time ratio is printed with a 95 % bootstrap interval over the timed steps.

    python benchmarks/zero.py                               # width 1024, depth 8, N=2, 3 rounds
    python benchmarks/zero.py --world-size 4 --rounds 1 --width 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

#: label -> overrides; the first is the reference of the time ratio.
VARIANTS = {
    "ddp": ("strategy=ddp",),
    "zro": ("strategy=zro",),
    "zero1": ("strategy=zero1",),
    "zero2": ("strategy=zero2",),
    "zero1-allreduce": ("strategy=zero1", "strategy.reduce=allreduce"),
}


def compose_cell(overrides: tuple[str, ...], a: dict):
    """The cell's config: the mlp of the arguments, no logger, CPU."""
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR, register

    register()
    common = ["logger=none", "model=mlp", f"model.width={a['width']}", f"model.depth={a['depth']}",
              f"world_size={a['world_size']}", f"batch_size={a['batch_size']}", f"steps={a['steps']}",
              f"precision={a['precision']}", "device=cpu"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=[*common, *overrides])


def run(label: str, a: dict, root: Path) -> dict:
    """One cell; its step times, bus bytes per step and the largest rank's optimizer-side bytes."""
    from zeroexp.launch.runner import run_cell

    result = run_cell(compose_cell(VARIANTS[label], a), root / f"{label}_{time.monotonic_ns()}")
    if result.status != "ok":
        raise RuntimeError(f"cell {label} failed: {result.error}")
    s = result.summary
    rank_bytes = s["state"]["max_rank_bytes"]
    return {"step_ms": s["timing"]["step_ms"], "bus": sum(v or 0 for v in s["collectives"]["bus_bytes"].values()),
            "ops": s["collectives"]["counts"], "moments": rank_bytes.get("optim", 0),
            "master": rank_bytes.get("master", 0), "checks": {k: s[k]["check"] for k in ("state", "collectives",
                                                                                    "equivalence")}}


def _gather_rank(rank: int, world_size: int, init: str, sizes: list[int], iters: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    outs = [torch.empty(n, dtype=torch.float32) for n in sizes]
    ins = [torch.randn(n // world_size) for n in sizes]
    times = []
    for i in range(iters + 3):  # 3 warm-up iterations
        dist.barrier()
        t0 = time.perf_counter()
        for o, x in zip(outs, ins):
            dist.all_gather_into_tensor(o, x)
        dist.barrier()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        Path(out).write_text(" ".join(map(str, times)))
    dist.barrier()  # rank 0 has written the times: nobody tears down a peer still in a collective
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown, where a spawned gloo rank sometimes aborts (as benchmarks/overhead.py)


def lone_all_gather_ms(a: dict, root: Path, iters: int = 20) -> list[float]:
    """The all_gather of zero1's parameter buckets for this model alone (no training), per iteration, in ms."""
    import torch.multiprocessing as mp

    from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, derive_groups

    shape = ModelShape(((a["width"], a["width"]),) * a["depth"], (), ())
    groups = derive_groups("zero1", LAYOUTS["zero1"], shape, a["world_size"], 4, PlanKnobs())
    out = root / f"gather_{time.monotonic_ns()}.txt"
    mp.spawn(_gather_rank, args=(a["world_size"], f"file://{root}/store_{time.monotonic_ns()}",
                                 [sh.numel for sh in groups.shards], iters, str(out)), nprocs=a["world_size"])
    return [float(x) for x in out.read_text().split()]


def _interval(extra: list[float], gather: list[float], draws: int = 2000) -> tuple[float, float, float]:
    """Median of (zero - ddp) / lone all_gather from per-step samples, with a 95 % bootstrap interval."""
    import random

    rng = random.Random(0)
    zero, ddp = extra
    def one(z, d, g):
        return (statistics.median(z) - statistics.median(d)) / statistics.median(g)
    ratios = sorted(one(rng.choices(zero, k=len(zero)), rng.choices(ddp, k=len(ddp)),
                        rng.choices(gather, k=len(gather))) for _ in range(draws))
    return one(zero, ddp, gather), ratios[int(0.025 * draws)], ratios[int(0.975 * draws)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    a = {k: getattr(args, k) for k in ("width", "depth", "world_size", "batch_size", "steps", "precision")}
    labels = args.variants if args.variants[0] == "ddp" else ["ddp", *[v for v in args.variants if v != "ddp"]]
    runs: dict[str, list[dict]] = {v: [] for v in labels}
    gather: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            k = rnd % len(labels)
            for label in [*labels, "all_gather"][k:] + [*labels, "all_gather"][:k]:  # rotate: drift spreads evenly
                if label == "all_gather":
                    gather += lone_all_gather_ms(a, Path(tmp))
                    print(f"round {rnd} {'lone all_gather':>15}: median {statistics.median(gather):8.2f} ms",
                          flush=True)
                    continue
                runs[label].append(run(label, a, Path(tmp)))
                print(f"round {rnd} {label:>15}: median {statistics.median(runs[label][-1]['step_ms']):8.2f} ms",
                      flush=True)
    ddp_ms = statistics.median(t for r in runs["ddp"] for t in r["step_ms"])
    print(f"\nmodel: {args.depth} x Linear({args.width}, {args.width}) ({args.precision}), N={args.world_size}, batch "
          f"{args.batch_size}/rank, {args.steps} steps, {args.rounds} rounds, gloo, {os.cpu_count()} CPUs")
    print(f"{'strategy':>15} | median ms | ratio to ddp (per round) | bus bytes/step | collectives/step | "
          f"moments B/rank | master B/rank | checks")
    for label in labels:
        rs = runs[label]
        ms = statistics.median(t for r in rs for t in r["step_ms"])
        per_round = [statistics.median(r["step_ms"]) / statistics.median(d["step_ms"]) for r, d in zip(rs, runs["ddp"])]
        ops = ", ".join(f"{n} {op}" for op, n in sorted(rs[0]["ops"].items()))
        checks = "/".join(sorted(set(v for r in rs for v in r["checks"].values())))
        print(f"{label:>15} | {ms:9.2f} | {ms / ddp_ms:5.3f} ({', '.join(f'{x:.3f}' for x in per_round)}) | "
              f"{rs[0]['bus']:14d} | {ops} | {rs[0]['moments']:14d} | {rs[0]['master']:13d} | {checks}")
    g = statistics.median(gather)
    ddp_steps = [t for r in runs["ddp"] for t in r["step_ms"]]
    print(f"\nlone all_gather of zero1's buckets (same sizes, gloo, N={args.world_size}): median {g:.2f} ms over "
          f"{len(gather)} iterations. Target: (zero - ddp) <= 0.5 x that.")
    for label in (v for v in labels if v.startswith("zero")):
        steps = [t for r in runs[label] for t in r["step_ms"]]
        mid, lo, hi = _interval([steps, ddp_steps], gather)
        verdict = ("meets it" if hi <= 0.5 else "misses it" if lo > 0.5 else
                   "this machine cannot resolve it (the interval spans 0.5)")
        print(f"{label:>15}: (step - ddp) / lone all_gather = {mid:.3f}, 95 % interval [{lo:.3f}, {hi:.3f}]: {verdict}")


if __name__ == "__main__":
    main()
