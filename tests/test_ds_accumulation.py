"""DeepSpeed's ``gradient_accumulation_steps`` (``grad_accum`` > 1) in the peak model, stages 1-3: stage 1 holds the
ipg bucket and autograd's whole gradients from the first micro-batch to the boundary, stage 2 the partition the first
micro-batch's epilogue kept, stage 3 nothing beyond its steady buffers (zeroexp/formulas/peak/deepspeed.py
``ds_accumulation``); cells PASS plan.memory on every rank and the planner gives the DeepSpeed rows a peak. Stage 0's
accumulation: tests/test_ds_stage0.py."""

from __future__ import annotations

import pytest
from conftest import STEPS, WINDOWS
from test_ds_big_param import GPT, needs_deepspeed
from test_recommend import _compose

from zeroexp.formulas.peak.deepspeed import ds_accumulation, ds_partition, ds_stage12_phase_peaks
from zeroexp.formulas.peak.phases import Segment, StepTrace
from zeroexp.plan.check.memory import uncovered


def test_deepspeeds_accumulation_is_covered_at_stages_0_to_3():
    for stage in (0, 1, 2, 3):
        assert uncovered(f"deepspeed_stage{stage}", "bf16", "none", "full", 4, param_dtype="bfloat16") == []
    assert uncovered("deepspeed_stage0", "fp32", "none", micro_batches=2) == []  # tests/test_ds_stage0.py
    # stage 3 with checkpointing and frozen parameters keeps its own reason, accumulating or not
    assert len(uncovered("deepspeed_stage3", "fp32", "none", "full", 2, frozen=True)) == 1


def _seg(phase: str, unit: str, peak: dict, end: dict) -> Segment:
    return Segment(phase, unit, "end", sum(peak.values()), peak, sum(end.values()), end)


def test_what_a_later_micro_batch_holds_from_its_start():
    assert ds_accumulation(1, 400, 100, 300) == {"temporaries": 400, "gradients": 300}
    assert ds_accumulation(2, 400, 100, 300) == {"temporaries": 100}
    # Stage 2, two parameters of 50 elements at N=2 in one 100-element bucket (fp32): rank 0's partition overlaps
    # parameter 0 alone (grads_in_partition 200 B). A later micro-batch's forward holds it beside its activations.
    trace = StepTrace(1, (_seg("forward", "u0", {"activations": 100}, {"activations": 100}),
                          _seg("backward", "u0", {"activations": 100, "gradients": 400},
                               {"activations": 8, "gradients": 400})), loss_bytes=8, seed_bytes=4)
    kw = dict(stage=2, buckets=((50, 50),), order=(1, 0), numels=(50, 50), part=ds_partition((50, 50), 100, 2, 0),
              bucket_numel=100, itemsize=4)
    first, later = ds_stage12_phase_peaks(trace, **kw), ds_stage12_phase_peaks(trace, **kw, later=True)
    assert later["forward"]["bytes"] == first["forward"]["bytes"] + 200 == 100 - 8 + 200
    assert later["backward"]["bytes"] == first["backward"]["bytes"] + 200
    assert later["optimizer"] == first["optimizer"]  # the step holds the partition the first one kept, as at K=1


def test_the_planner_gives_deepspeeds_accumulating_rows_a_peak():
    """The Llama 3 8B planner command's axes (N=8, batch 1, bf16, full checkpointing, grad_accum=4) on a 2-layer
    Llama: stages 1 and 2 hold more in the later micro-batches than a step without accumulation, stage 3 the same."""
    from zeroexp.cli.plan import run

    axes = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16",
            "world_size=8", "batch_size=1", "precision=bf16", "activation_checkpointing=full", "device_memory=96GB",
            "network=h100_ib", "strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]")
    peaks = {}
    for k in (1, 4):
        records, _ = run(_compose("plan", *axes, f"grad_accum={k}"))
        for r in records:
            assert r["peak_bytes"] and not r.get("peak_note"), (r["strategy"], r.get("peak_note"))
            peaks[r["strategy"], k] = r["peak_bytes"]
    assert peaks["deepspeed_stage1", 4] > peaks["deepspeed_stage1", 1]
    assert peaks["deepspeed_stage2", 4] > peaks["deepspeed_stage2", 1]
    assert peaks["deepspeed_stage3", 4] == peaks["deepspeed_stage3", 1]


MLP = ("model.width=64",)
CELLS = [pytest.param(("strategy.stage=1", *MLP, "grad_accum=3", "world_size=3"), id="mlp-stage1-k3-n3-fp32"),
         pytest.param(("strategy.stage=2", *GPT, "grad_accum=2", "world_size=2", "precision=bf16",
                       "activation_checkpointing=full"), id="gpt-stage2-k2-n2-bf16-full"),
         pytest.param(("strategy.stage=3", *MLP, "grad_accum=2", "world_size=3", "precision=bf16"),
                      id="mlp-stage3-k2-n3-bf16")]


@needs_deepspeed
@pytest.mark.parametrize("overrides", CELLS)
def test_an_accumulating_deepspeed_cell_holds_the_peak_model(cell, overrides):
    r = cell("strategy=deepspeed", *overrides, base=("logger=none", f"steps={STEPS}", *WINDOWS))
    assert r.status == "ok", r.error
    memory = r.summary["plan"]["memory"]
    assert memory["check"] == "PASS" and memory["trace"]["micro_batches"] in (2, 3)
    assert [x["check"] for x in memory["ranks"]] == ["PASS"] * r.summary["world_size"]
