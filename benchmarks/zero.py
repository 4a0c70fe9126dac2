"""zeroexp's own ZeRO-1 / ZeRO-2 against ddp and zro: step time, bus bytes and optimizer bytes per rank.

One invocation runs ddp, zro, zero1, zero2 and zero1 with ``strategy.reduce=allreduce`` as zeroexp cells on the
same model, rank count and per-rank batch, interleaved over rounds (the strategy order rotates each round), and
prints per strategy: the median step time (timing probe: slowest rank per timed step) as a ratio to ddp's, the
bus bytes per step (collectives probe, measured payload x nccl-tests bus factor) and the optimizer-side bytes of
the largest rank (state probe: Adam moments, and the fp32 master shard where there is one). Not a test.

Targets (issue 7): zero1 and zero2 step time within 1.05 of ddp, bus bytes equal to ddp's, moments per rank
1/N of ddp's.

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

    from zeroexp.cli import CONF_DIR, register

    register()
    common = ["logger=none", "model=mlp", f"model.width={a['width']}", f"model.depth={a['depth']}",
              f"world_size={a['world_size']}", f"batch_size={a['batch_size']}", f"steps={a['steps']}",
              f"precision={a['precision']}", "device=cpu"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=[*common, *overrides])


def run(label: str, a: dict, root: Path) -> dict:
    """One cell; its step times, bus bytes per step and the largest rank's optimizer-side bytes."""
    from zeroexp.runner import run_cell

    result = run_cell(compose_cell(VARIANTS[label], a), root / f"{label}_{time.monotonic_ns()}")
    if result.status != "ok":
        raise RuntimeError(f"cell {label} failed: {result.error}")
    s = result.summary
    rank_bytes = s["state"]["max_rank_bytes"]
    return {"step_ms": s["timing"]["step_ms"], "bus": sum(v or 0 for v in s["collectives"]["bus_bytes"].values()),
            "ops": s["collectives"]["counts"], "moments": rank_bytes.get("optim", 0),
            "master": rank_bytes.get("master", 0), "checks": {k: s[k]["check"] for k in ("state", "collectives",
                                                                                    "equivalence")}}


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
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            k = rnd % len(labels)
            for label in labels[k:] + labels[:k]:  # rotate the order: drift on a shared machine spreads evenly
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


if __name__ == "__main__":
    main()
