"""How fast ``python -m zeroexp.recommend`` (and the planner at LLM scale) answers (docs/benchmarks.md, Recommend).

1. The search alone, in process: GPT-2 small at N=64 on h100_ib, every axis opened wide enough for 10,000
   configurations (3 precisions x 3 offloads x 2 checkpointing x 16 micro-batches of 120 samples a rank x 7 bucket
   sizes x 3 prefetches x 5 shard sizes, where each row has the knob): each configuration's model state and
   predicted step, then the peaks of the fastest until 5 fit. Printed: configurations, seconds (wall and CPU) to
   time them all, seconds to the answer (its traces included), configurations judged.
2. The command line, whole processes timed from outside (wall, and the process's user + sys CPU seconds: on a shared
   host the CPU seconds compare, the wall does not): GPT-2 small at N=64, a 7B GPT at N=64 and a 70B-like GPT at N=8
   (nothing fits: the nearest changes), each ``device_memory=80GB network=h100_ib``.

3. Answers at LLM scale (issue 51 item 7), each command a fresh process, ``--llm`` repeats (median and spread of
   wall and CPU seconds): ``zeroexp.recommend`` on Llama 3.1 405B at 8192 tokens and N=1024 (target: under 10 s),
   ``zeroexp.plan`` on Llama 3 70B at N=8, 64, 512 with batch_size=1, bf16, full checkpointing (target: under 5 s);
   each as the first answer for its model (everything computed) and again (its shape, units and traces read from
   the store on disk, zeroexp.cell.store); beside them the import floor the first answer pays (torch and
   transformers' Llama modeling module; the second imports neither the modeling module nor transformers).

    python benchmarks/recommend.py              # all three
    python benchmarks/recommend.py --cli 0      # the search alone
    python benchmarks/recommend.py --search 0 --cli 0 --llm 5   # the LLM-scale answers alone, 5 repeats
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "gpt2_small N=64": ["model=gpt2_small", "world_size=64"],
    "7B GPT N=64": ["model=gpt", "model.n_layer=32", "model.n_embd=4096", "model.n_head=32", "model.seq_len=4096",
                    "model.vocab_size=32000", "world_size=64"],
    "70B-like GPT N=8": ["model=gpt", "model.n_layer=80", "model.n_embd=8192", "model.n_head=64",
                         "model.seq_len=4096", "model.vocab_size=32000", "world_size=8"],
}
WIDE = ["model=gpt2_small", "world_size=64", "device_memory=80GB", "network=h100_ib", "global_batch=7680",
        "precisions=[fp32,bf16,fp16]", "recommend.offload=[none,optimizer,full]",
        "recommend.bucket_cap_mb=[10,25,50,100,200,400,800]", "cache=false"]  # computed: no store on disk


def search_alone() -> None:
    from zeroexp.cell.memo import invocation_memo

    with invocation_memo():  # one invocation, as the command line's: the second search finds the traces
        from hydra import compose, initialize_config_dir

        import zeroexp.recommend.core as core
        from zeroexp.cli.hydra_app import CONF_DIR
        from zeroexp.cli.recommend import register, run
        from zeroexp.recommend.search import Evaluator, Scored, search
        from zeroexp.recommend.space import configurations

        register()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="recommend", overrides=WIDE)
        seen = {}
        original = core.search

        def first(problem, axes, top_k, evaluator=None):  # the Problem and Axes the command line builds
            seen.setdefault("args", (problem, axes, top_k))
            return original(problem, axes, top_k, evaluator)
        core.search = first
        t0 = time.perf_counter()
        run(cfg)
        whole = time.perf_counter() - t0
        core.search = original
        problem, axes, top_k = seen["args"]
        t0, c0 = time.perf_counter(), time.process_time()
        ev = Evaluator(problem)
        timed = [Scored(c, ev.step(c), ev.state_bytes(c)) for c in configurations(axes, problem.world_size)]
        arithmetic, cpu = time.perf_counter() - t0, time.process_time() - c0
        t0 = time.perf_counter()
        result = search(problem, axes, top_k)  # the traces are remembered from the run above
        warm = time.perf_counter() - t0
        print(f"search: {len(timed):,} configurations; state + step of each in {arithmetic:.2f} s ({cpu:.2f} s CPU; a "
              "fresh evaluator); "
              f"the whole run (shape, FLOPs, every step, the traces of the {result.judged} judged) {whole:.2f} s; "
              f"the search again with its traces remembered {warm:.2f} s")


def cli() -> None:
    import resource

    for name, overrides in MODELS.items():
        t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([sys.executable, "-m", "zeroexp.recommend", *overrides, "device_memory=80GB",
                              "network=h100_ib", "format=json", "cache=false"], cwd=ROOT, capture_output=True,
                             text=True)  # every answer computed (no store on disk: zeroexp.cell.store)
        wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # the command's user + sys
        if out.returncode:
            print(f"{name}: exit {out.returncode}: {out.stderr[-500:]}")
            continue
        import json

        answer = json.loads(out.stdout)
        top = answer["recommendations"][0]["config"] if answer["recommendations"] else "nothing fits"
        changes = len(answer["nearest_changes"] or [])
        print(f"{name}: {wall:.1f} s ({cpu:.1f} s CPU), {answer['searched']:,} searched, {answer['judged']} judged; "
              f"first: {top}"
              + (f"; {changes} nearest changes" if not answer["recommendations"] else ""))


#: What every LLM-scale answer imports before it can trace a step (torch, and transformers' Llama modeling module,
#: whose import pulls its generation, masking and hub-kernel modules and torch._dynamo): timed as a fresh process beside
#: the answers, the floor under them on this host.
FLOOR = ("import floor", ["-c", "import torch, transformers.models.llama.modeling_llama"])
#: The LLM-scale commands (3. above): (label, module, overrides, target seconds).
LLM = [
    ("recommend llama3_405b N=1024", "zeroexp.recommend",
     ["model=llama3_405b", "model.seq_len=8192", "world_size=1024", "device_memory=80GB", "network=h100_ib"], 10.0),
    ("plan llama3_70b N=8,64,512", "zeroexp.plan",
     ["model=llama3_70b", "world_size=[8,64,512]", "batch_size=1", "precision=bf16", "activation_checkpointing=full",
      "device_memory=80GB", "network=h100_ib"], 5.0),
]


def llm_scale(repeats: int) -> None:
    """Time each LLM-scale command as a fresh process ``repeats`` times (interleaved, so that a change of load on
    this shared host falls on both): the median wall and CPU (user + sys) seconds, and their range. Each command
    twice: ``first``, as the first answer for its model (no store: ``ZEROEXP_CACHE_DIR=off``, its shape, units and
    traces computed), and ``again``, as every later one (the store on disk, zeroexp.cell.store, filled by one
    untimed run of the same command into a temporary directory, read back)."""
    import os
    import resource
    import statistics
    import tempfile

    store = tempfile.mkdtemp(prefix="zeroexp-store-")
    commands = [(*FLOOR, None, "off")]
    for label, module, overrides, target in LLM:  # (label, argv, target seconds, the store)
        argv = ["-m", module, *overrides, "format=json"]
        commands += [(f"{label}, first", argv, target, "off"), (f"{label}, again", argv, target, store)]
        subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, check=True,
                       env={**os.environ, "ZEROEXP_CACHE_DIR": store})  # the run before "again": fills the store
    times: dict[str, list[tuple[float, float]]] = {label: [] for label, *_ in commands}
    for _ in range(repeats):
        for label, argv, _target, where in commands:
            env = {**os.environ, "ZEROEXP_CACHE_DIR": where}
            t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
            wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            if out.returncode:
                raise SystemExit(f"{label}: exit {out.returncode}: {out.stderr[-500:]}")
            times[label].append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    for label, _argv, target, _where in commands:
        walls, cpus = ([t[i] for t in times[label]] for i in (0, 1))
        print(f"{label}: median {statistics.median(walls):.1f} s wall ({min(walls):.1f}-{max(walls):.1f}), "
              f"{statistics.median(cpus):.1f} s CPU ({min(cpus):.1f}-{max(cpus):.1f}); {repeats} runs"
              + (f"; target {target:.0f} s" if target is not None else " (the floor under each answer below)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--search", type=int, default=1, help="1: time the search in process")
    parser.add_argument("--cli", type=int, default=1, help="1: time the command line on the three models")
    parser.add_argument("--llm", type=int, default=3, help="repeats of each LLM-scale command (0: none)")
    args = parser.parse_args()
    if args.search:
        search_alone()
    if args.cli:
        cli()
    if args.llm:
        llm_scale(args.llm)


if __name__ == "__main__":
    main()
