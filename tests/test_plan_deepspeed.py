"""The planner's DeepSpeed rows (``deepspeed_stage0..3``) against DeepSpeed 0.19 as it runs: ``strategy=deepspeed``
cells are planned with the row of their stage, and their ``summary.json["plan"]`` matches the state probe's
``rank_state.csv`` to the byte, every kind on every rank; then, without running anything, the rows' per-rank bytes
for a large model follow the closed forms of DeepSpeed's partitioning.

The cells are the ones tests/test_deepspeed.py runs (the ``cell`` fixture runs each once per session), plus one
bf16 cell."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import read_csv
from zeroexp.formulas import (LAYOUTS, ModelShape, PlanKnobs, derive_groups, rank_state_bytes, state_factors,
                              step_collectives)


def _state(name, shape, n, itemsize, offload="none"):
    """rank_state_bytes of row ``name`` over the groups it derives from ``shape`` (default knobs)."""
    layout = LAYOUTS[name]
    return rank_state_bytes(layout, derive_groups(name, layout, shape, n, itemsize), itemsize, offload=offload)
from zeroexp.models import LinearStack
from zeroexp.plan import Precision, plan
from zeroexp.plan.shape import shape_of
from zeroexp.strategies import deepspeed as ds_adapter

pytestmark = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

N2 = ("strategy=deepspeed", "world_size=2")  # as tests/test_deepspeed.py: the same cells, run once


def _mlp(depth: int = 8, width: int = 64):
    """The cells' model (a stack of bias-free Linear(width, width)) as the planner reads it, on the meta device."""
    with torch.device("meta"):
        return shape_of(LinearStack(width, depth), [nn.Linear])


def _planned_exactly(r, stage: int, itemsize: int, offload: str = "none", depth: int = 8):
    """The cell's plan is PASS with no difference, and rank_state.csv equals rank_state_bytes on every rank and kind
    (optim_scalar too), computed here apart from plan_section. Returns the plan section and the table."""
    assert r.status == "ok", r.error
    section, frame = r.summary["plan"], read_csv(r, "rank_state.csv")
    assert section["row"] == f"deepspeed_stage{stage}" and section["layout"] == f"DeepSpeed 0.19 stage {stage}"
    assert section["check"] == "PASS", section["reasons"]
    assert set(section["difference_bytes"].values()) == {0} and section["predicted_bytes"] == section["measured_bytes"]
    state = _state(f"deepspeed_stage{stage}", _mlp(depth), 2, itemsize, offload)
    for kind, per_rank in state.items():
        rows = frame[frame.kind == kind].sort_values("rank")
        assert list(zip(rows.logical_bytes, rows.physical_bytes)) == per_rank, kind
    assert set(frame.kind) - set(state) <= {"param_unsharded"}
    assert (frame[frame.kind == "param_unsharded"].physical_bytes == 0).all()
    assert len(section["ranks"]) == 2 * len(state)
    return section, frame


