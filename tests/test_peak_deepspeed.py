"""The peak model of DeepSpeed ZeRO stages 1-3 (zeroexp/formulas/peak/deepspeed.py): a rank's partition, each stage's
phase peaks with exact categories on given traces, the trace's units, and plan.memory PASS in real cells."""

from __future__ import annotations

import time

import pytest
import torch
from omegaconf import OmegaConf

from zeroexp.cell.resolved import Cell
from zeroexp.formulas.peak.phases import Segment, StepTrace, TracedUnit
from zeroexp.formulas.peak.deepspeed import (DsPartition, ds_allreduce_copies, ds_partition, ds_stage3_phase_peaks,
                                             ds_stage12_phase_peaks)
from zeroexp.plan.steptrace import trace_step
from zeroexp.strategies import deepspeed as ds_adapter


def _seg(phase: str, unit: str, at: str, peak: dict, end: dict | None = None) -> Segment:
    end = peak if end is None else end
    return Segment(phase, unit, at, sum(peak.values()), peak, sum(end.values()), end)


def test_a_rank_partition_of_the_flat_group():
    # 10 + 20 + 30 elements at N=3: partitions of 20; the middle one cuts both of its parameters.
    assert ds_partition((10, 20, 30), 60, 3, 0) == DsPartition(20, 30, (10, 10), 0, (0, 1))
    assert ds_partition((10, 20, 30), 60, 3, 1) == DsPartition(20, 50, (10, 10), 0, (1, 2))
    assert ds_partition((10, 20, 30), 60, 3, 2) == DsPartition(20, 30, (20,), 0, (2,))
    # 31 elements padded to 2N = 6 -> 36: the last rank's partition ends in 5 elements of padding (its zeros tensor).
    assert ds_partition((10, 21), 36, 3, 2) == DsPartition(12, 21, (7,), 5, (1,))


def test_an_all_reduce_copies_its_bucket_only_when_it_has_several_slices():
    # 5 parameters of 4096 at N=2 (partitions of 10240), one per bucket in backward order: only the middle one is cut
    # by a partition boundary, so only its bucket is two slices that allreduce_bucket flattens into a new tensor.
    buckets = tuple((4096,) for _ in range(5))
    assert ds_allreduce_copies(buckets, (4, 3, 2, 1, 0), (4096,) * 5, 10240) == (0, 0, 4096, 0, 0)
    # One bucket of every parameter: slices of both ranks, copied whole.
    assert ds_allreduce_copies(((4096,) * 5,), (0, 1, 2, 3, 4), (4096,) * 5, 10240) == (5 * 4096,)
    assert ds_allreduce_copies(((4096,) * 2,), (0, 1), (4096,) * 2, 10240) == (0,)  # all in rank 0's partition


# Two parameters of 50 elements at N=2 (fp32), one 1000-element bucket; rank 0's partition is parameter 0.
BACKWARD = (_seg("backward", "u1", "end", {"activations": 500, "temporaries": 300},
                 {"activations": 400, "gradients": 200}),
            _seg("backward", "u0", "end", {"activations": 300, "temporaries": 100, "gradients": 200},
                 {"activations": 100, "gradients": 400}),
            _seg("backward", "root", "end", {"activations": 100, "gradients": 400},
                 {"activations": 8, "gradients": 400}))
TRACE12 = StepTrace(1, (_seg("forward", "u0", "end", {"activations": 1000}), *BACKWARD), loss_bytes=8, seed_bytes=4)
PART0 = ds_partition((50, 50), 100, 2, 0)


