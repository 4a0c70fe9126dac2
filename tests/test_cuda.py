"""CUDA / NCCL cells: skipped without a GPU, with the reason. On one GPU every strategy runs at
world_size=1 (one GPU cannot hold two NCCL ranks); with two or more, NCCL cells at N=2, FSDP CPUOffload and DeepSpeed
fp16 (which need a GPU) too. Run them with ``benchmarks/gpu_check.sh`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device here: CUDA/NCCL cells need one GPU per rank")

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


@pytest.mark.parametrize("overrides", STRATEGIES, ids=lambda o: o[0].split("=")[1])
def test_every_strategy_runs_on_one_gpu(cell, overrides):
    _checks_pass(cell(*overrides, "world_size=1", "device=cuda"))


@pytest.mark.skipif(GPUS < 2, reason="NCCL cells at N=2 need two GPUs")
@pytest.mark.parametrize("overrides", STRATEGIES, ids=lambda o: o[0].split("=")[1])
def test_nccl_cells_at_two_ranks(cell, overrides):
    r = cell(*overrides, "world_size=2", "device=cuda")
    _checks_pass(r)
    assert r.summary["collectives"]["check"] == "PASS", r.summary["collectives"]["reasons"]
    assert r.summary["plan"]["check"] == "PASS", r.summary["plan"]["reasons"]


@pytest.mark.skipif(GPUS < 2, reason="FSDP CPUOffload at N=2 needs two GPUs")
def test_fsdp_cpu_offload(cell):
    r = cell("strategy=fsdp_full", "world_size=2", "device=cuda", "offload=full")
    _checks_pass(r)
    assert r.summary["state"]["placement"]["param"]["host_bytes"] > 0


@pytest.mark.skipif(GPUS < 2, reason="FSDP2 CPUOffloadPolicy at N=2 needs two GPUs")
def test_fsdp2_cpu_offload_policy(cell):
    r = cell("strategy=fsdp2_full", "world_size=2", "device=cuda", "offload=full")
    _checks_pass(r)
    assert r.summary["state"]["placement"]["param"]["host_bytes"] > 0


@pytest.mark.skipif(GPUS < 2, reason="DeepSpeed fp16 at N=2 needs two GPUs")
def test_deepspeed_fp16(cell):
    if not _deepspeed():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    _checks_pass(cell("strategy=deepspeed", "strategy.stage=2", "world_size=2", "device=cuda", "precision=fp16"))
