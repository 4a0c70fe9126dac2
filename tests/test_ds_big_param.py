"""DeepSpeed ZeRO stages 1-3 with a parameter larger than ``reduce_bucket_size`` (every real LLM's embedding): its
gradient a bucket alone at its position in the reduce order (``extra_large_param_to_reduce``), stages 1-2
all-reducing it in one call per run of its partition slices past the bucket size (``allreduce_and_scatter``), held as
autograd's tensor until then; cells whose plan checks all pass with the limit crossed (zeroexp/formulas/deepspeed.py,
peak/deepspeed.py)."""

from __future__ import annotations

import pytest
from conftest import STEPS, WINDOWS

from zeroexp.formulas.deepspeed import deepspeed_buckets, ds_allreduce_calls
from zeroexp.formulas.peak.deepspeed import ds_allreduce_copies, ds_partition, ds_stage12_phase_peaks
from zeroexp.formulas.peak.phases import Segment, StepTrace
from zeroexp.strategies import deepspeed as ds_adapter

needs_deepspeed = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                     reason="deepspeed is not installed (pip install -e '.[deepspeed]')")
LLAMA = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
GPT = ("model=gpt", "model.n_layer=2")
MODEL_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)


def test_a_gradient_above_the_bucket_is_a_bucket_alone_in_its_place():
    # it flushes the bucket before it (none when empty) and the next gradient flushes it
    assert deepspeed_buckets(2, [3, 10, 3, 3], 6) == ((3,), (10,), (3, 3))
    assert deepspeed_buckets(3, [10, 3, 3, 10], 6) == ((10,), (3, 3), (10,))


def test_stages12_all_reduce_a_large_gradient_in_runs_of_its_partition_slices():
    # 10 + 100 + 10 elements at N=2 (partitions of 60): parameter 1 is rank 0's 50 and rank 1's 50 elements
    buckets = deepspeed_buckets(1, [10, 100, 10], 40)
    assert buckets == ((10,), (100,), (10,))
    # above a 40-element bucket each slice passes it: two calls, each one slice (no flat copy)
    assert ds_allreduce_calls(buckets, (0, 1, 2), (10, 100, 10), 60, 40) == (((10,),), ((50,), (50,)), ((10,),))
    assert ds_allreduce_copies(buckets, (0, 1, 2), (10, 100, 10), 60, 40) == (0, 0, 0)
    # a 60-element bucket: the first slice does not pass it, both go in one call, flattened into one new tensor
    assert ds_allreduce_calls(((100,),), (1,), (10, 100, 10), 60, 60) == (((50, 50),),)
    assert ds_allreduce_copies(((100,),), (1,), (10, 100, 10), 60, 60) == (100,)


def _seg(phase: str, unit: str, peak: dict, end: dict) -> Segment:
    return Segment(phase, unit, "end", sum(peak.values()), peak, sum(end.values()), end)


def test_stage2_holds_a_large_gradient_as_autograds_until_the_next_hook_reduces_it():
    # Two parameters of 50 elements at N=2 (fp32), a 40-element bucket (160 B): each gradient a bucket alone, never
    # copied into the bucket. At parameter 0's hook parameter 1's gradient is reduced: both gradients are autograd's
    # (400 B) beside the bucket (160 B); a model copying them into the bucket would hold 160 + 200 B.
    trace = StepTrace(1, (_seg("forward", "u0", {"activations": 100}, {"activations": 100}),
                          _seg("backward", "u1", {"activations": 100}, {"activations": 100, "gradients": 200}),
                          _seg("backward", "u0", {"activations": 100, "gradients": 200},
                               {"activations": 8, "gradients": 400}),
                          _seg("backward", "root", {"activations": 8, "gradients": 400},
                               {"activations": 8, "gradients": 400})), loss_bytes=8, seed_bytes=4)
    peaks = ds_stage12_phase_peaks(trace, stage=2, buckets=((50,), (50,)), order=(1, 0), numels=(50, 50),
                                   part=ds_partition((50, 50), 100, 2, 0), bucket_numel=40, itemsize=4)
    assert peaks["backward"] == {"bytes": 560, "by_category": {"gradients": 560}}


@needs_deepspeed
@pytest.mark.parametrize("overrides,counts", [
    # GPT (wte 16384 elements, tied; fc and proj 16384; qkv 12288) above a 5242-element bucket, stage 2 fp32 at N=2:
    # 14 buckets, wte's two partition slices (7296 + 9088) each past the bucket: 15 all_reduces, and the norm's
    ((*GPT, "strategy.stage=2", "world_size=2", "strategy.bucket_cap_mb=0.02"), {"all_reduce": 16, "all_gather": 1}),
    # the shrunk Llama (embedding and lm_head 16384, mlp 8192) stage 1 bf16 at N=3: 17 gradient all_reduces, the
    # norm's, bf16's overflow flag
    ((*LLAMA, "strategy.stage=1", "world_size=3", "precision=bf16", "strategy.bucket_cap_mb=0.02"),
     {"all_reduce": 19, "all_gather": 1}),
    # stage 3 bf16 at N=3, a 13106-element bucket: 10 reduce_scatters, the fp64 norm
    ((*LLAMA, "strategy.stage=3", "world_size=3", "precision=bf16", "strategy.bucket_cap_mb=0.05"),
     {"reduce_scatter": 10, "all_reduce": 1, "all_gather": 1}),
    # stage 2 fp32 at N=2, one sample: rank 1's backward peak is where lm_head's gradient (the first of backward,
    # above the bucket) is still autograd's (measured 482324 B; predicted 478156 B, 453324 B without that term)
    ((*LLAMA, "strategy.stage=2", "world_size=2", "strategy.bucket_cap_mb=0.05", "batch_size=1"),
     {"all_reduce": 11, "all_gather": 1}),
])
def test_cells_with_a_parameter_above_the_bucket_pass_every_plan_check(cell, overrides, counts):
    res = cell("strategy=deepspeed", *overrides, base=MODEL_BASE)
    assert res.status == "ok", res.error
    plan = res.summary["plan"]
    assert (plan["check"], plan["payload_check"]) == ("PASS", "PASS"), (plan["reasons"], plan["payload_reasons"])
    for part in ("state", "calls", "groups", "memory"):
        assert plan[part]["check"] == "PASS", (part, plan[part]["reasons"])
    collectives = res.summary["collectives"]
    assert collectives["check"] == "PASS", collectives["reasons"]
    assert collectives["counts"] == counts
    for c in plan["collectives"]:
        assert (c["predicted_count"], c["predicted_bytes"]) == (c["measured_count"], c["measured_bytes"]), c