def test_stage1_keeps_autograds_gradients_beside_the_bucket_and_reduces_in_the_epilogue():
    peaks = ds_stage12_phase_peaks(TRACE12, stage=1, buckets=((50, 50),), order=(0, 1), numels=(50, 50),
                                   part=PART0, bucket_numel=1000, itemsize=4)
    assert peaks["forward"] == {"bytes": 992, "by_category": {"activations": 992}}
    # The whole bucket (4000 B) from the first gradient hook on, beside autograd's gradients; the epilogue's flat
    # all_reduce copy (400 B) comes after them: below the second stretch of backward.
    assert peaks["backward"] == {"bytes": 4592, "by_category": {"activations": 292, "temporaries": 4100,
                                                                "gradients": 200}}
    # grads_in_partition (parameter 0, 200 B) beside the float64 copy of its piece (400 B) and its float64 norm (8 B);
    # the update is as high (the fp32 gradient partition 200 B, AdamW's two temporaries 400 B, the combined and the
    # new global norm 2 x 4 B): the first moment is kept.
    assert peaks["optimizer"] == {"bytes": 608, "by_category": {"temporaries": 200, "optimizer_state": 400 + 8}}


def test_stage2_moves_each_gradient_into_the_bucket():
    peaks = ds_stage12_phase_peaks(TRACE12, stage=2, buckets=((50, 50),), order=(1, 0), numels=(50, 50),
                                   part=PART0, bucket_numel=1000, itemsize=4)
    # The epilogue: the bucket (gradients, as MemTracker labels it once .grad views it) and the flat all_reduce copy.
    assert peaks["backward"] == {"bytes": 4400, "by_category": {"gradients": 4000, "temporaries": 400}}
    assert peaks["optimizer"] == {"bytes": 608, "by_category": {"temporaries": 200, "optimizer_state": 400 + 8}}


def test_stage3_holds_the_gathered_parameters_and_releases_them_after_backward():
    # u0 (an embedding of the batch: its input needs no gradient) and u1, 6 elements each, at N=4: each padded to 8.
    units = (TracedUnit("u0", (0,), False), TracedUnit("u1", (1,), True))
    segs = (_seg("forward", "u0", "start", {}), _seg("forward", "u0", "end", {"activations": 100}),
            _seg("forward", "u1", "start", {"activations": 100}), _seg("forward", "u1", "end", {"activations": 150}),
            _seg("forward", "loss", "end", {"activations": 150}, {"activations": 108}),
            _seg("backward", "u1", "start", {"activations": 208, "temporaries": 50}, {"activations": 208}),
            _seg("backward", "u1", "end", {"activations": 208, "temporaries": 40, "gradients": 24},
                 {"activations": 100, "gradients": 24}),
            _seg("backward", "u0", "start", {"activations": 100, "gradients": 24}),
            _seg("backward", "u0", "end", {"activations": 100, "gradients": 24}),
            _seg("backward", "root", "end", {"activations": 100, "gradients": 48, "temporaries": 30},
                 {"activations": 8, "gradients": 48}))
    peaks = ds_stage3_phase_peaks(StepTrace(1, segs, 8, units), numels=(6, 6), world_size=4, buckets=((6, 6),),
                                  itemsize=4, gloo=True)
    # u0 computing: both parameters gathered (48 B) and the all_gather's flat buffer (2 x 8 x 4 = 64 B) still held
    # until u1, the last module, is fetched.
    assert peaks["forward"] == {"bytes": 204, "by_category": {"activations": 92, "parameters": 48,
                                                              "temporaries": 64}}
    assert peaks["backward"] == {"bytes": 298, "by_category": {"activations": 200, "temporaries": 50,
                                                               "parameters": 48}}
    # The fp32 gradient partition (2 x 2 elements), AdamW's two temporaries over it and the step's three float64
    # norms (the one sub-group's, their combination, the new _global_grad_norm).
    assert peaks["optimizer"] == {"bytes": 72, "by_category": {"optimizer_state": 16 + 32 + 3 * 8}}
    # Without the backward's own peak, the epilogue: u0's parameter (never released in backward), the reduce-scatter
    # concatenation (64 B), its padding chunks (16 B) and gloo's copy of its input (64 B).
    quiet = tuple(s for s in segs if s.phase == "forward") + tuple(
        _seg(s.phase, s.unit, s.at, {"activations": 8}, s.end_by_category) for s in segs if s.phase == "backward")
    peaks = ds_stage3_phase_peaks(StepTrace(1, quiet, 8, units), numels=(6, 6), world_size=4, buckets=((6, 6),),
                                  itemsize=4, gloo=True)
    assert peaks["backward"] == {"bytes": 168, "by_category": {"parameters": 24, "temporaries": 144}}
    # u0 frozen and fed by the batch: backward never reaches it, so the coordinator releases its parameter after its
    # forward (no later use in its trace): u0 still computes with both gathered, backward holds u1's alone.
    frozen = (units[0]._replace(reached=False), units[1])
    peaks = ds_stage3_phase_peaks(StepTrace(1, segs, 8, frozen), numels=(6, 6), world_size=4, buckets=((6,),),
                                  itemsize=4, gloo=True, partitions=(2,))
    assert peaks["forward"]["by_category"]["parameters"] == 48
    assert peaks["backward"]["by_category"]["parameters"] == 24
    assert peaks["optimizer"] == {"bytes": 8 + 16 + 3 * 8, "by_category": {"optimizer_state": 8 + 16 + 3 * 8}}


