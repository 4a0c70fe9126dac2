"""benchmarks/gpu_llama.py's CPU side: its cell and plan compose as the runner's and the planner's, and its pairing
names every figure by the field it came from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_llama  # noqa: E402


def test_the_cell_and_its_plan_compose():
    from gpu_check import _compose as compose_as

    from test_plan_fits import _compose

    command = gpu_llama.cell_command("selective_op", "/tmp/x", 14)
    cell = compose_as("config", [a for a in command[3:] if not a.startswith("hydra.")])
    assert (cell.model.name, cell.world_size, cell.precision.name, cell.device) == ("llama_1b", 1, "bf16", "cuda")
    plan = _compose(*gpu_llama.plan_overrides("full", "h200_ib"))
    assert plan.network.name == "h200_ib" and plan.activation_checkpointing.name == "full"
    assert "device=cuda" in gpu_llama.plan_overrides("full", None)


def test_measured_and_planned_are_paired_by_their_fields():
    summary = {"memory": {"peak_bytes_max": 20 * 2**30, "reserved_of_max_rank": {"phases": {"forward": 21 * 2**30,
                                                                                         "backward": 22 * 2**30}},
                          "device_by_rank": [{"nvml_used_bytes": 24 * 2**30}]},
               "timing": {"median_ms": 200.0, "phase_ms": {"forward": 60.0}}, "plan": {"memory": {"check": "PASS"}}}
    record = {"peak_bytes": 19 * 2**30, "reserved_peak_bytes": 22 * 2**30, "device_total_bytes": 23 * 2**30,
              "step_ms": 150.0, "recompute_ms": 20.0, "network_source": "preset"}
    got = gpu_llama.pair(summary, record)
    assert got["planned_over_measured"] == pytest.approx({"peak": 19 / 20, "reserved": 1.0, "device": 23 / 24,
                                                          "step": 0.75})
    assert got["plan_memory_check"] == "PASS"
    assert got["measured"]["phase_ms (timing.phase_ms)"] == {"forward": 60.0}
    assert gpu_llama.pair({}, record)["planned_over_measured"] == {}
