"""FSDP2 cells and the dry run: fully_shard on the ladder's probes; a dry run on a fake process group
gives the real run's state and collectives, and a multi-billion-parameter model at N=1024 on one CPU process."""

from __future__ import annotations

import json

import pytest

from conftest import read_csv
from zeroexp.cell.identity import cell_id, cell_name
from zeroexp.rank.dryrun import ABSENT

WIDTH, DEPTH = 64, 8  # conftest BASE: model.width=64, the mlp's default depth
P = WIDTH * WIDTH * DEPTH * 4  # 128 KiB of fp32 parameters: 8 Linear units of 16 KiB
DRY = "dry_run=true"
#: fsdp2_full gathers every unit in forward and again in backward; fsdp2_grad_op only in forward.
FINGERPRINT = {"fsdp2_full": {"all_gather": (2 * DEPTH, 2 * P), "reduce_scatter": (DEPTH, P)},
               "fsdp2_grad_op": {"all_gather": (DEPTH, P), "reduce_scatter": (DEPTH, P)}}
#: Cells whose dry run must equal the real run; the fsdp_full overrides are those of tests/test_state.py.
PAIRS = [(("strategy=fsdp_full", "prefetch=pre"), n) for n in (2, 4)] + [(("strategy=fsdp2_full",), n) for n in (2, 4)]
# accumulation: the dry run trains through the real run's loop, its micro-batches in no_sync as the real run's
PAIRS += [(("strategy=fsdp_grad_op", "grad_accum=2"), 2), (("strategy=fsdp2_full", "grad_accum=2"), 2)]


def _ids(v):
    return "-".join(x.split("=")[1] for x in v) if isinstance(v, tuple) else f"n{v}"


@pytest.mark.parametrize("strategy", list(FINGERPRINT))
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_cell_factors_counts_and_equivalence(cell, strategy, world_size):
    r = cell(f"strategy={strategy}", f"world_size={world_size}")
    assert r.status == "ok", r.error
    s, c, n = r.summary["state"], r.summary["collectives"], world_size
    assert s["check"] == "PASS", s["reasons"]
    assert {k: s["factors"][k] for k in ("param", "grad", "optim")} == {"param": 1.0, "grad": 1.0, "optim": 2.0}
    assert s["factors"]["param_unsharded"] == 0.0  # every unit resharded at the optimizer boundary
    assert s["max_rank_bytes"]["param"] == s["max_rank_bytes"]["grad"] == P // n and s["padding_bytes"] == 0
    assert c["check"] == "PASS", c["reasons"]
    want = FINGERPRINT[strategy]
    assert c["counts"] == {op: k for op, (k, _) in want.items()} == c["expected_counts"]
    assert c["payload_bytes"] == {op: b for op, (_, b) in want.items()} == c["expected_payload_bytes"]
    assert c["dtypes"] == {"all_gather": "float32", "reduce_scatter": "float32"}
    assert r.summary["equivalence"]["check"] == "PASS", r.summary["equivalence"]
    m = r.summary["memory"]  # the CPU memory probe follows DTensors: at least the 4P/N of model state
    assert m["steady_bytes_max"] >= 4 * P // n and m["peak_bytes_max"] >= m["steady_bytes_max"]
    assert r.summary["timing"]["timed_steps"] > 0


def test_fsdp2_padding_is_per_parameter_on_dim0(cell):
    # width 10 at N=3: each 10 x 10 weight is chunked into 4 + 4 + 2 rows, every chunk padded to 4 rows.
    r = cell("strategy=fsdp2_full", "world_size=3", "model.width=10")
    assert r.status == "ok", r.error
    s, c = r.summary["state"], r.summary["collectives"]
    assert s["check"] == "PASS" and c["check"] == "PASS", (s["reasons"], c["reasons"])
    padded = 12 * 10 * 4 * DEPTH  # 3 chunks of 4 rows per weight, gathered and reduced
    assert c["payload_bytes"] == {"all_gather": 2 * padded, "reduce_scatter": padded}
    frame = read_csv(r, "rank_state.csv").set_index(["rank", "kind"])
    assert [frame.loc[(k, "param"), "logical_bytes"] for k in range(3)] == [4 * 40 * DEPTH] * 2 + [2 * 40 * DEPTH]
    assert [frame.loc[(k, "param"), "physical_bytes"] for k in range(3)] == [4 * 40 * DEPTH] * 3  # padded chunks
    assert r.summary["equivalence"]["check"] == "PASS"