def test_the_trace_records_each_modules_parameters_and_whether_autograd_reaches_its_input():
    cfg = OmegaConf.create({"name": "mlp", "_target_": "zeroexp.models.LinearStack", "width": 8, "depth": 3,
                            "input_shape": [8]})
    trace = trace_step(cfg, 4, (), own_params_units=True)
    assert [(u.params, u.grad_input) for u in trace.units] == [((0,), False), ((1,), True), ((2,), True)]
    assert all(u.reached for u in trace.units)
    assert trace_step(cfg, 4, [torch.nn.Linear]).units == ()  # only when asked
    # A frozen first layer on the batch: backward never reaches it; a frozen second one it reaches (its input trains).
    for frozen, reached in (((0,), [False, True, True]), ((1,), [True, True, True])):
        cfg = OmegaConf.create({"name": "custom", "_target_": "corpus.frozen_mlp", "width": 8, "depth": 3,
                                "frozen": list(frozen), "input_shape": [8]})
        assert [u.reached for u in trace_step(cfg, 4, (), own_params_units=True).units] == reached


needs_deepspeed = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                     reason="deepspeed is not installed (pip install -e '.[deepspeed]')")


@needs_deepspeed
@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (3, "bf16")])
def test_plan_memory_passes_in_real_cells(cell, stage, precision):
    # tests/test_deepspeed.py's cells in fp32 (same overrides: run once per session): 5 Linear(64, 64) at N=2, a reduce
    # bucket of 7864 elements, so each Linear's gradient is reduced on its own, in backward at stages 2 and 3. bf16:
    # the module converted by DeepSpeed, 2-byte bucket, gradients and collectives, the fp32 partition's step.
    res = cell("strategy=deepspeed", "world_size=2", f"strategy.stage={stage}", "model.depth=5",
               "strategy.bucket_cap_mb=0.03", *(("precision=bf16",) if precision == "bf16" else ()))
    assert res.status == "ok", res.error
    memory = res.summary["plan"]["memory"]
    assert memory["check"] == "PASS", memory["reasons"]
    c = 4 if precision == "fp32" else 2
    bucket = 7864 * c
    assert memory["phases"]["steady"]["predicted_buffers_bytes"] == (bucket if stage == 3 else 0)
    backward = memory["phases"]["backward"]
    if stage == 2:  # the bucket, allocated in backward, and the Linear's gradient whose hook reduces the last bucket
        assert backward["predicted_by_category"]["gradients"] == bucket + 64 * 64 * c
    if stage == 1:
        assert backward["predicted_by_category"]["temporaries"] >= bucket
    for ph in ("forward", "backward", "optimizer"):
        rec = memory["phases"][ph]
        assert 0 <= rec["measured_bytes"] - rec["predicted_bytes"] <= 0.02 * rec["measured_bytes"] or "late_free" in rec