def _per_rank(frame, kind):
    rows = frame[frame.kind == kind].sort_values("rank")
    return list(zip(rows.logical_bytes, rows.physical_bytes))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_cells_are_planned_to_the_byte(cell, stage):
    section, frame = _planned_exactly(cell(*N2, f"strategy.stage={stage}"), stage, 4)
    assert section["payload_check"] == "PASS", section["payload"]
    assert section["payload_reasons"] == []
    p = 4 * 8 * 64 * 64  # fp32 bytes of 8 x Linear(64, 64): 32768 elements, a multiple of 2N, no padding
    want = {0: {"param": p, "grad": p, "optim": 2 * p},
            1: {"param": p, "grad": p // 2, "optim": p, "master": p // 2},  # stage 1 too: the gradient partition
            2: {"param": p, "grad": p // 2, "optim": p, "master": p // 2},
            3: {"param": p // 2, "grad": p // 2, "optim": p, "master": p // 2}}[stage]
    for kind, nbytes in want.items():
        assert _per_rank(frame, kind) == [(nbytes, nbytes)] * 2, kind
    assert set(frame.kind) - {"optim_scalar", "param_unsharded"} == set(want)  # fp32 stage 0: no master
    steps = 8 if stage == 0 else 1  # Adam's step: per parameter (stage 0) or per flat fp32 partition
    assert _per_rank(frame, "optim_scalar") == [(4 * steps, 4 * steps)] * 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_cut_by_the_partition_boundary(cell, stage):
    # 5 x Linear(64, 64) over 2 ranks: each partition ends half-way through the third Linear. ZeRO-1/2 keep that
    # parameter's full gradient on both ranks (the partition is views of it); ZeRO-3 partitions every parameter.
    # Reduce buckets of one Linear each (tests/test_deepspeed.py): the payload is planned over them.
    r = cell(*N2, f"strategy.stage={stage}", "model.depth=5", "strategy.bucket_cap_mb=0.03")
    section, frame = _planned_exactly(r, stage, 4, depth=5)
    assert section["payload_check"] == "PASS", section["payload"]
    half, linear = 4 * 5 * 4096 // 2, 4 * 4096
    grads = _per_rank(frame, "grad")
    if stage == 3:
        assert grads == [(half, half)] * 2
    else:
        assert grads == [(half, 3 * linear)] * 2 and 3 * linear > half


def test_a_bf16_cell_is_planned_to_the_byte(cell):
    # bf16 compute, fp32 master and moments; stage 1 with the straddling Linear: bf16 gradient views, and the
    # bf16 overflow flag and fp32 norm all_reduces in the payload.
    r = cell(*N2, "strategy.stage=1", "precision=bf16", "model.depth=5")
    section, frame = _planned_exactly(r, 1, 2, depth=5)
    assert section["payload_check"] == "PASS", section["payload"]
    psi = 5 * 4096
    assert _per_rank(frame, "param") == [(2 * psi, 2 * psi)] * 2
    assert _per_rank(frame, "grad") == [(psi, 2 * 3 * 4096)] * 2  # 2 bytes x psi/2 logical, 3 whole Linears
    assert _per_rank(frame, "master") == [(2 * psi, 2 * psi)] * 2  # fp32, psi/2 each
    assert {p["op"]: p["measured_bytes"] for p in section["payload"]} == {"all_reduce": 2 * psi + 4 + 1,
                                                                          "all_gather": 2 * psi}


def test_an_offloaded_bf16_cell_plans_its_state_groups_and_payload(cell):
    """The optimizer offloaded: the same buckets, partitions and collectives as offload none (the reduced partition
    copied to the host, the updated one back), the gradient norm an fp32 scalar."""
    r = cell(*N2, "strategy.stage=2", "precision=bf16", "offload=optimizer")  # as tests/test_deepspeed.py
    section, frame = _planned_exactly(r, 2, 2, offload="optimizer")
    psi = 8 * 4096
    assert _per_rank(frame, "grad") == [(4 * psi // 2, 4 * psi // 2)] * 2  # the fp32 partition on the host
    assert section["payload_check"] == "PASS" and not section["payload_reasons"], section["payload_reasons"]
    assert {p["op"]: p["measured_bytes"] for p in section["payload"]} == {"all_reduce": 2 * psi + 4 + 1,
                                                                          "all_gather": 2 * psi}
    assert section["groups"]["check"] == section["calls"]["check"] == r.summary["collectives"]["check"] == "PASS"
    memory = section["memory"]  # and its peak: every phase of every rank
    assert memory["check"] == "PASS" and [x["check"] for x in memory["ranks"]] == ["PASS"] * 2, memory["reasons"]


def test_an_offloaded_stage1_cell_of_several_buckets_meets_its_peak_model_on_every_rank(cell):
    """Stage 1 at N=3 (uneven partitions: a parameter cut by two of them), 0.05 MiB buckets: each bucket's partition
    parameters copied to float64 for their norms, kept to the step, AdamW on the host's fp32 partition."""
    r = cell("strategy=deepspeed", "world_size=3", "strategy.stage=1", "offload=optimizer",
             "strategy.bucket_cap_mb=0.05")
    assert r.status == "ok", r.error
    memory = r.summary["plan"]["memory"]
    assert memory["check"] == "PASS" and [x["check"] for x in memory["ranks"]] == ["PASS"] * 3, memory["reasons"]
    opt = [x["optimizer"] for x in memory["ranks"]]
    # rank 1's partition overlaps one parameter more than the others: one more float64 norm kept into the step
    assert [o["predicted_bytes"] - opt[0]["predicted_bytes"] for o in opt] == [0, 8, 0]
    assert all(0 <= o["measured_bytes"] - o["predicted_bytes"] <= 16 or o.get("late_free") for o in opt), opt


def test_an_offloaded_stage3_cell_meets_its_peak_model_on_every_rank(cell):
    """Stage 3 at N=3, the optimizer offloaded, 0.01 MiB buckets (4096-element weights, 4096 % 3 = 1), two
    micro-batches: in the last one's backward, after each bucket's reduce-scatter, each of the rank's partitions is
    copied to float64 for its norm, kept to the step; the last rank's partition of a weight holds 1,364 real elements
    where the others hold 1,366, so its copy is 16 B smaller; the step: AdamW on the host's fp32 partition beside
    the 8 kept norms."""
    r = cell("strategy=deepspeed", "world_size=3", "strategy.stage=3", "offload=optimizer", "precision=bf16",
             "strategy.bucket_cap_mb=0.01", "grad_accum=2")
    assert r.status == "ok", r.error
    memory = r.summary["plan"]["memory"]
    assert memory["check"] == "PASS" and [x["check"] for x in memory["ranks"]] == ["PASS"] * 3, memory["reasons"]
    backward = [x["backward"]["predicted_bytes"] for x in memory["ranks"]]
    assert [b - backward[0] for b in backward] == [0, 0, -16]
    for phase in ("backward", "optimizer"):  # exact but for a scalar, or a tensor gloo freed late (named)
        assert all(0 <= x[phase]["measured_bytes"] - x[phase]["predicted_bytes"] <= 16 or x[phase].get("late_free")
                   for x in memory["ranks"]), [x[phase] for x in memory["ranks"]]


def test_ds3_offload_norms_follow_the_ranks_real_elements():
    """A bucket of a 5- and a 2-element gradient (backward order) at N=3: partitioned in parameter order (2, then
    5), chunks of 1 and 2 elements; rank 2 holds no element of the 2 (skipped) and 1 real element of the 5."""
    from zeroexp.formulas.peak.ds_partition import ds3_offload_norms

    assert ds3_offload_norms(((5, 2),), 3, 0) == ([0, 16], [32])  # (1 norm before + 2 elements + its norm) x 8
    assert ds3_offload_norms(((5, 2),), 3, 2) == ([0, 8], [16])
    assert ds3_offload_norms(((5, 2), (4,)), 3, 1) == ([0, 16, 24], [32, 24])


def test_offloaded_stages_on_a_gpu_keep_the_optimizers_update_on_the_host():
    """The planner on CUDA: the device's steady state without the host's kinds (the fp32 gradient partition, master,
    moments), and its step holds the kept norms alone (AdamW runs on the host); on the CPU the update is the
    device's."""
    from test_plan_fits import _run

    args = ("model=mlp", "model.width=64", "world_size=3", "batch_size=8", "offload=optimizer",
            "strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]")
    (gpu, _), (cpu, _) = _run(*args, "device=cuda"), _run(*args, "device=cpu")
    rows = ["deepspeed_stage1", "deepspeed_stage2", "deepspeed_stage3"]
    assert [r["strategy"] for r in gpu] == [r["strategy"] for r in cpu] == rows
    for g, c in zip(gpu, cpu):
        assert "peak_note" not in g and "peak_note" not in c and g["peak_bytes"] and c["peak_bytes"]
        ipg = 25 * 2**20 if g["strategy"] == "deepspeed_stage3" else 0  # stage 3's reduce bucket, kept between steps
        assert g["steady_bytes"] == g["device_bytes"] + g["workspace_bytes"] + ipg  # nothing of the host's
        # the kept float64 norms: of 3 or 4 partition parameters (stages 1-2), of every one of the 8 (stage 3)
        assert g["phase_bytes"]["optimizer"] in ((24, 32) if g["strategy"] != "deepspeed_stage3" else (64,))
        assert c["phase_bytes"]["optimizer"] > 2 * 4 * (8 * 4096 // 3)  # AdamW's two fp32 temporaries on the host


def test_stage3_with_its_optimizer_offloaded_all_reduces_an_fp32_norm(cell):
    """Stage 3 at N=3 (padded partitions), parameters and optimizer offloaded: planned and measured alike, the norm
    4 bytes where stage 3 alone all-reduces a float64 one."""
    r = cell("strategy=deepspeed", "world_size=3", "strategy.stage=3", "offload=full", "precision=bf16")
    assert r.status == "ok", r.error
    section = r.summary["plan"]
    assert section["check"] == "PASS", section["reasons"]
    assert section["payload_check"] == "PASS" and not section["payload_reasons"], section["payload_reasons"]
    assert {p["op"]: (p["predicted_bytes"], p["measured_bytes"]) for p in section["payload"]}["all_reduce"] == (4, 4)
    assert section["groups"]["check"] == section["calls"]["check"] == r.summary["collectives"]["check"] == "PASS"


# --- planner only: a large model, nothing run ---------------------------------------------------------------
def _held(numels: list[int], padded: int, n: int) -> list[int]:
    """Per rank, by brute force: the full numel of every parameter overlapping the rank's partition of the flat
    group, plus the partition's padding."""
    shard, bounds, start = padded // n, [], 0
    for k in numels:
        bounds.append((start, start + k))
        start += k
    return [sum(b - a for a, b in bounds if a < (r + 1) * shard and b > r * shard)
            + max(0, (r + 1) * shard - max(r * shard, start)) for r in range(n)]


@pytest.mark.parametrize("n", [3, 8, 64])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_rows_follow_deepspeeds_partitioning_for_a_large_model(n, precision, offload):
    shape = _mlp(7, 4099)  # 117.6M parameters, 7 x 16.8M: odd, padding everywhere
    numels, psi = list(shape.numels), shape.numel
    c = {"fp32": 4, "bf16": 2}[precision]
    for stage in range(4):
        if stage == 0 and offload != "none":
            continue
        state = _state(f"deepspeed_stage{stage}", shape, n, c, offload)
        if stage == 0:
            want = {"param": [(c * psi,) * 2] * n, "grad": [(c * psi,) * 2] * n, "optim": [(8 * psi,) * 2] * n,
                    "optim_scalar": [(4 * 7,) * 2] * n}
            if c != 4:
                want["master"] = [(4 * psi,) * 2] * n  # the FP16 optimizer's fp32 copy, full on every rank
        elif stage in (1, 2):
            padded = math.ceil(psi / (2 * n)) * 2 * n  # bit16_groups_flat, aligned to 2N
            shard = padded // n
            real = [min(shard, max(0, psi - r * shard)) for r in range(n)]  # the padding is the last ranks'
            grad = ([(4 * k, 4 * shard) for k in real] if offload != "none"
                    else [(c * k, c * h) for k, h in zip(real, _held(numels, padded, n))])
            want = {"param": [(c * psi, c * padded)] * n, "grad": grad, "optim": [(8 * k, 8 * shard) for k in real],
                    "master": [(4 * k, 4 * shard) for k in real], "optim_scalar": [(4, 4)] * n}
        else:
            shard = sum(math.ceil(k / n) for k in numels)  # each parameter padded to N on its own
            real = [sum(min(math.ceil(k / n), max(0, k - r * math.ceil(k / n))) for k in numels) for r in range(n)]
            per = c + (4 if offload != "none" else 0)  # offload: the fp32 gradient partition beside the bf16 one
            want = {"param": [(c * k, c * shard) for k in real], "grad": [(per * k, per * shard) for k in real],
                    "optim": [(8 * k, 8 * shard) for k in real], "master": [(4 * k, 4 * shard) for k in real],
                    "optim_scalar": [(4, 4)] * n}
        assert state == want, stage
        # The state probe's aggregate factors (zeroexp.formulas.state_factors of the row) from the logical bytes:
        # padding is not logical, so they hold exactly.
        factors = state_factors(LAYOUTS[f"deepspeed_stage{stage}"], n, c, offload)
        for kind, f in factors.items():
            logical = sum(lo for lo, _ in state[kind]) / (4 * psi)
            assert logical == pytest.approx(f, abs=1e-12), (stage, kind)


def test_the_planner_plans_the_deepspeed_rows():
    # 7.3M parameters, each Linear under the 25 MiB reduce bucket, the model under one stage-3 prefetch bucket
    shape = _mlp(7, 1023)
    records, notes = plan(shape, [8], Precision("bf16", "bfloat16"),
                          strategies=[f"deepspeed_stage{s}" for s in range(4)])
    by = {r["strategy"]: r for r in records}
    assert not notes and all("DeepSpeed 0.19, measured" in r["source"] for r in records)
    assert by["deepspeed_stage1"]["total_bytes"] == by["deepspeed_stage2"]["total_bytes"]
    assert (by["deepspeed_stage3"]["total_bytes"] < by["deepspeed_stage2"]["total_bytes"]
            < by["deepspeed_stage0"]["total_bytes"])
    # the payload: stage 1/2 gradients all-reduced (P) plus the fp32 norm and the bf16 overflow flag, the padded
    # flat group all-gathered; stage 3 each parameter padded to N, reduce-scattered and gathered once, fp64 norm
    psi, padded = shape.numel, math.ceil(shape.numel / 16) * 16
    p3 = sum(math.ceil(k / 8) * 8 for k in shape.numels)
    assert by["deepspeed_stage2"]["payload_bytes"] == {"all_reduce": 2 * psi + 4 + 1, "all_gather": 2 * padded}
    assert by["deepspeed_stage3"]["payload_bytes"] == {"reduce_scatter": 2 * p3, "all_reduce": 8, "all_gather": 2 * p3}
    assert by["deepspeed_stage0"]["payload_bytes"] == {"all_reduce": 2 * psi}
    # a count has no parameter boundaries: ZeRO-1/2 gradients are the partition alone
    count = _state("deepspeed_stage1", ModelShape.from_count(7_500_000_000), 64, 2)
    assert count["grad"] == [(2 * 7_500_000_000 // 64,) * 2] * 64
    groups = derive_groups("deepspeed_stage0", LAYOUTS["deepspeed_stage0"], shape, 8, 2, PlanKnobs())
    assert step_collectives(LAYOUTS["deepspeed_stage0"], groups, 2)["all_reduce"]["payload_bytes"] == 2 * psi
    # its time: every chunk all-reduced after backward (no gradient hook), the fallback's three passes over the
    # gradients (flatten, scale, copy back)
    from zeroexp.formulas.time.framework import FrameworkCost
    from zeroexp.formulas.time.overlap import collective_slots

    slots, rule = collective_slots(LAYOUTS["deepspeed_stage0"], groups, "pre", 1.0, 2.0, 0.5)
    assert slots and all(s.op == "all_reduce" and s.issue_s == s.need_s == 3.0 for s in slots)
    assert sum(s.weight for s in slots) == psi and "after backward" in rule
    terms, notes = {}, []
    f, b, o = LAYOUTS["deepspeed_stage0"].family.framework_terms(
        LAYOUTS["deepspeed_stage0"], groups, 2, FrameworkCost(copy_s_per_byte=1e-9), False, terms, notes)
    assert (f, o) == (0.0, 0.0) and b == terms["deepspeed_fallback_copies"] == pytest.approx(3 * 2 * psi * 1e-9)
    assert any("stage-0 engine" in n for n in notes)


def test_a_parameter_forward_never_uses_is_planned_as_deepspeed_holds_it(compose):
    """tests/corpus.py ``unused_branch`` (bias-free Linear a, unused, b; 8 x 8 = 64 elements each), read by hand
    from DeepSpeed 0.19's source: stage 0 all-reduces a zero gradient for ``unused`` (engine.py
    ``_get_gradients_for_reduction``); stages 1-3 reduce only a's and b's (no hook fires for it) and stage 3 fetches
    only theirs (``unused``'s module is never called). Stages 1-2 give it a zeros tensor of its size where it
    overlaps a rank's partition (``get_all_grad_tensors``), beside ``grads_in_partition`` (every overlapped
    parameter), made only where a parameter with a gradient is reduced."""
    from omegaconf import OmegaConf

    from zeroexp.plan.shape import model_shape

    cfg = compose("model=custom", "model._target_=corpus.unused_branch", "model.input_shape=[8]", base=())
    shape = model_shape(OmegaConf.to_container(cfg.model, resolve=True))
    assert (shape.unused, shape.uncalled) == ((1,), (1,))
    k = 64
    for n, held in ((2, [3 * k, 3 * k]), (3, [k, k, k])):  # N=2: a + unused | unused + b, each grads_in_partition
        # of both and unused's zeros; N=3: a | unused (its zeros alone: no grads_in_partition) | b
        for stage in range(4):
            name = f"deepspeed_stage{stage}"
            g = derive_groups(name, LAYOUTS[name], shape, n, 4)
            assert g.buckets == (((k,) * 3,) if stage == 0 else ((k, k),))
            assert g.ungraded == (() if stage == 0 else (1,))
            assert g.gathers == (((k, k),) if stage == 3 else ())
            grad = rank_state_bytes(LAYOUTS[name], g, 4)["grad"]
            if stage in (1, 2):
                assert grad == [(4 * 3 * k // n, 4 * h) for h in held]
            payload = step_collectives(LAYOUTS[name], g, 4)
            if stage in (1, 2):  # the bucket of a's and b's gradients and the fp32 norm; the whole flat group gathered
                assert payload == {"all_reduce": {"count": 2, "payload_bytes": 4 * 2 * k + 4},
                                   "all_gather": {"count": 1, "payload_bytes": 4 * 3 * k}}
            if stage == 3:  # each of a and b padded to N, reduce-scattered and gathered once; the fp64 norm
                padded = 4 * 2 * math.ceil(k / n) * n
                assert payload == {"reduce_scatter": {"count": 1, "payload_bytes": padded},
                                   "all_reduce": {"count": 1, "payload_bytes": 8},
                                   "all_gather": {"count": 1, "payload_bytes": padded}}