def test_fsdp2_bf16_through_mixed_precision_policy(cell):
    r = cell("strategy=fsdp2_full", "world_size=2", "precision=bf16")
    assert r.status == "ok", r.error
    c, s = r.summary["collectives"], r.summary["state"]
    assert c["check"] == "PASS" and c["dtypes"] == {"all_gather": "bfloat16", "reduce_scatter": "bfloat16"}
    assert c["payload_bytes"] == {"all_gather": P, "reduce_scatter": P // 2}  # 2P and P in 2-byte elements
    assert s["check"] == "PASS" and read_csv(r, "rank_state.csv").query("kind == 'param'").dtype.eq("float32").all()
    assert r.summary["equivalence"]["check"] == "PASS", r.summary["equivalence"]


@pytest.mark.parametrize("overrides, world_size", PAIRS, ids=_ids)
def test_dry_run_equals_the_real_run(cell, overrides, world_size):
    real, dry = cell(*overrides, f"world_size={world_size}"), cell(*overrides, f"world_size={world_size}", DRY)
    assert real.status == "ok" and dry.status == "ok", (real.error, dry.error)
    rs, ds = real.summary["state"], dry.summary["state"]
    assert ds["check"] == "PASS", ds["reasons"]
    for key in ("factors", "physical_factors", "expected", "max_rank_bytes", "logical_param_bytes", "padding_bytes"):
        assert ds[key] == rs[key], key
    rows = ["kind", "logical_bytes", "physical_bytes", "dtype", "device", "numel"]
    real_rank0 = read_csv(real, "rank_state.csv").query("rank == 0")[rows].reset_index(drop=True)
    assert read_csv(dry, "rank_state.csv")[rows].equals(real_rank0)
    rc, dc = real.summary["collectives"], dry.summary["collectives"]
    assert dc["check"] == "PASS", dc["reasons"]
    for key in ("counts", "dtypes", "payload_bytes", "bus_bytes", "expected_counts", "expected_payload_bytes",
                "param_bytes", "profiled_steps"):
        assert dc[key] == rc[key], key
    assert read_csv(dry, "collectives.csv").equals(read_csv(real, "collectives.csv").query("rank == 0")
                                                   .reset_index(drop=True))
    assert dry.summary["plan"]["check"] == real.summary["plan"]["check"] == "PASS"


def test_dry_run_directory_says_what_it_is_and_leaves_out_what_it_cannot_measure(cell, compose):
    r = cell("strategy=fsdp2_full", "world_size=2", DRY)
    manifest = json.loads((r.cell_dir / "manifest.json").read_text())
    assert manifest["mode"] == "dry_run" and manifest["backend"] == "fake" and manifest["status"] == "ok"
    assert [x["rank"] for x in manifest["ranks"]] == [0] and manifest["world_size"] == 2
    assert r.summary["mode"] == "dry_run" and r.summary["dry_run"]["source"].startswith("traced")
    simulated = {"memory"}  # a traced dry run's memory probe runs over fake storages: simulated, not absent
    assert set(r.summary["dry_run"]["absent"]) == set(ABSENT) - simulated
    for section in (*(set(ABSENT) - simulated), "final_loss"):
        assert section not in r.summary, section
    assert not (r.cell_dir / "iterations.csv").exists() and (r.cell_dir / "memory.csv").exists()
    assert r.summary["memory"]["simulated"] is True and r.summary["memory"]["source"].startswith("simulated")
    assert r.summary["state"]["factors_basis"].startswith("rank 0 x world_size")
    real, dry = compose("strategy=fsdp2_full", "world_size=2"), compose("strategy=fsdp2_full", "world_size=2", DRY)
    assert cell_id(dry) != cell_id(real) and "_n2_dry_" in cell_name(dry) and "dry" not in cell_name(real)


@pytest.mark.parametrize("strategy", ["fsdp_full", "fsdp2_full"])
def test_a_dry_run_with_padding_checks_rank_0_against_the_formulas(cell, strategy):
    """N=3 does not divide the GPT's units (FSDP1) nor its parameters' dim 0 (FSDP2): rank 0 holds more than the last
    ranks, so rank 0 x N is above the strategy's factors by the padding, and the state check compares it with rank 0's
    bytes by the formulas x N, exactly, as plan.state compares rank 0 itself."""
    r = cell("model=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.seq_len=8",
             "model.vocab_size=50", f"strategy={strategy}", "world_size=3", DRY,
             base=("logger=none", "steps=6", "warmup_steps=0"))
    state = r.summary["state"]
    assert state["check"] == "PASS" and r.summary["plan"]["state"]["check"] == "PASS", state["reasons"]
    for kind in ("param", "grad", "optim"):  # above the closed form: the last ranks' padding
        assert state["factors"][kind] > state["expected"][kind] > 0, kind


@pytest.mark.parametrize("strategy, want", [("ddp", {"all_reduce": (2, P)}),
                                            ("zro", {"all_reduce": (2, P), "broadcast": (DEPTH, P)})])
def test_dry_run_derives_ddp_and_zro_and_says_so(cell, strategy, want):
    # The reference fingerprints of tests/test_collectives.py (64 KiB buckets, N=4), without running a rank.
    r = cell(f"strategy={strategy}", "world_size=4", "strategy.bucket_cap_mb=0.0625", DRY)
    assert r.status == "ok", r.error
    c, s = r.summary["collectives"], r.summary["state"]
    assert r.summary["dry_run"]["source"].startswith("derived") and c["source"].startswith("derived")
    assert c["check"] == "n/a" and c["counts"] == {op: k for op, (k, _) in want.items()}
    assert c["payload_bytes"] == {op: b for op, (_, b) in want.items()}
    n = 4
    assert s["check"] == "PASS" and s["factors"]["param"] == n
    assert s["factors"]["optim"] == (2 * n if strategy == "ddp" else 2)
    assert sorted(read_csv(r, "rank_state.csv")["rank"].unique()) == list(range(n))  # formulas give every rank


def test_billions_of_parameters_at_1024_ranks_on_one_cpu(cell):
    width, depth, n = 8192, 64, 1024  # 4.3e9 parameters, 17 GB of fp32 parameters
    psi = width * width * depth
    r = cell("strategy=fsdp2_full", f"world_size={n}", f"model.width={width}", f"model.depth={depth}",
             "warmup_steps=0", "probes.profile_steps=1", "probes.memory_steps=1", "batch_size=1", DRY)
    assert r.status == "ok", r.error
    manifest = json.loads((r.cell_dir / "manifest.json").read_text())
    assert manifest["duration_s"] < 60  # the bound for this machine; typically ~20 s
    assert r.summary["dry_run"]["max_rss_bytes"] < 4 * psi / 10  # never allocated: far under the model's size
    s, c = r.summary["state"], r.summary["collectives"]
    assert s["check"] == "PASS" and c["check"] == "PASS", (s["reasons"], c["reasons"])
    assert s["max_rank_bytes"]["param"] == s["max_rank_bytes"]["grad"] == 4 * psi // n  # exactly 4P/N
    assert s["max_rank_bytes"]["optim"] == 8 * psi // n
    assert c["counts"] == {"all_gather": 2 * depth, "reduce_scatter": depth}
    assert c["payload_bytes"] == {"all_gather": 2 * 4 * psi, "reduce_scatter": 4 * psi}


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_dry_run_derives_the_real_run(cell, stage):
    """DeepSpeed needs real storage (its engine), so a dry run derives it from the planner's row of its stage
    (zeroexp.formulas.LAYOUTS deepspeed_stage<k>, DeepSpeed 0.19 as measured): equal to the real N=2 run."""
    from zeroexp.strategies.deepspeed import deepspeed_available

    if not deepspeed_available():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    overrides = ("strategy=deepspeed", "world_size=2", f"strategy.stage={stage}")  # as tests/test_deepspeed.py
    real, dry = cell(*overrides), cell(*overrides, DRY)
    assert real.status == dry.status == "ok", (real.error, dry.error)
    assert dry.summary["dry_run"]["source"].startswith("derived")
    assert f"DeepSpeed 0.19 stage {stage}" in dry.summary["collectives"]["source"]
    for key in ("factors", "max_rank_bytes", "physical_factors"):
        assert dry.summary["state"][key] == real.summary["state"][key], key
    for key in ("counts", "payload_bytes"):
        assert dry.summary["collectives"][key] == real.summary["collectives"][key], key
    # the derived dry run's plan is the planner's own model: its check cannot fail, so it reads n/a
    assert real.summary["plan"]["check"] == "PASS" and dry.summary["plan"]["check"] == "n/a"
    assert dry.summary["plan"]["predicted_bytes"] == real.summary["plan"]["predicted_bytes"]


def test_lazy_chunks_equal_torchs_shards():
    """The dry run's FSDP2 shards (zeroexp.rank.dryrun.LazyChunks, made only when asked) equal torch's
    ``_chunk_with_empty``: the same number, and each the same view (shape, stride, storage offset, values), empty
    past the last element; on real and fake tensors, uneven sizes, fewer elements than ranks, a nonzero dim; and
    under ``lazy_fsdp2_chunks`` FSDP2's module reads the lazy form, its own afterwards."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from zeroexp.rank.dryrun import LazyChunks, lazy_fsdp2_chunks

    def same(a, b, real):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
        if real and a.numel():
            assert torch.equal(a, b) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    shapes = [((10,), 4, 0), ((3,), 8, 0), ((8,), 8, 0), ((9,), 1, 0), ((1,), 1024, 0), ((1000, 3), 7, 0),
              ((4, 10), 4, 1), ((4, 6), 3, 1), ((5, 2), 1024, 0)]
    for shape, n, dim in shapes:
        real = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        for tensor, is_real in ((real, True), (FakeTensorMode().from_tensor(real), False)):
            ours, torchs = LazyChunks(tensor, n, dim), _chunk_with_empty(tensor, n, dim)
            assert len(ours) == len(torchs) == n, (shape, n)
            for i in (*range(min(n, 12)), n - 1, -1):
                same(ours[i], torchs[i], is_real)
            assert [tuple(c.shape) for c in ours[: min(n, 12)]] == [tuple(c.shape) for c in torchs[: min(n, 12)]]
    with pytest.raises(IndexError):
        LazyChunks(torch.zeros(4), 2, 0)[2]
    original = _fsdp_param._chunk_with_empty
    with lazy_fsdp2_chunks():
        assert isinstance(_fsdp_param._chunk_with_empty(torch.zeros(4), 2, 0), LazyChunks)
        assert isinstance(_fsdp_param._chunk_with_empty(torch.zeros(0), 2, 0), list)  # empty: torch's own
    assert _fsdp_param._chunk_with_empty is original
