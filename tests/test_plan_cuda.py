"""The peak model's CUDA semantics (zeroexp.formulas.device) against published CUDA figures (seed 000's six V100 cells;
PyTorch's own FSDP2 memory-test budgets, below), and reserved memory (zeroexp.formulas.peak.allocator). Seed 000's cells
(8 x Linear(2048, 2048) without bias, P = 128 MiB, N=4, 64 MiB DDP buckets, AdamW, 8 samples a rank), measured with
torch.cuda's allocated bytes. What the seed does not state is assumed once, alike for all six: torch's defaults on a
V100 (AdamW's foreach update, NCCL, two cuBLAS workspaces of 8,519,680 bytes: the forward's and autograd's thread)."""

from __future__ import annotations

import pytest

from zeroexp.cell.resolved import Cell
from zeroexp.formulas.peak.allocator import counted_sum
from zeroexp.formulas.device import CPU, cublas_workspace_bytes, cuda
from zeroexp.results.verdict import Code

from test_plan_fits import _run
from conftest import FLOW

MiB = 2**20
#: (steady allocated, peak allocated) MiB per cell, the seed's table.
SEED = {("ddp", "pre"): (528.25, 784.50), ("zro", "pre"): (336.25, 496.50), ("fsdp_grad_op", "pre"): (144.25, 273.50),
        ("fsdp_full", "pre"): (144.25, 200.75), ("fsdp_full", "post"): (144.25, 188.50),
        ("fsdp_full", "none"): (144.25, 188.50)}
P = 8 * 2048 * 2048 * 4


def _rows(prefetch: str) -> dict[str, dict]:
    records, _ = _run("model=seed_ch31", "world_size=4", "bucket_cap_mb=64", "batch_size=8", "device=cuda",
                      "compute_capability=7.0", f"prefetch={prefetch}", "strategies=[ddp,zro,fsdp_grad_op,fsdp_full]")
    return {r["strategy"]: r for r in records}


@pytest.mark.parametrize("prefetch", ["pre", "post", "none"])
def test_the_seeds_six_v100_cells_peak_as_the_cuda_semantics_predict(prefetch):
    rows = _rows(prefetch)
    for (name, p), (steady, peak) in SEED.items():
        if p != prefetch:
            continue
        r = rows[name]
        assert r["device_semantics"] == "cuda" and r["workspace_bytes"] == 2 * 8_519_680
        # the model is a lower bound of what was allocated: within 1 % below the seed's peak (0.03-0.25 % measured)
        assert 0 <= peak * MiB - r["peak_bytes"] <= 0.01 * peak * MiB, (name, p, r["peak_bytes"] / MiB, peak)
        if name.startswith("fsdp"):  # the sharded state and the workspaces, exactly
            assert r["steady_bytes"] == steady * MiB, (name, r["steady_bytes"] / MiB)
        else:  # the seed's loop frees the replicated gradients at its boundary (zero_grad(set_to_none=True)),
            # Lightning's holds them until the next backward (docs/planner.md): the seed's steady less them
            assert r["grad_bytes"] == P, name
            assert r["steady_bytes"] - r["grad_bytes"] == steady * MiB, (name, r["steady_bytes"] / MiB)


#: Recorded on the H200 where the prediction stays a lower bound but falls short by more than the tolerance: (file
#: stem part, phase). PyTorch's test Transformer at dim 32 (4 heads of 8): backward 91,648-131,584 B above the
#: prediction, allocated by CUDA kernels beyond what the CPU trace sees (named in CUDA_NOT_MODELLED); at dim 256 within
#: 512 B.
SHORT_ON_CUDA = {("torch_transformer_dim32", "backward")}


