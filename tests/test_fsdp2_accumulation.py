"""FSDP2's ``grad_accum`` in the peak model, under ``set_requires_gradient_sync(False)`` and reducing every
micro-batch (``strategy.sync_each_microbatch``, torchtitan's): cells of foreign and own models judged (not n/a) and
PASS on every rank, the planner's peak above one micro-batch's by what the later ones hold, and the one case not
modelled (no_sync with a reduce dtype of its own) refused by name."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import STEPS, WINDOWS, held_checks
from test_checkpointing_modes import LLAMA
from test_recommend import _compose

HF = importlib.util.find_spec("transformers") is not None


def test_only_a_reduce_dtype_of_its_own_is_left_out():
    from zeroexp.plan.check.memory import uncovered

    for row in ("fsdp2_full", "fsdp2_grad_op"):
        assert uncovered(row, "bf16", "none", "selective_op", 2, param_dtype="bfloat16") == []
        assert uncovered(row, "fp32", "none", "full", 4) == []
        assert len(uncovered(row, "bf16", "none", "none", 2, reduce_dtype="float32", param_dtype="bfloat16")) == 1
        assert uncovered(row, "bf16", "none", "none", 1, reduce_dtype="float32", param_dtype="bfloat16") == []
        assert uncovered(row, "bf16", "none", "full", 2, sync_each_microbatch=True, reduce_dtype="float32",
                         param_dtype="bfloat16") == []
    assert uncovered("fsdp_full", "fp32", "none", "none", 2, sync_each_microbatch=True) == []
    assert uncovered("fsdp_full", "fp32", "none", "none", 2) == []  # FULL_SHARD's no_sync


def test_the_planned_peak_holds_the_unsharded_gradients_of_the_later_micro_batches():
    from zeroexp.cli.plan import run

    peaks = {}
    for k in (1, 2):
        records, _ = run(_compose("plan", "model=gpt", "world_size=2", "batch_size=2", f"grad_accum={k}",
                                  "strategies=[fsdp2_full]"))
        assert records[0]["peak_bytes"] and not records[0].get("peak_note")
        peaks[k] = records[0]["peak_bytes"]
    # every unit's unsharded gradient is held through the later micro-batches; the steady shard is freed
    assert peaks[2] > peaks[1]


def test_reducing_every_micro_batch_holds_the_shards_not_the_unsharded_gradients():
    """With ``sync_each_microbatch`` the later micro-batches hold every sharded gradient from their start (no
    ``zero_grad`` inside a step): backward above one micro-batch's, by at most the shards, and below ``no_sync``'s,
    which holds every unit's unsharded gradient; four times the reduce-scatters a step."""
    from zeroexp.cli.plan import run

    out = {}
    for k, sync in ((1, False), (2, False), (2, True)):
        (r,), _ = run(_compose("plan", "model=gpt", "world_size=2", "batch_size=2", f"grad_accum={k}",
                               f"sync_each_microbatch={str(sync).lower()}", "strategies=[fsdp2_full]"))
        assert r["peak_bytes"] and not r.get("peak_note")
        out[k, sync] = r
    one, held, each = out[1, False], out[2, False], out[2, True]
    assert one["phase_bytes"]["backward"] < each["phase_bytes"]["backward"] \
        <= one["phase_bytes"]["backward"] + one["grad_bytes"]
    assert each["peak_bytes"] < held["peak_bytes"]
    assert each["counts"]["reduce_scatter"] == 2 * one["counts"]["reduce_scatter"] == 2 * held["counts"][
        "reduce_scatter"]


CELLS = [pytest.param(("model=gpt", "strategy=fsdp2_grad_op", "grad_accum=3", "world_size=2"), id="gpt-grad_op-k3-n2"),
         pytest.param((*LLAMA, "strategy=fsdp2_full", "grad_accum=2", "precision=bf16",
                       "activation_checkpointing=selective_op", "world_size=3"), id="llama-full-k2-bf16-sac-n3",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed")),
         pytest.param((*LLAMA, "strategy=fsdp2_full", "grad_accum=2", "precision=bf16", "strategy.reduce_dtype=float32",
                       "strategy.sync_each_microbatch=true", "world_size=2"), id="llama-full-k2-bf16-each-n2",
                      marks=pytest.mark.skipif(not HF, reason="transformers is not installed"))]


@pytest.mark.parametrize("overrides", CELLS)
def test_an_accumulating_fsdp2_cell_is_judged_and_holds(cell, overrides):
    r = cell(*overrides, base=("logger=none", f"steps={STEPS}", *WINDOWS))
    checks = held_checks(r)
    assert checks["plan.memory"].verdict == "PASS"
