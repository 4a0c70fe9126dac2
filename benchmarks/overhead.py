"""Framework overhead: zeroexp's median step time over a bare PyTorch loop's, per strategy (target <= 1.05).

For each strategy, each round runs one cell through zeroexp (``run_cell``: Lightning, the adapters, every
probe) and the same model, strategy settings, per-rank batch and rank count as a bare loop
(``torch.multiprocessing``, gloo, no framework), alternating which goes first. Both are timed the same way:
per step the slowest rank's forward + backward + optimizer step, over the steps zeroexp times
(``Schedule.timed``: after warm-up and the probes' steps). Not a test: it prints a table.

    python benchmarks/overhead.py                       # width 1024, depth 8, N=2, 3 rounds
    python benchmarks/overhead.py --strategies ddp --rounds 1 --width 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

STRATEGIES = ("ddp", "zro", "fsdp_grad_op", "fsdp_full")


# --- the bare loop: torch only ---------------------------------------------------------------------
def _bare_rank(rank: int, world_size: int, port: int, strategy: str, a: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as zeroexp's worker does
    torch.manual_seed(a["seed"])
    net = nn.Sequential(*(nn.Linear(a["width"], a["width"], bias=False) for _ in range(a["depth"])))
    adamw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if strategy in ("ddp", "zro"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        net = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=25.0, gradient_as_bucket_view=False)
        opt = (ZeroRedundancyOptimizer(list(net.parameters()), optimizer_class=torch.optim.AdamW,
                                       parameters_as_bucket_view=False, **adamw)
               if strategy == "zro" else torch.optim.AdamW(net.parameters(), **adamw))
    else:
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        full = strategy == "fsdp_full"
        net = FullyShardedDataParallel(
            net, sharding_strategy=ShardingStrategy.FULL_SHARD if full else ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE if full else None,  # zeroexp: prefetch=pre
            forward_prefetch=False, limit_all_gathers=True, use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(net.parameters(), **adamw)
    step_ms = []
    for step in range(a["steps"]):
        g = torch.Generator().manual_seed(hash((a["seed"], step, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
        x = torch.randn(a["batch_size"], a["width"], generator=g)
        t0 = time.perf_counter()
        loss = net(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, step_ms)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()  # rank 0 has written the times: nobody tears down a peer still in a collective
    dist.destroy_process_group()
    # Skip interpreter teardown, as zeroexp's forked ranks do: with torch 2.13 a spawned FSDP/gloo rank
    # sometimes aborts there ("terminate called without an active exception"), after its work is done.
    os._exit(0)


def run_bare(strategy: str, a: dict, timed: range) -> list[float]:
    """Per timed step, the slowest rank's time (ms) of the bare loop."""
    import torch.multiprocessing as mp

    from zeroexp.launch.local import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "bare.json")
        mp.spawn(_bare_rank, args=(a["world_size"], free_port(), strategy, a, out), nprocs=a["world_size"])
        ranks = json.loads(Path(out).read_text())
    return [max(r[s] for r in ranks) for s in timed]


# --- the same cell through zeroexp -----------------------------------------------------------------
def compose_cell(strategy: str, a: dict) -> Any:
    """The zeroexp config of the cell (default probes steps: warm-up 3, profiled 2, memory 2)."""
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR, register

    register()
    overrides = ["logger=none", "model=mlp", f"model.width={a['width']}", f"model.depth={a['depth']}",
                 f"strategy={strategy}", f"world_size={a['world_size']}", f"batch_size={a['batch_size']}",
                 f"steps={a['steps']}", f"seed={a['seed']}", "device=cpu"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_zeroexp(cfg: Any, root: Path) -> list[float]:
    """Per timed step, the slowest rank's time (ms) of the zeroexp cell (its timing section)."""
    from zeroexp.launch.runner import run_cell

    result = run_cell(cfg, root / f"{cfg.strategy.name}_{time.monotonic_ns()}")
    if result.status != "ok":
        raise RuntimeError(f"zeroexp cell {cfg.strategy.name} failed: {result.error}")
    return result.summary["timing"]["step_ms"]


def _cv(xs: list[float]) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from zeroexp.cell.schedule import Schedule

    a = {k: getattr(args, k) for k in ("width", "depth", "world_size", "batch_size", "steps", "seed")}
    times: dict[str, dict[str, list[float]]] = {s: {"zeroexp": [], "bare": []} for s in args.strategies}
    ratios: dict[str, list[float]] = {s: [] for s in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for s in args.strategies:
                cfg = compose_cell(s, a)
                timed = Schedule.from_cfg(cfg).timed
                if rnd % 2 == 0:  # interleaved: alternate which of the two runs first
                    zx, bare = run_zeroexp(cfg, Path(tmp)), run_bare(s, a, timed)
                else:
                    bare, zx = run_bare(s, a, timed), run_zeroexp(cfg, Path(tmp))
                times[s]["zeroexp"] += zx
                times[s]["bare"] += bare
                ratios[s].append(statistics.median(zx) / statistics.median(bare))
                print(f"round {rnd} {s:>13}: zeroexp {statistics.median(zx):8.2f} ms  bare "
                      f"{statistics.median(bare):8.2f} ms  ratio {ratios[s][-1]:.3f}", flush=True)
    print(f"\nmodel: {args.depth} x Linear({args.width}, {args.width}), N={args.world_size}, batch {args.batch_size}"
          f"/rank, {args.steps} steps ({len(timed)} timed), {args.rounds} rounds, gloo, {os.cpu_count()} CPUs")
    print(f"{'strategy':>13} | zeroexp median ms (CV) | bare median ms (CV) | ratio | per-round ratios")
    for s in args.strategies:
        zx, bare = times[s]["zeroexp"], times[s]["bare"]
        ratio = statistics.median(zx) / statistics.median(bare)
        print(f"{s:>13} | {statistics.median(zx):10.2f} ({_cv(zx):5.1%}) | {statistics.median(bare):10.2f} "
              f"({_cv(bare):5.1%}) | {ratio:.3f}{'' if ratio <= 1.05 else ' > 1.05'} | "
              f"{', '.join(f'{r:.3f}' for r in ratios[s])}")


if __name__ == "__main__":
    main()
