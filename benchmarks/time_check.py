"""The step-time model checked in one command: calibrate this machine on the default mlp (width 256), run the
cells on it and on two models it was not timed on (width 768: 9x its parameters; width 90: 1/8), print predicted vs
measured per cell and whether the prediction orders the strategies as the measurement does, model by model.

    python benchmarks/time_check.py                      # calibrate + three sweeps (about 12 min, quiet 2-core host)
    python benchmarks/time_check.py --models mlp768      # one model only
    python benchmarks/time_check.py --models gpt,llama,mlp64,mlp1024 \
        --cells strategy=ddp,zero2,fsdp_full,fsdp2_full,deepspeed  # models of other operators (issue 52's sweep)
    python benchmarks/time_check.py --calibration F.json # reuse a calibration
    python benchmarks/time_check.py --sweep DIR          # only print the table of a sweep that ran

Run it on a quiet host (load < 1): the calibration and the cells must see the same machine. Every number printed is
read from the cells' summary.json (plan.time): predicted (computed) and measured (the timed steps' median and its
bootstrap 95 % CI), the ratio and the check (zeroexp.plan.check.step_time.time_check).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELLS = "strategy=ddp,zro,zero2,fsdp_grad_op,fsdp_full prefetch=pre,none".split()
COMMON = ["world_size=2"]
#: The calibration's model (conf/model/mlp.yaml: 8 x 256^2 parameters) and the cells' widths: its own, 9x its
#: parameters (8 x 768^2) and about 1/8 (8 x 90^2): a calibration's compute carries to another model's size.
CAL_WIDTH, WIDTHS = 256, (256, 768, 90)
#: The models a sweep may name besides ``mlp<width>``: zeroexp's GPT (4 blocks of 64, 32 tokens) and a Hugging Face
#: Llama from its config, shrunk (2 layers of width 32, grouped-query attention, 8 tokens: tests/conftest.py's).
MODELS = {"gpt": ["model=gpt"],
          "llama": ["model=hf", "model.arch=llama", "model.vocab_size=64", "model.hidden_size=32",
                    "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1",
                    "model.intermediate_size=64", "model.max_position_embeddings=16", "model.seq_len=8"]}


def model_args(name: str) -> list[str]:
    """A model's overrides: ``mlp<width>`` or one of :data:`MODELS`."""
    if name.startswith("mlp") and name[3:].isdigit():
        return [f"model.width={int(name[3:])}"]
    if name not in MODELS:
        raise ValueError(f"{name!r} is neither mlp<width> nor one of {', '.join(MODELS)}")
    return MODELS[name]
ORDER = ["ddp", "zro", "zero2", "fsdp_grad_op", "fsdp_full-pre", "fsdp_full-post", "fsdp_full-none"]


def _run(args: list[str], ok: tuple[int, ...] = (0,)) -> str:
    """Run ``args``; its stdout. An exit code outside ``ok`` raises (a sweep's 3, a check failed, is a result)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$", " ".join(args), file=sys.stderr, flush=True)
    done = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode not in ok:
        raise subprocess.CalledProcessError(done.returncode, args, done.stdout)
    return done.stdout


def calibrate(out_dir: Path) -> Path:
    """``python -m zeroexp.calibrate world_size=2 model.width=256``; the JSON's path (its last line ending .json)."""
    out = _run([sys.executable, "-m", "zeroexp.calibrate", *COMMON, f"model.width={CAL_WIDTH}",
                f"output_dir={out_dir}"])
    return Path([line for line in out.splitlines() if line.endswith(".json")][-1])


def sweep(calibration: Path, sweep_dir: Path, steps: int, model: str, cells: list[str] = CELLS) -> Path:
    _run([sys.executable, "-m", "zeroexp", "--multirun", *cells, *COMMON, *model_args(model), f"steps={steps}",
          "logger=csv", f"calibration={calibration}", f"hydra.sweep.dir={sweep_dir}"], ok=(0, 3))
    return sweep_dir


