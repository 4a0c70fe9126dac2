"""CUDA / NCCL cells (marked ``gpu``): skipped without a GPU, with the reason. On one GPU every strategy that does not
shard runs at world_size=1 (one GPU cannot hold two NCCL ranks; FSDP at one rank is refused); with two or more, NCCL
cells at N=2, FSDP CPUOffload and DeepSpeed fp16 (which need a GPU) too. Run them with ``benchmarks/gpu_check.sh``
on a GPU machine, which also plays one rank of N=4 and N=8 on one GPU (benchmarks/gpu_check.py). What of that check
runs without a GPU runs here on any machine: its driver (a rank of N played with real tensors under the fake process
group) on CPU tensors, its JSON, its skip."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: CUDA/NCCL cells need one GPU per rank")

STRATEGIES = [("strategy=ddp",), ("strategy=zro",), ("strategy=zero1",), ("strategy=zero2",),
              ("strategy=fsdp_grad_op",), ("strategy=fsdp_full", "prefetch=post"), ("strategy=fsdp2_full",),
              ("strategy=fsdp2_grad_op",)]


def _deepspeed() -> bool:
    from zeroexp.strategies.deepspeed import deepspeed_available

    return deepspeed_available()


def _checks_pass(r, memory_source: str = "torch.cuda") -> None:
    import json
    from pathlib import Path

    assert r.status == "ok", r.error
    s = r.summary
    manifest = json.loads((Path(r.cell_dir) / "manifest.json").read_text())
    assert manifest["device_type"] == "cuda" and manifest["backend"] == "nccl", manifest
    for probe in ("state", "collectives", "equivalence"):
        assert s[probe]["check"] in ("PASS", "n/a"), (probe, s[probe].get("reasons"))
    assert s["state"]["check"] == "PASS" and s["equivalence"]["check"] == "PASS"
    assert s["memory"]["source"].startswith(memory_source)


#: What runs at one rank: FSDP1 and FSDP2 at world_size=1 shard nothing (refused, below); one GPU measures them as one
#: rank of N under the fake process group (benchmarks/gpu_check.py).
ONE_RANK = [o for o in STRATEGIES if not o[0].startswith("strategy=fsdp")]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("overrides", ONE_RANK, ids=lambda o: o[0].split("=")[1])
def test_every_unsharded_strategy_runs_on_one_gpu(cell, overrides):
    _checks_pass(cell(*overrides, "world_size=1", "device=cuda"))


@pytest.mark.parametrize("strategy", ["fsdp_grad_op", "fsdp_full", "fsdp2_full", "fsdp2_grad_op"])
def test_a_sharded_strategy_at_one_rank_is_refused_naming_world_size(compose, strategy):
    """torch runs FSDP1 as NO_SHARD at one rank and FSDP2 skips its collectives there (an H200 run of the cells
    above found both: FSDP1 crashed on NO_SHARD's flat parameter, FSDP2 measured no all-gather against 16 expected)."""
    from zeroexp.config.schemas import ConfigError, NotApplicableHere, validate

    with pytest.raises(NotApplicableHere, match="NO_SHARD") as e:  # a ConfigError: a single run exits 2
        validate(compose(f"strategy={strategy}", "world_size=1"))
    assert e.value.key == "world_size" and isinstance(e.value, ConfigError)
    assert str(e.value).startswith("not applicable here: world_size=1: ")  # valid, not runnable: not "invalid"
    with pytest.raises(ConfigError, match="^invalid config: world_size=0: "):
        validate(compose(f"strategy={strategy}", "world_size=0"))


def test_a_sweep_over_world_sizes_skips_fsdp_at_one_rank_and_runs_the_rest(tmp_path):
    """``strategy=fsdp_full world_size=1,2``: a product of axes; the job FSDP cannot run is skipped with the reason,
    not the whole sweep refused (the other a dry run: no rank starts)."""
    from conftest import run_cli

    out = run_cli("--multirun", "strategy=fsdp_full", "world_size=1,2", "dry_run=true", "logger=none",
                  "model.width=16", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    text = " ".join(out.stdout.split())
    assert out.returncode == 0, text[-2000:]
    assert text.count("skip: sweep job") == 1 and "strategy=fsdp_full world_size=1" in text and "NO_SHARD" in text
    assert "not applicable here: world_size=1" in text and "invalid config" not in text


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(GPUS < 2, reason="NCCL cells at N=2 need two GPUs")
@pytest.mark.parametrize("overrides", STRATEGIES, ids=lambda o: o[0].split("=")[1])
def test_nccl_cells_at_two_ranks(cell, overrides):
    r = cell(*overrides, "world_size=2", "device=cuda")
    _checks_pass(r)
    assert r.summary["collectives"]["check"] == "PASS", r.summary["collectives"]["reasons"]
    assert r.summary["plan"]["check"] == "PASS", r.summary["plan"]["reasons"]


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(GPUS < 2, reason="FSDP CPUOffload at N=2 needs two GPUs")
def test_fsdp_cpu_offload(cell):
    r = cell("strategy=fsdp_full", "world_size=2", "device=cuda", "offload=full")
    _checks_pass(r)
    assert r.summary["state"]["placement"]["param"]["host_bytes"] > 0


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(GPUS < 2, reason="FSDP2 CPUOffloadPolicy at N=2 needs two GPUs")
def test_fsdp2_cpu_offload_policy(cell):
    r = cell("strategy=fsdp2_full", "world_size=2", "device=cuda", "offload=full")
    _checks_pass(r)
    assert r.summary["state"]["placement"]["param"]["host_bytes"] > 0


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(GPUS < 2, reason="DeepSpeed fp16 at N=2 needs two GPUs")
def test_deepspeed_fp16(cell):
    if not _deepspeed():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    _checks_pass(cell("strategy=deepspeed", "strategy.stage=2", "world_size=2", "device=cuda", "precision=fp16"))


# -- The one-GPU check's side that runs anywhere (benchmarks/gpu_check.py, benchmarks/gpu_check.sh).
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
TORCH_TRANSFORMER = ("model._target_=" + DTENSOR + ".Transformer", "model.input_shape=[8]",
                     f"+model.args._target_={DTENSOR}.ModelArgs", "+model.args.n_layers=2",
                     "+model.args.vocab_size=32", "+model.args.max_seq_len=8", "+model.args.dim=32",
                     "+model.args.n_heads=4", "+model.args.weight_tying=false", "+model.args.dropout_p=0.0",
                     "model.dtype=long", "model.high=32", "model.loss=next_token",
                     f"model.wrap=[{DTENSOR}.TransformerBlock]")
TT = __import__("importlib.util").util.find_spec("expecttest") is not None


def _gpu_check(tmp_path, *args: str) -> dict:
    """benchmarks/gpu_check.py's ``main`` with these arguments, in this process (its driver: the planner's rows, the
    JSON), each cell's measured side still in a process of its own (``measured_apart``); the script as a fresh
    process is run by test_the_gpu_check_skips_without_a_gpu_and_says_why. In this process it spares an interpreter's
    imports (33.2 s -> 28.6 s, loaded host)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.skipif(not TT, reason="expecttest is not installed (PyTorch's test Transformer imports it)")
def test_one_rank_of_n_with_real_tensors_meets_the_peak_model_on_cpu(tmp_path):
    """The check's driver on the CPU: rank 0 of N=3 of PyTorch's test Transformer (FSDP2, FSDP1 with post
    prefetch), played with real tensors under the fake process group (zeroexp.rank.dryrun.play_rank0), each cell in
    a process of its own; the JSON has the planner's row beside the memory probe's measurement, and the cell's own
    check of every phase PASSes."""
    model = ["--model", "custom", *(f"--set={o}" for o in TORCH_TRANSFORMER), "--batch-size", "2", "--steps", "8"]
    result = _gpu_check(tmp_path, *model, "--world-sizes", "3", "--strategies", "fsdp2_full,fsdp_full:post")
    assert result["device"] == "cpu" and result["gpu"] is None and "fake" in result["backend"]
    cells = result["cells"]
    assert [(c["strategy"], c["world_size"]) for c in cells] == [("fsdp2_full", 3), ("fsdp_full", 3)]
    for c in cells:
        m, p = c["measured"], c["planned"]
        assert "error" not in m, m
        assert m["check"] == "PASS", (c["strategy"], c["world_size"], m["reasons"])
        assert m["memory"]["source"].startswith("torch.distributed._tools.MemTracker")
        # the planner's row and the cell's check predict the same phases (CPU semantics less gloo: the fake group)
        for ph in ("forward", "backward", "optimizer"):
            assert m["phases"][ph]["predicted_bytes"] <= m["phases"][ph]["measured_bytes"]
        assert p["device_semantics"] == "cpu" and p["peak_bytes"] >= p["steady_bytes"] > 0


def test_the_gpu_check_skips_without_a_gpu_and_says_why():
    import subprocess

    if GPUS:
        pytest.skip("a GPU is here: benchmarks/gpu_check.sh runs the check instead of skipping")
    import sys

    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, env={"PATH": __import__("os").environ["PATH"], "PYTHON": sys.executable})
    assert done.returncode == 0 and done.stdout.startswith("SKIP: no CUDA device here"), (done.stdout, done.stderr)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", "/nonexistent/x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("SKIP: no CUDA device here")


def test_no_fsdp_row_is_planned_or_searched_at_one_rank():
    """The rows' own minimum (StateLayout.min_world_size): the planner notes why, the recommender never offers a
    command the strategy refuses."""
    from zeroexp.formulas.rows import LAYOUTS
    from zeroexp.formulas.peak.checkpointing import NONE
    from zeroexp.recommend.space import Axes, configurations

    from test_plan_fits import _run

    fsdp = {name for name, row in LAYOUTS.items() if row.family.gathers_units}
    # and DeepSpeed's stage 3 (tests/test_deepspeed.py: at one rank it gathers nothing, not modelled)
    assert {name for name, row in LAYOUTS.items() if row.min_world_size == 2} == fsdp | {"deepspeed_stage3"}
    records, notes = _run("model=mlp", "world_size=1")
    assert records and not {r["strategy"] for r in records} & fsdp
    assert any("fsdp_full at world_size=1: runs at 2 ranks or more" in n for n in notes), notes
    axes = Axes(tuple(LAYOUTS), ("fp32",), ("none",), (NONE,), 4, None, (25.0,), ("pre",), None)
    one, two = ({c.row for c in configurations(axes, n)} for n in (1, 2))
    assert not one & fsdp and fsdp - {n for n in fsdp if LAYOUTS[n].hybrid} <= two