def test_planner_rows_of_deepspeed_peak_with_the_bucket_and_name_what_is_not_modelled():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.formulas import Groups
    from zeroexp.cli.plan import register, run
    from zeroexp.formulas import LAYOUTS

    def ds_peak_limits(name, groups, cap, recompute=False):
        return LAYOUTS[name].family.peak_limits(LAYOUTS[name], groups, cap, recompute)

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name="plan", overrides=[
            "model=mlp", "model.width=64", "model.depth=8", "world_size=2", "batch_size=8", "bucket_cap_mb=1",
            "strategies=[deepspeed_stage1,deepspeed_stage2,deepspeed_stage3]"])
    rows = {r["strategy"]: r for r in run(cfg)[0]}
    bucket = 2**20 // 4 * 4  # bucket_cap_mb=1: 262144 elements of 4 bytes
    for name, row in rows.items():
        phases = row["phase_bytes"]
        assert row["fits_on"] == "peak" and row["peak_phase"] == max(phases, key=phases.get), (name, row)
        # stage 3 keeps its bucket between steps (beside the state); stages 1-2 allocate it in backward, and their
        # step frees the gradient partition the state at the boundary holds (the phases count it where it is held)
        steady = row["device_bytes"] + (bucket if name.endswith("3") else -row["grad_bytes"])
        assert row["steady_bytes"] == steady and row["peak_bytes"] == steady + max(row["phase_bytes"].values())
    stage2 = rows["deepspeed_stage2"]
    assert stage2["peak_phase"] == "backward" and stage2["phase_bytes"]["backward"] >= bucket
    # stage 3's forward: every parameter gathered (8 x 64^2 fp32) beside the all_gather's flat buffer
    assert rows["deepspeed_stage3"]["phase_bytes"]["forward"] >= 2 * 8 * 64 * 64 * 4
    # A stage-3 step that gathers a parameter twice (released in forward and fetched again in backward) is replayed
    # (tests/test_ds3_schedule.py), under checkpointing too (the recompute's own fetches replayed, every mode); n/a
    # where the mode is not given. Several prefetch
    # buckets and a parameter above the reduce bucket (a bucket alone, tests/test_ds_big_param.py) are modelled.
    g = Groups("deepspeed_stage3", 2, (10**8,), gathers=((10**8,), (10**8,)))
    assert ds_peak_limits("deepspeed_stage3", g, 2**20) == []
    assert [r.split(" (")[0] for r in ds_peak_limits("deepspeed_stage3", g, 2**20, recompute=True)] == [
        "no peak model yet for stage 3 with activation checkpointing gathering a parameter twice in a step"]
    for mode in ("full", "selective_layer", "selective_op"):
        assert ds_peak_limits("deepspeed_stage3", g, 2**20, recompute=mode) == []
    assert ds_peak_limits("deepspeed_stage2", Groups("deepspeed_stage2", 2, (10**8,)), 2**20) == []
    assert ds_peak_limits("deepspeed_stage3", Groups("deepspeed_stage3", 2, (10, 10), gathers=((10,), (10,))),
                          2**20) == []
    assert ds_peak_limits("deepspeed_stage2", Groups("deepspeed_stage2", 2, (10, 10)), 2**20) == []