def test_the_h200_measurements_of_one_rank_of_n_are_met_by_the_cuda_prediction():
    """docs/measured/gpu_check_h200_*.json (benchmarks/gpu_check.py on an H200: rank 0 of N under the fake process
    group with real CUDA tensors, torch.cuda's allocated bytes per phase above steady; the seed's model at N=4 and 8,
    an odd-sized mlp at N=3, PyTorch's test Transformer at N=4): the planner's CUDA prediction of every phase, each
    allocation counted in 512-B blocks, is a lower bound of every measurement and what the cell's check wants
    (``zeroexp.plan.check.judge.judge``: within the tolerance) but where SHORT_ON_CUDA says; reserved a lower bound too.
    Counted in tensor bytes, FULL_SHARD's forward was 504 B above the measurement: the previous step's 4-byte loss,
    freed in forward, is a 512-B block."""
    import importlib.util
    import json
    from pathlib import Path

    from zeroexp.plan.check.judge import judge

    paths = sorted((Path(__file__).resolve().parent.parent / "docs" / "measured").glob("gpu_check_h200_*.json"))
    models, short = set(), set()
    for path in paths:
        got = json.loads(path.read_text())
        if "torch_transformer" in path.name and importlib.util.find_spec("expecttest") is None:
            continue  # PyTorch's test Transformer imports it
        models.add(got["model"])
        orig = got.get("use_orig_params", False)  # recorded before 2026-12-05: FSDP1's default then, false
        for cell in got["cells"]:
            n, name, prefetch = cell["world_size"], cell["strategy"], cell["prefetch"]
            (r,), _ = _run(f"model={got['model']}", *got["overrides"], f"world_size={n}", f"use_orig_params={orig}",
                           f"batch_size={got['batch_size']}", "device=cuda", "compute_capability=9.0",
                           f"prefetch={prefetch}", f"strategies=[{name}]")
            where = (path.name, name, prefetch, n)
            for ph, want in r["phase_bytes"].items():
                got_ph = cell["measured"]["phases"][ph]
                assert want % 512 == 0 and want <= got_ph["measured_bytes"], (*where, ph)  # a lower bound
                # reserved: a lower bound (segments the allocator needed for at least the modelled blocks)
                assert r["reserved_peak_bytes"] <= got_ph["measured_reserved_bytes"], (*where, ph)
                if judge(got_ph["measured_bytes"], want, [])[0] != "PASS":
                    known = next((k for k, p in SHORT_ON_CUDA if k in path.name and p == ph), None)
                    assert known is not None, (*where, ph, got_ph["measured_bytes"], want)  # short beyond tolerance
                    short.add((known, ph))
    assert models >= {"seed_ch31", "mlp"}  # the seed's model and one of odd sizes (width 100 at N=3)
    if "custom" in models:
        assert short == SHORT_ON_CUDA  # a gap modelled: update SHORT_ON_CUDA and CUDA_NOT_MODELLED


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_cuda_phase_counts_whole_blocks_on_an_odd_sized_model(precision):
    """Each tensor in 512-B blocks, the trace's and the closed-form terms' alike (zeroexp's ZeRO's up-casts and
    all-gather inputs below fp32, FSDP1's flat gradient under no_sync too): every phase of every row but DeepSpeed's
    (tensor bytes, said in the notes) is a whole number of blocks, on 8 x Linear(100, 100) at N=3."""
    rows = "[ddp,zro,zero1,zero2,fsdp_grad_op,fsdp_full,fsdp2_full,fsdp2_grad_op]"
    for accum in (1, 2):
        records, notes = _run("model=mlp", "model.width=100", "world_size=3", "batch_size=4", "device=cuda",
                              f"precision={precision}", f"grad_accum={accum}", f"strategies={rows}")
        covered = [r for r in records if r["phase_bytes"] is not None]
        assert len(covered) >= 4, [(r["strategy"], r["peak_note"]) for r in records]
        for r in covered:
            assert all(v % 512 == 0 for v in r["phase_bytes"].values()), (r["strategy"], accum, r["phase_bytes"])
    assert any("DeepSpeed's rows" in n for n in notes)


def test_a_bucket_opens_at_its_first_gradient_counted_as_the_trace_counts_it():
    """zeroexp's ZeRO-2 on CUDA: a bucket is one allocation (its flat size in blocks), its parameters' gradients in
    the trace one each (in blocks): where the next bucket opens is the gradients of the buckets before it as the
    trace counts them (``bucket_edges``), not their flat sizes. Two buckets of two 4-byte gradients each: 1,024 B of
    traced gradients close the first bucket, whose flat size is 512 B."""
    from zeroexp.formulas.peak.phases import Segment, StepTrace, phase_peaks

    def seg(phase, unit, peak, end):
        return Segment(phase, unit, "end", sum(peak.values()), peak, sum(end.values()), end)

    trace = StepTrace(1, (seg("forward", "a", {"activations": 512}, {"activations": 512}),
                          seg("backward", "b", {"gradients": 1024}, {"gradients": 1024}),
                          seg("backward", "a", {"gradients": 2048}, {"gradients": 2048})), 1024)
    terms = dict(steady_grad_bytes=0, buckets=(512, 512), optimizer_numels=(2, 2), optimizer_itemsize=4,
                 foreach=True, block=512)
    flat = phase_peaks(trace, **FLOW["bucket"], **terms)["backward"]
    traced = phase_peaks(trace, **FLOW["bucket"], **terms, bucket_edges=(0, 1024, 2048))["backward"]
    assert flat["by_category"]["comm"] == 1024  # the second bucket counted before its first gradient
    assert traced["by_category"]["comm"] == 512 and traced["bytes"] == flat["bytes"] - 512


