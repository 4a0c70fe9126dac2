"""DeepSpeed ZeRO stage 0's peak model (zeroexp/formulas/peak/ds_stage0.py): the module's own gradients, their flat
all_reduce copy in backward's epilogue (``buffered_allreduce_fallback``), a zero gradient for a trainable parameter
the step leaves without one, the client AdamW on the module (fp32) or FP16_UnfusedOptimizer's fp32 copies beside
their fp32 gradients (bf16), accumulation into ``.grad`` (grad_accum > 1). Cells PASS plan.memory on every rank,
each phase 0-4 B above the prediction: one 4-byte scalar of the activations category the trace does not place, seen
in every phase of every cell measured (stage 2's forward and optimizer too)."""

from __future__ import annotations

import pytest
from conftest import PROBED, WINDOWS
from test_ds_big_param import GPT, needs_deepspeed

from zeroexp.formulas.peak.adamw import adamw_temporaries
from zeroexp.formulas.peak.ds_stage0 import (ds_stage0_accumulated_phase_peaks, ds_stage0_flat_copies,
                                             ds_stage0_phase_peaks)
from zeroexp.formulas.peak.phases import Segment, StepTrace
from zeroexp.plan.check.memory import uncovered


def _seg(phase: str, unit: str, peak: dict, end: dict) -> Segment:
    return Segment(phase, unit, "end", sum(peak.values()), peak, sum(end.values()), end)


#: Two parameters of 30 and 50 elements (fp32), both graded: forward 100 B of activations, backward's end the 320 B
#: of gradients beside the 8 B of loss scalars the step keeps.
TRACE = StepTrace(1, (_seg("forward", "u0", {"activations": 100}, {"activations": 100}),
                      _seg("backward", "u0", {"activations": 100, "gradients": 320},
                           {"activations": 8, "gradients": 320})), loss_bytes=8)


def test_a_chunk_is_flattened_only_when_it_holds_several_gradients():
    assert ds_stage0_flat_copies(((30, 50), (70,))) == (80, 0)
    assert ds_stage0_flat_copies(()) == ()


def test_fp32_holds_every_gradient_beside_its_flat_copy_then_beside_adamw():
    peaks = ds_stage0_phase_peaks(TRACE, numels=(30, 50), buckets=((30, 50),), itemsize=4)
    assert peaks["forward"]["bytes"] == 100 - 8
    # the epilogue's moment: every gradient beside its chunk's flat copy
    assert peaks["backward"]["by_category"] == {"gradients": 320, "temporaries": 320}
    assert peaks["optimizer"]["bytes"] == 320 + adamw_temporaries((30, 50), 4, False)


def test_an_ungraded_parameter_gets_zeros_and_bf16_steps_fp32_copies():
    # the second parameter ungraded: its zeros (50 elements) join the gradients in the epilogue and the step
    trace = StepTrace(1, (TRACE.segments[0], _seg("backward", "u0", {"activations": 100, "gradients": 60},
                                                  {"activations": 8, "gradients": 60})), loss_bytes=8)
    peaks = ds_stage0_phase_peaks(trace, numels=(30, 50), buckets=((30, 50),), itemsize=2, ungraded=(1,))
    assert peaks["backward"]["bytes"] == 60 + 100 + 160  # autograd's, the zeros, the flat copy (bf16)
    # FP16_UnfusedOptimizer: the bf16 gradients, every fp32 .grad and AdamW over the fp32 copies
    assert peaks["optimizer"]["bytes"] == 160 + 4 * 80 + adamw_temporaries((30, 50), 4, False)


def test_a_later_micro_batch_holds_the_gradients_from_its_start():
    kw = dict(numels=(30, 50), buckets=((30, 50),), itemsize=4)
    once = ds_stage0_phase_peaks(TRACE, **kw)
    twice = ds_stage0_accumulated_phase_peaks(TRACE, TRACE, 2, **kw)
    assert twice["forward"]["bytes"] == once["forward"]["bytes"] + 320
    assert twice["backward"]["bytes"] == once["backward"]["bytes"] + 320  # the in-place trace counts none of them
    assert twice["optimizer"] == once["optimizer"]
    assert "optimizer" not in ds_stage0_phase_peaks(TRACE, boundary=False, **kw)  # no step before the boundary
    with pytest.raises(ValueError, match="in_place"):
        ds_stage0_accumulated_phase_peaks(TRACE, None, 2, **kw)


def test_stage0_is_covered_under_every_checkpointing_mode_and_accumulation():
    for mode in ("none", "full", "selective_layer", "selective_op"):
        for precision, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
            assert uncovered("deepspeed_stage0", precision, "none", mode, 2, param_dtype=dtype) == []


UNUSED = ("model=custom", "model._target_=corpus.unused_branch", "model.input_shape=[8]")  # tests/corpus.py
LORA = ("model=lora_gpt", "model.n_layer=2", "model.n_embd=32", "model.seq_len=16", "model.vocab_size=64")
CELLS = [pytest.param((*UNUSED, "world_size=2", "precision=bf16", "grad_accum=2"), id="unused-n2-bf16-k2"),
         # clipping in fp32: the engine's clip_fp32_gradients all-reduces the 4-byte norm (plan.collectives)
         pytest.param((*GPT, "world_size=2", "activation_checkpointing=selective_op", "strategy.clip_grad_norm=1"),
                      id="gpt-n2-fp32-selective_op-clip"),
         pytest.param((*LORA, "world_size=2", "precision=bf16", "activation_checkpointing=full", "grad_accum=2"),
                      id="lora-n2-bf16-full-k2")]


@needs_deepspeed
@pytest.mark.parametrize("overrides", CELLS)
def test_a_stage0_cell_holds_the_peak_model_on_every_rank(cell, overrides):
    r = cell("strategy=deepspeed", "strategy.stage=0", *overrides, base=("logger=none", f"steps={PROBED}", *WINDOWS))
    assert r.status == "ok", r.error
    plan = r.summary["plan"]
    assert [plan[part]["check"] for part in ("state", "calls", "groups")] == ["PASS"] * 3, plan["reasons"]
    # stage 0 takes no norm and holds no whole gradient before engine.step: n/a, said why
    assert (r.summary["grad_norm"]["check"], r.summary["grad_norm"]["reason_codes"]) == ("n/a", ["grad_norm.not_taken"])
    memory = plan["memory"]
    assert memory["check"] == "PASS", memory.get("reasons")
    assert [x["check"] for x in memory["ranks"]] == ["PASS"] * r.summary["world_size"]
    for rank in memory["ranks"]:  # exact, but where gloo's worker freed the tensor the model names late (late_free)
        for ph in ("forward", "backward", "optimizer"):
            assert 0 <= rank[ph]["measured_bytes"] - rank[ph]["predicted_bytes"] <= 4 or rank[ph].get("late_free"), \
                (rank["rank"], ph, rank[ph])
