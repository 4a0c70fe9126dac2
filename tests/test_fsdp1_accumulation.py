"""FSDP1's ``grad_accum`` under ``no_sync`` in the peak model (zeroexp.formulas.peak.accumulation
``fsdp1_no_sync_phase_peaks``): FULL_SHARD, which gathers every micro-batch as without accumulation while each unit
keeps its unsharded gradient, and both shardings below fp32 and checkpointed, judged PASS on every rank; the
planner's LLM-scale rows given a peak."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import STEPS, WINDOWS, held_checks
from test_checkpointing_modes import LLAMA
from test_recommend import _compose

HF = importlib.util.find_spec("transformers") is not None

#: FULL_SHARD in fp32: tests/test_hybrid_accum.py's HYBRID_SHARD cell (FULL_SHARD within its shard group);
#: SHARD_GRAD_OP in bf16: tests/test_peak.py's
CELLS = [pytest.param((*LLAMA, "strategy=fsdp_full", "grad_accum=2", "precision=bf16",
                       "activation_checkpointing=selective_op", "world_size=2"), id="llama-full-k2-bf16-sac-n2",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed"))]


@pytest.mark.parametrize("overrides", CELLS)
def test_an_fsdp1_cell_under_no_sync_is_judged_and_holds(cell, overrides):
    r = cell(*overrides, base=("logger=none", f"steps={STEPS}", *WINDOWS))
    held_checks(r)
    memory = r.summary["plan"]["memory"]
    assert memory["check"] == "PASS" and memory["reason_codes"] == []
    assert [rank["check"] for rank in memory["ranks"]] == ["PASS"] * len(memory["ranks"])


@pytest.mark.skipif(not HF, reason="transformers is not installed")
def test_the_planner_gives_llama3_8b_a_peak_under_no_sync():
    """Llama 3 8B at 8 ranks, seq_len 8192, bf16, checkpointed, four micro-batches: both FSDP1 rows get a peak, and
    each later micro-batch holds every unit's unsharded bf16 gradient (the steady fp32 shard freed) beyond one
    micro-batch's."""
    from zeroexp.cell.memo import invocation_memo
    from zeroexp.cli.plan import run

    base = ("model=llama3_8b", "model.seq_len=8192", "world_size=8", "batch_size=1", "precision=bf16",
            "activation_checkpointing=full", "device_memory=96GB", "network=h100_ib",
            "strategies=[fsdp_full,fsdp_grad_op]")
    with invocation_memo():  # one trace for both rows and both K, as the CLI's invocation
        rows = {k: {r["strategy"]: r for r in run(_compose("plan", *base, f"grad_accum={k}"))[0]} for k in (1, 4)}
    for name in ("fsdp_full", "fsdp_grad_op"):
        four, one = rows[4][name], rows[1][name]
        assert four["peak_bytes"] and not four.get("peak_note"), four.get("peak_note")
        # forward of a later micro-batch: every unsharded bf16 gradient (8 ranks' fp32 shards at half the bytes)
        # held, the rank's steady fp32 shard freed
        shard = one["grad_bytes"]
        assert four["phase_bytes"]["forward"] - one["phase_bytes"]["forward"] == 8 * shard // 2 - shard, name
        assert four["phase_bytes"]["backward"] > one["phase_bytes"]["backward"], name


def test_fsdp1_accumulation_with_frozen_parameters_is_refused_by_name():
    """A LoRA model's FSDP1 accumulation is not modelled (measured: the held gradient spans the FlatParameter's frozen
    views, a later micro-batch's forward holds more than the traced step): n/a with the reason, in either
    accumulation mode; every parameter training, modelled; FSDP2's rows do not take FSDP1's reason."""
    from zeroexp.plan.check.memory import uncovered

    for name in ("fsdp_grad_op", "fsdp_full", "fsdp_HYBRID_SHARD"):
        for each in (False, True):
            why = uncovered(name, "fp32", "none", micro_batches=2, sync_each_microbatch=each, frozen=True)
            assert any("FSDP1's accumulation with frozen parameters" in w for w in why), (name, each, why)
            assert not uncovered(name, "fp32", "none", micro_batches=2, sync_each_microbatch=each), (name, each)
        assert not uncovered(name, "fp32", "none", micro_batches=1, frozen=True), name
    assert not any("FSDP1's" in w for w in uncovered("fsdp2_full", "fp32", "none", micro_batches=2, frozen=True))