def test_foreachs_list_is_placed_tensor_by_tensor_in_the_blocks_backward_freed():
    """AdamW's foreach temporaries are one tensor per parameter: the allocator places each in the blocks backward
    freed, where their sum as one block would need a segment of its own."""
    from zeroexp.formulas.peak.adamw import adamw_temporary_blocks
    from zeroexp.formulas.peak.allocator import allocations, reserved_peak

    backward = {"comm": 12 * MiB, "temporaries": 12 * MiB}
    lumped = {"bytes": 16 * MiB, "by_category": {"optimizer_state": 16 * MiB}}
    one_by_one = {**lumped, "blocks": {"optimizer_state": adamw_temporary_blocks([MiB] * 4, 4, True, 512)}}
    assert one_by_one["blocks"]["optimizer_state"] == (4 * MiB,) * 4
    assert reserved_peak({}, [backward, allocations(lumped)])[0] == 40 * MiB
    assert reserved_peak({}, [backward, allocations(one_by_one)])[0] == 24 * MiB
    assert adamw_temporary_blocks([3, 0, 5], 4, True, 512) == (512, 512)  # an empty shard allocates nothing
    assert adamw_temporary_blocks([3, 5], 4, False) == ((3 + 2 * 5) * 4,)  # single-tensor: its moment


def test_the_device_semantics_are_torchs_defaults():
    assert not CPU.foreach and CPU.gloo and CPU.workspace_bytes == 0 and CPU.block == 1
    v100, h100 = cuda(7.0), cuda(9.0)
    assert v100.block == h100.block == 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize
    assert v100.foreach and not v100.gloo and v100.workspace_bytes == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)
    assert h100.workspace_bytes == 2 * 32 * MiB and cublas_workspace_bytes(None) == cublas_workspace_bytes(8.0)
    assert "fragmentation" in " ".join(v100.not_modelled) and "NCCL" in " ".join(v100.not_modelled)


def test_a_device_memory_plans_cuda_and_cpu_can_be_asked_for():
    records, notes = _run("model=seed_ch31", "world_size=4", "batch_size=8", "device_memory=32GB", "strategies=[ddp]")
    assert records[0]["device_semantics"] == "cuda" and any("not modelled" in n for n in notes)
    assert records[0]["reserved_peak_bytes"] >= records[0]["peak_bytes"] and records[0]["fits_on"] == "reserved"
    cpu, _ = _run("model=seed_ch31", "world_size=4", "batch_size=8", "device=cpu", "strategies=[ddp]")
    gpu, _ = _run("model=seed_ch31", "world_size=4", "batch_size=8", "device=cuda", "strategies=[ddp]")
    # AdamW's foreach list (128 MiB at once) against single-tensor temporaries of one 16 MiB layer, plus the workspaces
    assert gpu[0]["peak_bytes"] - cpu[0]["peak_bytes"] == 128 * MiB - 48 * MiB + 2 * 8_519_680


# -- PyTorch's own FSDP2 memory budgets (test/distributed/_composable/fsdp/test_fully_shard_memory.py): its
# Transformer (ModelArgs(vocab_size=32, n_layers=3, dim=768, n_heads=12, weight_tying=False)), N=2, each
# TransformerBlock and the root fully_shard-ed, Adam with foreach=False, one (1, 4) input, loss = out.sum(). It asserts
# the first step's torch.cuda active bytes above a base taken after the cuBLAS workspaces exist, in MB (1e6), under a
# closed-form budget per phase; the CUDA-semantics prediction of the same step run alone (its workspaces left out, as
# the base leaves them out) meets each but one, reshard_after_forward=False's forward. In PyTorch's order of subtests
# the base is higher and that one holds too: tests/test_pytorch_fsdp2_budgets.py replays it.
DTENSOR = "torch.testing._internal.distributed._tensor.common_dtensor"
TORCH_TRANSFORMER = ("model=custom", f"model._target_={DTENSOR}.Transformer", "model.input_shape=[4]",
                     f"+model.args._target_={DTENSOR}.ModelArgs", "+model.args.n_layers=3",
                     "+model.args.vocab_size=32", "+model.args.dim=768", "+model.args.n_heads=12",
                     "+model.args.weight_tying=false", "+model.args.dropout_p=0.0", "model.dtype=long", "model.high=32",
                     "model.loss=sum", f"model.wrap=[{DTENSOR}.TransformerBlock]")