@needs_deepspeed
def test_gloos_copy_of_a_reduce_scatter_input_held_into_the_step_is_one_named_late_tensor(compose):
    """gloo's ``_reduce_scatter_base`` clones its input and its work object holds the clone; gloo's worker thread may
    drop the work after the step began (CI: the biased 10-7-3 stack at stage 3, N=3, 420 B labelled activations in the
    optimizer phase). Built here deterministically: the copy measured in a one-rank gloo group with the work held, then
    the cell's check fed that copy above its prediction in the step."""
    from test_memory_categories import _group
    from zeroexp._lib.memtrack import step_mem_tracker, totals
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.cell.resolved import layout_of
    from zeroexp.plan.check.memory import memory_section
    from zeroexp.plan.shape import model_shape

    n, numels = 3, (10 * 7, 7, 7 * 3, 3)
    concat = sum(-(-k // n) * n for k in numels) * 4  # every gradient's rank chunks padded to N: 105 fp32 elements
    assert concat == 420
    pg, mt = _group(), step_mem_tracker()
    with mt:
        flat = torch.ones(concat // 4)  # DeepSpeed's concatenation (reduce_scatter_coalesced)
        before = totals(mt.get_tracker_snapshot("current"), "cpu")[0]
        work = pg._reduce_scatter_base(flat[:], flat)  # the rank's chunk, a view of the input as DeepSpeed's (N=1)
        work.wait()
        held, cats = totals(mt.get_tracker_snapshot("current"), "cpu")
        del work
        # freed when the last reference goes: ours, or gloo's worker thread's, which may still hold the finished work
        # for a moment after wait() returned (ProcessGroupGloo's runLoop drops it after marking it complete: once seen
        # in CI, 840 B here a moment after the del)
        deadline = time.monotonic() + 10
        while (gone := totals(mt.get_tracker_snapshot("current"), "cpu")[0]) != before and time.monotonic() < deadline:
            time.sleep(0.001)
    # gloo's copy, alive while its work is, labelled activations (the input itself is comm once the collective ran)
    assert held - before == concat and (cats["activations"], cats["comm"]) == (concat, concat)
    assert gone == before

    cfg = compose("strategy=deepspeed", f"world_size={n}", "strategy.stage=3", "model=custom",
                  "model._target_=corpus.biased", "model.input_shape=[10]",
                  base=("logger=none", "steps=10", "warmup_steps=3"))
    name = layout_of(cfg)[0]
    args = (name, cell_groups(Cell.of(cfg)), 4, [import_class(p) for p in wrap_paths(cfg)],
            model_shape(cfg.model, wrap_paths(cfg)))

    def check(predicted: list[dict] | None, extra: int = 0) -> dict:
        """The check fed a CPU cell's memory section: each rank at its predicted phases (None: 1 GB above steady),
        ``extra`` bytes more in the step."""
        steady = 10**5
        by_rank = [{ph: {"peak_bytes": steady + (p[ph]["predicted_bytes"] if predicted else 10**9) + (
            extra if ph == "optimizer" else 0), "by_category": {}} for ph in ("forward", "backward", "optimizer")}
            for p in (predicted or [None] * n)]
        return memory_section(Cell.of(cfg), {"memory": {
            "source": "torch.distributed._tools.MemTracker: ...", "max_rank": 0, "steady_bytes": [steady] * n,
            "phases_of_max_rank": by_rank[0], "phases_by_rank": by_rank, "steady_categories_of_max_rank": {},
            "steady_categories_by_rank": [{}] * n}}, *args)

    predicted = check(None)["ranks"]  # each rank's prediction on gloo
    exact = check(predicted)
    assert exact["check"] == "PASS", exact["reasons"]
    late = check(predicted, concat)  # gloo's copy still held by its work in the step, on every rank
    assert late["check"] == "PASS", late["reasons"]
    assert late["phases"]["optimizer"]["late_free"] == (
        f"{concat} B above the prediction, within one late-freed tensor: bucket 0's reduce-scatter input as gloo "
        f"copied it (_reduce_scatter_base), held by gloo's work ({concat} B)")
    assert check(predicted, 2 * concat)["check"] == "FAIL"  # one such tensor, never two


def test_stage12_holds_a_zeros_gradient_for_a_parameter_without_one():
    # 10 + 20 + 30 elements at N=3 (partitions of 20), rank 1's partition cutting parameters 1 and 2; parameter 2 got
    # no gradient: out of the buckets; the epilogue gives it a zeros tensor of its size (30), kept beside
    # grads_in_partition (parameters 1 and 2 whole, 50: made when parameter 1's bucket is reduced) into the step,
    # where each piece's float64 copy is taken beside the norms before it (2 x 8 + 10 x 8 = 96 B at most).
    part = ds_partition((10, 20, 30), 60, 3, 1)
    peaks = ds_stage12_phase_peaks(TRACE12, stage=2, buckets=((20, 10),), order=(1, 0), numels=(10, 20, 30),
                                   part=part, bucket_numel=1000, itemsize=4, ungraded=(2,))
    assert peaks["optimizer"] == {"bytes": 4 * (50 + 30) + 96, "by_category": {"temporaries": 320,
                                                                               "optimizer_state": 96}}
    graded = ds_stage12_phase_peaks(TRACE12, stage=2, buckets=((30, 20, 10),), order=(2, 1, 0), numels=(10, 20, 30),
                                    part=part, bucket_numel=1000, itemsize=4)
    assert graded["optimizer"]["by_category"]["temporaries"] == 4 * 50
    # Rank 2's partition is parameter 2 alone: no gradient of it is reduced, so no grads_in_partition, its zeros only.
    alone = ds_stage12_phase_peaks(TRACE12, stage=2, buckets=((20, 10),), order=(1, 0), numels=(10, 20, 30),
                                   part=ds_partition((10, 20, 30), 60, 3, 2), bucket_numel=1000, itemsize=4,
                                   ungraded=(2,))
    assert alone["optimizer"]["by_category"]["temporaries"] == 4 * 30


@pytest.mark.parametrize("n", [4, 7])
def test_stage12_worst_rank_from_rank_independent_moments_equals_each_ranks_phases(n):
    # Uneven partitions of 10 + 21 + 7 + 40 + 3 elements (parameter 0 without a gradient, parameter 3 above the
    # 30-element bucket): every rank's phases' bytes from the moments summed once equal the direct evaluation's, at
    # both stages, with and without a later micro-batch; the worst rank is the direct one's.
    from zeroexp.formulas.paper import padded_numel
    from zeroexp.formulas.peak.ds_ranks import DsStage12Ranks, ds_partitions, ds_worst_rank

    numels, flat = (10, 21, 7, 40, 3), padded_numel(81, 2 * n)
    grads = (12, 172, 200, 296, 324)
    backward = tuple(_seg("backward", f"u{k}", "end", {"activations": 400 - 60 * k, "temporaries": 30 + 7 * k,
                                                        "gradients": g}, {"activations": 380 - 60 * k, "gradients": g})
                     for k, g in enumerate(grads))
    trace = StepTrace(1, (_seg("forward", "u0", "end", {"activations": 500}), *backward), loss_bytes=8)
    parts = ds_partitions(numels, flat, n)
    assert parts == [ds_partition(numels, flat, n, r) for r in range(n)]
    for stage, buckets, order in ((1, ((21, 7), (40,), (3,)), (1, 2, 3, 4)), (2, ((3,), (40,), (7, 21)), (4, 3, 2, 1))):
        kw = dict(stage=stage, buckets=buckets, order=order, numels=numels, bucket_numel=30, itemsize=4,
                  ungraded=(0,))
        fast = {later: DsStage12Ranks(trace, partition_numel=flat // n, later=later, **kw) for later in (False, True)}
        direct = []
        for part in parts:
            runs = [ds_stage12_phase_peaks(trace, part=part, later=later, **kw) for later in (False, True)]
            for later, run in zip((False, True), runs):
                assert fast[later].phase_bytes(part) == {ph: v["bytes"] for ph, v in run.items()}
            direct.append(max(max(a["bytes"], runs[1][ph]["bytes"]) for ph, a in runs[0].items()))
        assert ds_worst_rank(fast[False], parts, fast[True]) == direct.index(max(direct))