def table(sweep_dir: Path) -> int:
    """Print the cells' plan.time; return 0 when the check holds (at least half the medians known,
    every known one PASS, every separable pair ordered as measured), 1 otherwise."""
    sys.path.insert(0, str(ROOT))
    from zeroexp.report.step_time import order_agreement

    rows = []
    for f in sorted(Path(sweep_dir).glob("*/summary.json")):
        s = json.loads(f.read_text())
        t = (s.get("plan") or {}).get("time") or {}
        m = json.loads((f.parent / "manifest.json").read_text())["config"]
        strategy, prefetch = m["strategy"]["name"], m["prefetch"]["name"]
        name = f"{strategy}-{prefetch}" if strategy == "fsdp_full" else strategy
        rows.append((name, t))
    rows.sort(key=lambda r: ORDER.index(r[0]) if r[0] in ORDER else len(ORDER))
    print(f"\n{sweep_dir}")
    print(f"{'cell':16} {'predicted ms':>12} {'measured median ms [95% CI]':>30} {'ratio':>6} "
          f"{'exposed pred / meas':>20}  check")
    known, passed, ordered = 0, 0, []
    for name, t in rows:
        p, m, ci = t.get("predicted_step_ms"), t.get("measured_median_ms"), t.get("median_ci95_ms")
        e, em = t.get("exposed_comm_ms"), t.get("measured_exposed_comm_ms")
        fm = (lambda v: "-" if v is None else f"{v:.1f}")
        cis = "-" if not ci else f"{m:.1f} [{ci[0]:.1f}, {ci[1]:.1f}]"
        ratio = "-" if t.get("ratio") is None else f"{t['ratio']:.2f}"
        print(f"{name:16} {fm(p):>12} {cis:>30} {ratio:>6} {fm(e) + ' / ' + fm(em):>20}  {t.get('check')}")
        if t.get("check") in ("PASS", "FAIL"):
            known += 1
            passed += t["check"] == "PASS"
        if p is not None and m is not None and ci:
            ordered.append((name, m, tuple(ci), p))
        phases = t.get("predicted_by_phase") or {}
        if phases:
            print(" " * 18 + "predicted: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    agree, disagree = order_agreement(ordered)
    print(f"\nknown medians: {known} of {len(rows)}; PASS {passed} of {known}")
    print(f"order: {len(agree)} of {len(agree) + len(disagree)} separable pairs ordered as measured"
          + (f"; not: {', '.join(disagree)}" if disagree else ""))
    done = known >= len(rows) / 2 and passed == known and not disagree
    print("step-time check:", "met" if done else "not met")
    return 0 if done else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", type=Path, help="a calibration JSON to reuse (default: calibrate now)")
    ap.add_argument("--sweep", type=Path, help="print the table of this sweep directory only")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--models", default=",".join(f"mlp{w}" for w in WIDTHS),
                    help="the cells' models, comma-separated: mlp<width>, " + ", ".join(MODELS)
                    + f" (default {','.join(f'mlp{w}' for w in WIDTHS)})")
    ap.add_argument("--cells", default=" ".join(CELLS), help=f"the sweep's axes (default {' '.join(CELLS)!r})")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "time_check")
    a = ap.parse_args()
    if a.sweep:
        return table(a.sweep)
    models = a.models.split(",")
    for m in models:  # a bad name refused before the calibration (exit 2, as argparse's own)
        try:
            model_args(m)
        except ValueError as e:
            ap.error(f"--models: {e}")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} (run on a quiet host: < 1)", file=sys.stderr)
    cal = a.calibration or calibrate(a.out / "calibration")
    print(f"calibration: {cal}", file=sys.stderr)
    sweeps = [sweep(cal, a.out / f"sweep_{stamp}_{m}", a.steps, m, a.cells.split()) for m in models]
    return max(table(d) for d in sweeps)


if __name__ == "__main__":
    sys.exit(main())
