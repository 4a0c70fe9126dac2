"""Gradient accumulation under hybrid sharding: fsdp_hybrid (HYBRID_SHARD and
_HYBRID_SHARD_ZERO2) and fsdp2_hybrid at N=4, shard_size=2, grad_accum=2 on the 8 Linear units of the mlp. Measured,
per optimizer step: as FSDP's no_sync, every micro-batch gathers each unit again (twice under FULL_SHARD, and
_HYBRID_SHARD_ZERO2 keeps its units gathered to the step's last micro-batch: once), while the gradients are
reduce-scattered within the shard group and all-reduced across the replicas once per step; with
strategy.sync_each_microbatch both every micro-batch. The model predicts it before any rank starts; the peak model
judges every cell on every rank (FSDP2's HSDP holds each unit's all-reduce buffer to backward's end where it is not the
gradient: a later micro-batch's, and below fp32, where the gradient is its up-cast copy).
"""

from __future__ import annotations

import pytest

from conftest import STEPS, WINDOWS
from zeroexp.cell.resolved import Cell
from zeroexp.config.schemas import validate
from zeroexp.plan.check.expect import Expectation
from zeroexp.plan.check.cell import cell_groups

N, S, K, DEPTH = 4, 2, 2, 8
UNIT = 64 * 64 * 4  # one Linear(64, 64) unit's fp32 bytes (64 rows divide over 2 ranks: no padding)
#: case -> (overrides, all_gathers per step, reduce_scatters = all_reduces per step)
CASES = {
    "fsdp_hybrid": (("strategy=fsdp_hybrid",), DEPTH * 2 * K, DEPTH),
    "fsdp_hybrid_zero2": (("strategy=fsdp_hybrid", "strategy.sharding=_HYBRID_SHARD_ZERO2"), DEPTH, DEPTH),
    "fsdp2_hybrid": (("strategy=fsdp2_hybrid",), DEPTH * 2 * K, DEPTH),
    "fsdp_hybrid_each": (("strategy=fsdp_hybrid", "strategy.sync_each_microbatch=true"), DEPTH * 2 * K, DEPTH * K),
    "fsdp2_hybrid_each": (("strategy=fsdp2_hybrid", "strategy.sync_each_microbatch=true"), DEPTH * 2 * K, DEPTH * K),
}


def _overrides(case: str) -> tuple[str, ...]:
    return (*CASES[case][0], f"world_size={N}", f"strategy.shard_size={S}", f"grad_accum={K}")


def _fingerprint(case: str) -> dict[str, dict]:
    _, gathers, reduces = CASES[case]

    def op(count: int, each: int, dim: str, size: int) -> dict:
        return {"count": count, "payload_bytes": count * each,
                "groups": {dim: {"size": size, "count": count, "payload_bytes": count * each}}}

    return {"all_gather": op(gathers, UNIT, "shard", S), "reduce_scatter": op(reduces, UNIT, "shard", S),
            "all_reduce": op(reduces, UNIT // S, "replicate", N // S)}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_accumulation_modelled_before_measured(compose, case):
    cfg = compose(*_overrides(case))
    validate(cfg)
    expect = Expectation(Cell.of(cfg), lambda model, optimizer: cell_groups(Cell.of(cfg)))
    assert expect.collectives(None, None) == _fingerprint(case)


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_accumulation_measured_per_optimizer_step(cell, case):
    r = cell(*_overrides(case))
    assert r.status == "ok", r.error
    s = r.summary
    assert all(s[k]["check"] == "PASS" for k in ("state", "collectives", "equivalence", "plan")), s["collectives"]
    memory = s["plan"]["memory"]  # under no_sync or reducing every micro-batch: judged
    assert [r["check"] for r in memory["ranks"]] == ["PASS"] * N, memory.get("reasons")
    c = s["collectives"]
    assert {op: {"count": c["counts"][op], "payload_bytes": c["payload_bytes"][op], "groups": c["groups"][op]}
            for op in c["counts"]} == _fingerprint(case)


LLAMA = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")


def test_fsdp2_hsdp_below_fp32_holds_each_units_all_reduce_buffer_to_backwards_end(cell):
    """A shrunk Llama under fsdp2_hybrid in bf16, reducing every micro-batch of 2: each unit's bf16 reduce-scatter
    output, all-reduced over the replicas, stays in FSDPParamGroup._all_reduce_state beside its fp32 up-cast gradient
    (and, in the later micro-batch, beside the held gradient it was added into) until finalize_backward. Measured on
    every rank: each phase 4 bytes above the prediction."""
    r = cell(*LLAMA, "strategy=fsdp2_hybrid", f"world_size={N}", f"strategy.shard_size={S}", f"grad_accum={K}",
             "strategy.sync_each_microbatch=true", "precision=bf16", base=("logger=none", f"steps={STEPS}", *WINDOWS))
    assert r.status == "ok", r.error
    memory = r.summary["plan"]["memory"]
    assert [x["check"] for x in memory["ranks"]] == ["PASS"] * N, memory.get("reasons")
    for x in memory["ranks"]:
        for phase in ("forward", "backward", "optimizer"):
            # exact but for a scalar, or above by one tensor gloo freed late (the judge's allowance, named)
            assert 0 <= x[phase]["measured_bytes"] - x[phase]["predicted_bytes"] <= 8 or x[phase].get("late_free"), \
                (x["rank"], phase, x[phase])
