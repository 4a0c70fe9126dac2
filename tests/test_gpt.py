"""model=gpt: a block-wrapped transformer on token ids; Hugging Face GPT-2 through _target_ when installed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import STEPS, WINDOWS, read_csv

BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)
LADDER = [("strategy=ddp",), ("strategy=zro",), ("strategy=fsdp_grad_op",), ("strategy=fsdp_full", "prefetch=post")]
EXPECTED = {"ddp": (2, 2, 4), "zro": (2, 2, 2), "fsdp_grad_op": (1, 1, 2), "fsdp_full": (1, 1, 2)}


def _unique_param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())  # parameters() yields a tied weight once


def test_gpt_ladder_matches_ddp_and_the_formulas(cell, compose):
    from zeroexp.models import build_model

    n_layer = compose("model=gpt", base=BASE).model.n_layer
    P = _unique_param_bytes(build_model(compose("model=gpt", base=BASE).model))
    runs = {o[0].split("=")[1]: cell("model=gpt", *o, "world_size=2", base=BASE) for o in LADDER}
    ref = read_csv(runs["ddp"], "iterations.csv").sort_values(["rank", "step"]).reset_index(drop=True)
    assert ref.loss.iloc[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # ~uniform at init
    for name, r in runs.items():
        assert r.status == "ok", (name, r.error)
        it = read_csv(r, "iterations.csv").sort_values(["rank", "step"]).reset_index(drop=True)
        assert ((it.loss - ref.loss).abs() / ref.loss).max() <= 1e-5, name
        state = r.summary["state"]
        assert state["check"] == "PASS", (name, state.get("reasons"))
        assert state["logical_param_bytes"] == P  # the tied embedding/head counted once
        f = state["factors"]
        assert (f["param"], f["grad"], round(f["optim"], 3)) == pytest.approx(EXPECTED[name], abs=1e-3), name
        assert r.summary["equivalence"]["check"] == "PASS", name
    # FSDP units follow the blocks: one per block plus the root (embeddings, final norm, tied head)
    units = n_layer + 1
    full = runs["fsdp_full"].summary["collectives"]["counts"]
    grad_op = runs["fsdp_grad_op"].summary["collectives"]["counts"]
    assert full["reduce_scatter"] == units and grad_op["reduce_scatter"] == units
    assert grad_op["all_gather"] == units
    assert full["all_gather"] == 2 * n_layer + 1  # FSDP1 keeps the root unsharded from forward into backward
    ddp_rank0 = runs["ddp"].summary["state"]["max_rank_bytes"]["param"]
    assert ddp_rank0 == P  # tied weight held once per rank


def test_long_gpt_run_is_judged_against_its_reduction_order_floor(cell):
    # N=3: the division by 3 rounds differently in DDP's averaged gradients than in the reference's mean loss,
    # and AdamW turns those ulps into lr-sized steps; after 30 steps plain DDP was ~5e-5 from the reference on the CPUs
    # seen so far, above the precision's 1e-5. How far is this CPU's kernels': the test holds the probe's rule (the
    # larger of the precision's threshold and ten floors measured at run time), not the value.
    from conftest import assert_threshold_rule

    r = cell("model=gpt", "strategy=ddp", "world_size=3", "steps=30", base=BASE)
    assert r.status == "ok", r.error
    eq = r.summary["equivalence"]
    assert eq["threshold"] == 1e-5 and eq["reduction_floor"] > 0, eq  # N=3 rounds: some floor is measured
    assert_threshold_rule(eq)
    assert eq["check"] == "PASS" and eq["max_abs_err"] <= eq["effective_threshold"], eq


def test_gpt_block_count_moves_the_fingerprint(cell):
    r = cell("model=gpt", "strategy=fsdp_full", "prefetch=post", "world_size=2", "model.n_layer=2", base=BASE)
    assert r.status == "ok", r.error
    assert r.summary["collectives"]["counts"] == {"all_gather": 5, "reduce_scatter": 3}
    assert r.summary["collectives"]["check"] == "PASS"


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install -e '.[hf]')")
def test_hugging_face_gpt2_through_target(cell):
    ddp = cell("model=hf_gpt2", "strategy=ddp", "world_size=2", base=BASE)
    fsdp = cell("model=hf_gpt2", "strategy=fsdp_full", "prefetch=post", "world_size=2", base=BASE)
    for r in (ddp, fsdp):
        assert r.status == "ok", r.error
        assert r.summary["state"]["check"] == "PASS"
    a, b = read_csv(ddp, "iterations.csv"), read_csv(fsdp, "iterations.csv")
    assert ((a.loss - b.loss).abs() / a.loss).max() <= 1e-5
    assert fsdp.summary["collectives"]["counts"]["reduce_scatter"] == 2 + 1  # 2 GPT2Blocks + root