TT = __import__("importlib.util").util.find_spec("expecttest") is not None


def _torch_transformer_numels() -> dict[str, int]:
    """test_fully_shard_memory.py's counts of its Transformer's elements: the whole model unsharded, a rank's shard
    (N=2), one TransformerBlock (``max_unsharded_numel``) and the root's own parameters (``non_block_numel``)."""
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    with torch.device("meta"):
        model = Transformer(ModelArgs(vocab_size=32, n_layers=3, dim=768, n_heads=12, weight_tying=False))
    unsharded = sum(p.numel() for p in model.parameters())
    return {"unsharded": unsharded, "sharded": (unsharded + 1) // 2,
            "block": sum(p.numel() for p in model.layers[0].parameters()),
            "non_block": sum(p.numel() for m in (model.tok_embeddings, model.pos_embeddings, model.norm, model.output)
                             for p in m.parameters())}


#: test_fully_shard_memory.py's allowance (MB) for fragmentation and activations in every phase after init (CUDA; 18 on
#: ROCm).
BUFFER_MB = 16
#: The version of test_fully_shard_memory.py the budgets are copied from (pytorch/pytorch, the file's blob at commit
#: 5ae3db165db21be2bacb6fb53c27f4860b2c01ee).
PYTORCH_TEST = "pytorch/pytorch@5ae3db16 test/distributed/_composable/fsdp/test_fully_shard_memory.py"


def _pytorch_budgets(reshard_after_forward: bool, optim_in_backward: bool = False, cpu_offload: bool = False,
                     as_written: bool = True) -> dict[str, float]:
    """test_fully_shard_memory.py's budgets (MB above its base) for the first step, as it computes them
    (:data:`PYTORCH_TEST`, ``_test_fully_shard_training_memory``). ``optim_in_backward``: its backward budget adds the
    sharded parameters and one block's gradient shard ``* 4 / 1e-6`` (a typo for ``/ 1e6``: some 10^13 MB, a budget
    no run can exceed); ``as_written=False`` reads it as ``/ 1e6``."""
    n = _torch_transformer_numels()
    unsharded, sharded, block, non_block, buffer = n["unsharded"], n["sharded"], n["block"], n["non_block"], BUFFER_MB
    per_mb = 1e-6 if as_written else 1e6
    if reshard_after_forward:
        # 3x block (current all-gather + copy-out and next all-gather), non-block parameters; sharded parameters
        forward = (3 * block + non_block) * 4 / 1e6 + buffer + (0 if cpu_offload else sharded * 4 / 1e6)
        # 2x block parameters (all-gather + copy-out), 2x block gradients (gradients, reduce-scatter input)
        backward = (4 * block + non_block) * 4 / 1e6 + buffer
        if not cpu_offload:
            backward += (sharded * 4 / per_mb + block // 2 * 4 / per_mb if optim_in_backward
                         else 2 * sharded * 4 / 1e6)
    else:  # sharded, unsharded, one block's copy-out; backward: 1.5 blocks (reduce-scatter input/output)
        forward = (sharded + unsharded + block) * 4 / 1e6 + buffer
        backward = (sharded + unsharded + 1.5 * block) * 4 / 1e6 + buffer
    # 1x sharded parameters, 2x optimizer states, 1x sharded gradients unless the step ran in backward
    optimizer = buffer + (0 if cpu_offload else (3 * sharded + (0 if optim_in_backward else sharded)) * 4 / 1e6)
    zero_grad = 0 if cpu_offload else sharded * 4 / 1e6 + buffer + 2 * sharded * 4 / 1e6 + buffer
    return {"forward": forward, "backward": backward, "optimizer": optimizer, "zero_grad": zero_grad}


def _first_step_mb(r: dict) -> dict[str, float]:
    """The prediction of the first step in PyTorch's terms: above its base, before it no gradient and no optimizer
    state exist (zeroexp's phases are above the steady state of a later step, which holds both). PyTorch reads the
    peak since its base, resetting it only after backward: its backward reading is the higher of the two phases'."""
    params, grads = r["param_bytes"], r["grad_bytes"]
    ph = r["phase_bytes"]
    forward = (params + ph["forward"]) / 1e6
    # backward's figure already counts the steady gradients zero_grad freed (-grads) and the new shards
    backward = (params + grads + ph["backward"]) / 1e6
    return {"forward": forward, "backward": max(forward, backward),
            # the step: the state Adam creates (2 moments) beside the parameters and the gradients, its temporaries
            "optimizer": (r["device_bytes"] + ph["optimizer"]) / 1e6,
            # zero_grad frees the gradient shards: the parameters and the moments
            "zero_grad": (r["device_bytes"] - grads) / 1e6}


@pytest.mark.skipif(not TT, reason="expecttest is not installed (PyTorch's test Transformer imports it)")
@pytest.mark.parametrize("reshard", [True, False])
def test_pytorchs_fsdp2_memory_budgets_hold_the_cuda_prediction(reshard):
    """Every budget but reshard_after_forward=False's forward (the next test) holds the prediction, each for the reason
    its budget gives. True's forward: three block sizes at a block's copy-out (the previous block's all-gather
    output, its own, its parameters). True's backward: the middle block's backward, four block-sized buffers (its
    parameters, the first block's prefetched all-gather output, the last block's reduce-scatter input that FSDP2
    keeps until the next post-backward, its own unsharded gradients) beside one block's gradient shard, where the
    budget counts four blocks beside every gradient shard. False's backward reads the forward's peak (PyTorch resets
    its peak only after backward), within the budget's extra half block."""
    strategy = "fsdp2_full" if reshard else "fsdp2_grad_op"
    records, _ = _run(*TORCH_TRANSFORMER, "world_size=2", "batch_size=1", "device=cuda", "foreach=false",
                      f"strategies=[{strategy}]")
    r = records[0]
    assert r["device_semantics"] == "cuda" and r["peak_bytes"] is not None
    predicted, budget = _first_step_mb(r), _pytorch_budgets(reshard)
    for phase in ("forward", "backward", "optimizer", "zero_grad"):
        if not reshard and phase == "forward":
            continue  # test_fsdp2_grad_op_forward_exceeds_pytorchs_budget
        assert predicted[phase] <= budget[phase], (phase, predicted[phase], budget[phase])
    if reshard:
        n = _torch_transformer_numels()
        # beside the parameters: four blocks, one block's gradient shard, and the activations of one (1, 4) input
        activations = 1e6 * predicted["backward"] - r["param_bytes"] - 4 * (4 * n["block"] + n["block"] // 2)
        assert 0 < activations < 1e6, activations


@pytest.mark.skipif(not TT, reason="expecttest is not installed (PyTorch's test Transformer imports it)")
def test_fsdp2_grad_op_forward_exceeds_pytorchs_budget():
    """A finding: with reshard_after_forward=False the forward's peak is the last block's copy-out, where the
    previous block's all-gather output is still alive beside the last block's own and every unit's unsharded
    parameters: sharded + unsharded + 2 blocks. PyTorch's budget counts sharded + unsharded + 1 block ("copy-out",
    the peak it places at the end of forward) plus its 16 MB buffer, which does not cover the second block
    (28.34 MB); its reshard_after_forward=True budget counts that same third block ("current all-gather + copy-out
    and next all-gather").

    torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py ``wait_for_unshard`` (lines 417-489): in
    forward, ``if prev_all_gather_state := self.comm_ctx.all_gather_state:`` binds the previous unit's
    ``AllGatherState`` to a local name, and ``self.comm_ctx.all_gather_state = None  # free the all-gather result``
    drops only the context's reference; the local one holds the previous all-gather output through
    ``foreach_all_gather_copy_out`` (_fsdp_collectives.py line 463, ``alloc_all_gather_outputs``: the unsharded
    parameters) until the method returns. Then this unit's result is kept as the new ``AllGatherState`` ("Defer free
    to allow for overlap", lines 476-485) until the next unit's ``wait_for_unshard`` returns, or, for the last one,
    the root's ``_post_forward`` (_fsdp_state.py lines 335-342). That is Python reference counting, alike on every
    device: on CUDA the all-gather runs with ``async_op=False`` on FSDP2's all-gather stream and the buffers are
    guarded by events (``_wait_all_gather_streams_on_event``), not by ``record_stream``, so the caching allocator
    counts the buffer active until the last reference goes, as the CPU cells measure (gloo, N=2 and 3); a
    collective stream could only keep it longer. No honest prediction of torch 2.13 meets this budget for the step run
    alone (a fresh process); in PyTorch's order of subtests its base is higher and the budget holds
    (tests/test_pytorch_fsdp2_budgets.py)."""
    records, _ = _run(*TORCH_TRANSFORMER, "world_size=2", "batch_size=1", "device=cuda", "foreach=false",
                      "strategies=[fsdp2_grad_op]")
    r, n = records[0], _torch_transformer_numels()
    assert r["param_bytes"] == 4 * n["sharded"]  # no padding: every dim-0 is even
    # At the last block's copy-out: every unit unsharded, two all-gather outputs, and the activations of the one
    # (1, 4) input so far (under 1 MB)
    activations = r["phase_bytes"]["forward"] - 4 * (n["unsharded"] + 2 * n["block"])
    assert 0 < activations < 1e6, activations
    excess = _first_step_mb(r)["forward"] - _pytorch_budgets(False)["forward"]
    assert abs(excess - (4 * n["block"] / 1e6 - BUFFER_MB + activations / 1e6)) < 1e-9, excess
    assert excess > 0


@pytest.mark.skipif(not TT, reason="expecttest is not installed (PyTorch's test Transformer imports it)")
def test_pytorchs_budgets_name_what_the_prediction_leaves_out():
    """AdamW's foreach update (torch's CUDA default) exceeds the optimizer budget by its list of the whole shard, as
    PyTorch's test says ("Do not use foreach since intermediates increase peak memory"); the CPU-offload case has no
    prediction: its row plans the state on the host and names the peak as not modelled."""
    foreach, _ = _run(*TORCH_TRANSFORMER, "world_size=2", "batch_size=1", "device=cuda", "strategies=[fsdp2_full]")
    r = foreach[0]
    assert r["phase_bytes"]["optimizer"] == r["param_bytes"]  # the _foreach_sqrt list: every local shard at once
    assert _first_step_mb(r)["optimizer"] > _pytorch_budgets(True)["optimizer"]
    offload, notes = _run(*TORCH_TRANSFORMER, "world_size=2", "batch_size=1", "device=cuda", "offload=full",
                          "strategies=[fsdp2_full]")
    (row,) = offload  # CPUOffloadPolicy: the state planned on the host, the peak n/a with its reason
    assert row["device_bytes"] == 0 and row["host_bytes"] > 0 and row["peak_bytes"] is None
    assert row["peak_note"].startswith("no peak model yet for offload=full")


# -- The caching allocator (c10/cuda/CUDACachingAllocator.cpp): reserved memory beside allocated.
def test_the_allocators_rounding_and_segments_are_its_sources():
    from zeroexp.formulas.peak.allocator import round_size, segment_size

    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(1) == segment_size(MiB) == 2 * MiB  # the small pool's 2 MiB segments
    assert segment_size(MiB + 1) == segment_size(10 * MiB - 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB  # rounded to 2 MiB


def test_the_allocator_splits_caches_and_merges_blocks():
    from zeroexp.formulas.peak.allocator import CachingAllocator

    a = CachingAllocator()
    small = [a.malloc(MiB // 2) for _ in range(5)]  # 0.5 MiB blocks: four fill a 2 MiB segment, the fifth opens one
    assert a.reserved == 4 * MiB and a.allocated == 5 * MiB // 2
    x, y = a.malloc(3 * MiB), a.malloc(3 * MiB)  # one 20 MiB segment, split
    assert a.reserved == 24 * MiB
    a.free(x), a.free(y)
    z = a.malloc(18 * MiB)  # the freed blocks merged with the rest: 20 MiB free, 18 taken, 2 MiB (> 1 MiB) split off
    assert a.reserved == 24 * MiB
    a.malloc(2 * MiB)  # fits the split-off rest exactly
    assert a.reserved == 24 * MiB
    a.malloc(MiB + 512)  # nothing cached fits: a new 20 MiB segment
    assert a.reserved == 44 * MiB and a.peak_reserved == 44 * MiB
    a.free(z)
    for i in small:
        a.free(i)
    assert a.allocated == 2 * MiB + MiB + 512 and a.reserved == a.peak_reserved == 44 * MiB  # segments are kept


def test_reserved_peak_reuses_segments_across_phases():
    from zeroexp.formulas.peak.allocator import reserved_peak

    steady = {"parameters": 100 * MiB, "gradients": 100 * MiB}
    # backward frees the steady gradients (zero_grad) and holds 30 MiB of comm: both fit the freed 100 and 50 MiB
    reserved, allocated = reserved_peak(steady, [{"activations": 50 * MiB}, {"gradients": -50 * MiB,
                                                                             "comm": 30 * MiB}])
    assert (reserved, allocated) == (250 * MiB, 250 * MiB)
    # a phase block larger than any cached one takes a segment of its own
    reserved, _ = reserved_peak(steady, [{"activations": 50 * MiB}, {"optimizer_state": 60 * MiB}])
    assert reserved == 310 * MiB


@pytest.mark.parametrize("prefetch", ["pre", "post"])
def test_planner_rows_on_cuda_carry_reserved_and_fit_on_it(prefetch):
    records, _ = _run("model=seed_ch31", "world_size=4", "bucket_cap_mb=64", "batch_size=8", "device=cuda",
                      "compute_capability=7.0", f"prefetch={prefetch}", "device_memory=1GiB",
                      "strategies=[ddp,zro,fsdp_grad_op,fsdp_full]")
    for r in records:
        # never below allocated; above it by no more than each modelled block's segment rounding
        assert r["peak_bytes"] <= r["reserved_peak_bytes"] <= r["peak_bytes"] + 12 * 20 * MiB, r["strategy"]
        assert r["reserved_peak_bytes"] % (2 * MiB) == 0  # every segment a multiple of 2 MiB
        # no network: NCCL's topology unknown (no NCCL term); the CUDA context beside reserved
        assert r["nccl_bytes"] is None and r["fits_on"] == "reserved" and r["beside_bytes"] == r["context_bytes"]
        assert r["fits_bytes"] == r["reserved_peak_bytes"] + r["context_bytes"]
        assert r["fits"] == (r["fits_bytes"] <= r["usable_memory_bytes"])
    cpu, _ = _run("model=seed_ch31", "world_size=4", "batch_size=8", "device=cpu", "strategies=[ddp]")
    assert cpu[0]["reserved_peak_bytes"] is None and cpu[0]["fits_on"] != "reserved"


def _cuda_measurement(section: dict | None, n: int, steady: int, reserved: int) -> dict:
    """A CUDA cell's memory section as the probe writes it (``source`` torch.cuda, every rank alike): each phase at the
    allocated peak ``section`` predicted (or 1 GB above steady without one), ``reserved`` bytes reserved."""
    phases = {ph: {"peak_bytes": steady + (section["phases"][ph]["predicted_bytes"] if section else 10**9),
                   "by_category": {}} for ph in ("forward", "backward", "optimizer")}
    res = {"steady_bytes": reserved, "phases": {ph: reserved for ph in phases}}
    return {"memory": {"source": "torch.cuda caching allocator: ...", "max_rank": 0, "steady_bytes": [steady] * n,
                       "phases_of_max_rank": phases, "phases_by_rank": [phases] * n,
                       "steady_categories_of_max_rank": {}, "steady_categories_by_rank": [{}] * n,
                       "reserved_of_max_rank": res, "reserved_by_rank": [res] * n, "compute_capability": 9.0}}


@pytest.mark.parametrize("strategy", ["fsdp2_full", "ddp"])
def test_a_cuda_cells_allocated_and_reserved_phases_are_judged_on_cuda_semantics(compose, strategy):
    """The check a GPU cell's plan.memory runs, fed the probe's torch.cuda section: allocated per phase with the CUDA
    semantics (AdamW's foreach list in the optimizer phase), reserved per phase at least the allocator's model."""
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.cell.resolved import layout_of
    from zeroexp.plan.check.memory import memory_section
    from zeroexp.plan.shape import model_shape

    cfg = compose(f"strategy={strategy}", "world_size=2", "model=mlp", "batch_size=4")
    name = layout_of(cfg)[0]
    args = (name, cell_groups(Cell.of(cfg)), 4, [import_class(p) for p in wrap_paths(cfg)], model_shape(cfg.model,
                                                                                                wrap_paths(cfg)))
    first = memory_section(Cell.of(cfg), _cuda_measurement(None, 2, 10**8, 10**10), *args)
    exact = memory_section(Cell.of(cfg), _cuda_measurement(first, 2, 10**8, 10**10), *args)
    assert exact["check"] == "PASS", exact["reasons"]
    phases = exact["phases"]
    want = phases["forward"]["predicted_reserved_bytes"]
    assert all(phases[ph]["predicted_reserved_bytes"] == want and phases[ph]["reserved_check"] == "PASS"
               for ph in ("forward", "backward", "optimizer"))
    if strategy == "ddp":  # the optimizer phase holds foreach's list: as many bytes as the parameters
        numels = cell_groups(Cell.of(cfg)).numels
        assert phases["optimizer"]["predicted_bytes"] == counted_sum((k * 4 for k in numels), 512)
    # below the allocator's model of the same live bytes: a FAIL naming reserved
    low = memory_section(Cell.of(cfg), _cuda_measurement(first, 2, 10**8, want - 512), *args)
    assert low["check"] == "FAIL" and low["reason_codes"]
    assert set(low["reason_codes"]) == {Code.MEMORY_RESERVED_BELOW_PREDICTION}
    assert phases["steady"]["measured_reserved_bytes"] == 10**10


def test_the_allocator_fits_and_merges_blocks_as_a_scan_of_every_block_would():
    """``CachingAllocator`` finds a request's best fit by bisection of each pool's sorted free blocks and a freed
    block's neighbours by offset: over random mallocs and frees of every pool's sizes, the same block ids, blocks,
    allocated, reserved and peaks as an allocator that scans every block for both (the smallest free block of the
    request's pool that fits, the lowest segment, offset and id on ties; the free neighbours that touch it)."""
    import random

    from zeroexp.formulas.peak.allocator import (MIN_BLOCK, SMALL_SIZE, CachingAllocator, round_size,
                                                 segment_size)

    class Scan:
        def __init__(self):
            self._blocks, self._small, self._next = {}, [], 0
            self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

        def malloc(self, nbytes):
            size = round_size(nbytes)
            small = size <= SMALL_SIZE
            fits = [(b[2], b[0], b[1], i) for i, b in self._blocks.items()
                    if b[3] and b[2] >= size and self._small[b[0]] == small]
            if fits:
                i = min(fits)[3]
            else:
                self._small.append(small)
                self.reserved += segment_size(size)
                self.peak_reserved = max(self.peak_reserved, self.reserved)
                i = self._new(len(self._small) - 1, 0, segment_size(size))
            block = self._blocks[i]
            rest = block[2] - size
            if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
                block[2] = size
                self._new(block[0], block[1] + size, rest)
            block[3] = False
            self.allocated += block[2]
            self.peak_allocated = max(self.peak_allocated, self.allocated)
            return i

        def _new(self, seg, off, size):
            self._blocks[self._next] = [seg, off, size, True]
            self._next += 1
            return self._next - 1

        def free(self, i):
            block = self._blocks[i]
            block[3] = True
            self.allocated -= block[2]
            for j, other in list(self._blocks.items()):
                if j != i and other[3] and other[0] == block[0] and other[1] + other[2] == block[1]:
                    block[1], block[2] = other[1], block[2] + other[2]
                    del self._blocks[j]
            for j, other in list(self._blocks.items()):
                if j != i and other[3] and other[0] == block[0] and block[1] + block[2] == other[1]:
                    block[2] += other[2]
                    del self._blocks[j]

    rnd = random.Random(1)
    for _ in range(100):
        fast, scan, live = CachingAllocator(), Scan(), []
        for _ in range(rnd.randint(1, 150)):
            if live and rnd.random() < 0.45:
                i, j = live.pop(rnd.randrange(len(live)))
                fast.free(i)
                scan.free(j)
            else:
                n = rnd.choice([rnd.randint(1, 4096), rnd.randint(1, 3 << 20), rnd.randint(1, 40 << 20)])
                live.append((fast.malloc(n), scan.malloc(n)))
                assert live[-1][0] == live[-1][1]
            assert fast._blocks == scan._blocks
            assert (fast.allocated, fast.reserved, fast.peak_allocated, fast.peak_reserved) == \
                   (scan.allocated, scan.reserved, scan.peak_allocated, scan.peak_reserved)
