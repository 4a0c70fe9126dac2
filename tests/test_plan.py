"""The planner: the ZeRO paper's Figure 1, stage ordering, N=1, planned == measured on real cells,
a 34B-parameter model planned on the meta device, and the ``python -m zeroexp.plan`` command line."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time

import pytest
from torch import nn

from conftest import read_csv, run_cli
from zeroexp.formulas import (LAYOUTS, ModelShape, derive_groups, rank_state_bytes,
                              sharded_zero_rank_bytes, zero_state_factors)
from zeroexp.plan import Precision, parse_bytes, plan, strategy_table
from zeroexp.cli.plan import register, run
from zeroexp.plan.shape import shape_of
from zeroexp.models import LinearStack

PAPER = ["zero_stage0", "zero_stage1", "zero_stage2", "zero_stage3"]
DEEPSPEED = [f"deepspeed_stage{s}" for s in range(4)]
FIGURE_1 = [120.0, 31.4, 16.6, 1.9]  # GB per device: 7.5B parameters, N = 64, mixed-precision Adam (K = 12)
PRECISIONS = {"fp32": Precision("fp32", "float32"), "bf16": Precision("bf16", "bfloat16"),
              "fp16": Precision("fp16", "float16")}
MLP = shape_of(LinearStack(64, 8), [nn.Linear])  # the conftest cells' model: 8 x Linear(64, 64), one FSDP unit each


def _state(name, shape, n, itemsize):
    """rank_state_bytes of row ``name`` over the groups it derives from ``shape`` (default knobs)."""
    layout = LAYOUTS[name]
    return rank_state_bytes(layout, derive_groups(name, layout, shape, n, itemsize), itemsize)


def _totals(names, shape, n, precision, **kw):
    records, _ = plan(shape, [n], precision, strategies=names, **kw)
    return {r["strategy"]: r for r in records}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_figure_1(precision):
    shape = ModelShape.from_count(7_500_000_000)
    # DeepSpeed 0.19's stage 1 partitions the gradients too (it frees the full ones once reduced): its stage 1
    # holds what its stage 2 does, P_os+g's 16.6 GB, not P_os's 31.4.
    deepspeed = [FIGURE_1[0], FIGURE_1[2], FIGURE_1[2], FIGURE_1[3]]
    for family, want in ((PAPER, FIGURE_1), (DEEPSPEED, deepspeed), ([None, "zero1", "zero2", None], FIGURE_1)):
        records = _totals([s for s in family if s], shape, 64, PRECISIONS[precision])
        got = [round(records[s]["total_bytes"] / 1e9, 1) if s else w for s, w in zip(family, want)]
        assert got == want, (family, got)
    paper = _totals(PAPER, shape, 64, PRECISIONS[precision])
    for stage in (1, 2):  # the same closed form as zeroexp.formulas.sharded_zero_rank_bytes, to the byte
        assert paper[f"zero_stage{stage}"]["total_bytes"] == sharded_zero_rank_bytes(stage, 7_500_000_000, 64)
    assert paper["zero_stage3"]["total_bytes"] == 16 * 7_500_000_000 // 64


@pytest.mark.parametrize("shape", [ModelShape.from_count(7_500_000_000), MLP], ids=["count", "mlp"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_each_stage_never_above_the_previous(shape, precision):
    ladders = [PAPER, DEEPSPEED, ["zero1", "zero2"], ["ddp", "zro", "fsdp_grad_op", "fsdp_full"],
               ["fsdp2_grad_op", "fsdp2_full"]]
    for n in (1, 2, 3, 8, 64, 1024):
        records = _totals(None, shape, n, PRECISIONS[precision])
        for ladder in ladders:
            steps = [(records[a], records[b]) for a, b in zip(ladder, ladder[1:]) if a in records and b in records]
            for lo, hi in steps:
                if n == 1 and hi["master_bytes"] > lo["master_bytes"]:
                    # One rank shards nothing, and DeepSpeed stage 1 keeps an fp32 master even in fp32 training:
                    # 20 bytes a parameter against stage 0's 16. From N = 2 on, 12/N < 8 and the order holds.
                    assert hi["total_bytes"] == lo["total_bytes"] + hi["master_bytes"] - lo["master_bytes"]
                else:
                    assert hi["total_bytes"] <= lo["total_bytes"], (lo["strategy"], hi["strategy"], n)
    assert len(_totals(PAPER, shape, 8, PRECISIONS[precision])) == 4  # the paper's stages cover every precision


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_one_rank_holds_the_unsharded_totals(precision):
    p = PRECISIONS[precision]
    for shape in (MLP, ModelShape.from_count(2 * (10**9 + 1))):  # even: DeepSpeed pads its flat groups to 2N
        psi = shape.numel
        for name, r in _totals(None, shape, 1, p).items():
            layout = strategy_table()[name]
            master = 4 * psi if layout.master == "always" or (layout.master == "mixed" and precision != "fp32") else 0
            c = 4 if layout.fp32_at_rest else p.itemsize  # FSDP2 keeps fp32 shards, computes in the precision
            assert (r["param_bytes"], r["grad_bytes"], r["optim_bytes"], r["master_bytes"]) == \
                (c * psi, c * psi, 8 * psi, master), name
            assert r["total_bytes"] == r["device_bytes"] == 2 * c * psi + 8 * psi + master
            assert r["host_bytes"] == 0
            # One rank: ring factors are 0; nccl-tests' broadcast (and reduce) factor is 1 whatever N.
            assert all(bus == 0 for op, bus in r["bus_bytes"].items() if op not in ("broadcast", "reduce"))


def test_fp32_paper_stages_are_zero_state_factors():
    """The planner and the state probe's check share zeroexp.formulas: per-rank bytes x N / P = the factors."""
    for n in (1, 4, 64):
        for stage in range(4):
            state = _state(f"zero_stage{stage}", MLP, n, 4)
            factors = {k: sum(ph for _, ph in state[k]) / (4 * MLP.numel) for k in ("param", "grad", "optim")}
            assert factors == zero_state_factors(stage, n) and "master" not in state


def test_reference_experiment_table():
    """The reference write-up's table (seed_ch31, N=4, fp32): max-rank P / G / O MiB 128/128/256, 128/128/64,
    32/32/64."""
    shape = shape_of(LinearStack(2048, 8), [nn.Linear])
    mib = {s: tuple(r[f"{k}_bytes"] // 2**20 for k in ("param", "grad", "optim"))
           for s, r in _totals(["ddp", "zro", "fsdp_grad_op", "fsdp_full"], shape, 4, PRECISIONS["fp32"]).items()}
    assert mib == {"ddp": (128, 128, 256), "zro": (128, 128, 64), "fsdp_grad_op": (32, 32, 64),
                   "fsdp_full": (32, 32, 64)}


def test_offload_moves_state_to_the_host():
    shape, p = ModelShape.from_count(7_500_000_000), PRECISIONS["bf16"]
    opt = _totals(["zero_stage1", "zero_stage2", "zero_stage3"], shape, 64, p, offload="optimizer")
    full = _totals(["zero_stage3"], shape, 64, p, offload="full")["zero_stage3"]
    for name, r in opt.items():
        grads = r["grad_bytes"] if name != "zero_stage1" else 0  # ZeRO-Offload: the gradient partition goes too
        assert r["host_bytes"] == r["optim_bytes"] + r["master_bytes"] + grads
        assert r["device_bytes"] + r["host_bytes"] == r["total_bytes"]
    assert full["device_bytes"] == 0 and full["host_bytes"] == full["total_bytes"]
    records, notes = plan(shape, [64], p, offload="optimizer")
    assert not any(r["strategy"] == "ddp" for r in records) and any(n.startswith("ddp:") for n in notes)


def test_every_registered_strategy_has_a_row():
    from zeroexp.strategies import registered

    table = strategy_table()
    # each strategy's YAML names its row (strategy.layout); deepspeed's follows strategy.stage: deepspeed_stage<k>;
    # fsdp_hybrid's strategy.sharding: fsdp_<sharding>
    assert set(registered()) - {"deepspeed", "fsdp_hybrid"} <= set(table) and set(PAPER + DEEPSPEED) <= set(table)
    assert {"fsdp_HYBRID_SHARD", "fsdp__HYBRID_SHARD_ZERO2"} <= set(table)
    assert [layout.stage for layout in table.values()] == sorted(layout.stage for layout in table.values())


def test_sizes():
    assert parse_bytes("32GB") == 32 * 10**9 and parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 MiB") == 2**29 and parse_bytes(1e9) == 10**9
    with pytest.raises(ValueError):
        parse_bytes("lots")


# --- planned == measured, on the cells the other test modules run too ------------------------------------
STRATEGIES = [("strategy=ddp",), ("strategy=zro",), ("strategy=zero1",), ("strategy=zero2",),
              ("strategy=fsdp_grad_op",), ("strategy=fsdp_full", "prefetch=pre"), ("strategy=fsdp2_grad_op",),
              ("strategy=fsdp2_full",)]


def _check_plan(r):
    """The cell's plan section says PASS with no difference; returns it, rank_state.csv, the strategy and N."""
    assert r.status == "ok", r.error
    section, frame = r.summary["plan"], read_csv(r, "rank_state.csv")
    assert section["check"] == "PASS", section["reasons"]
    assert section["payload_check"] == "PASS", section["payload"]
    assert set(section["difference_bytes"].values()) == {0}
    assert section["predicted_bytes"] == section["measured_bytes"]
    return section, frame, r.summary["cell"]["strategy"], r.summary["world_size"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overrides", STRATEGIES, ids=lambda o: o[0].split("=")[1])
def test_planned_state_bytes_equal_measured(cell, overrides, world_size):
    r = cell(*overrides, f"world_size={world_size}")
    section, frame, strategy, n = _check_plan(r)
    state = _state(strategy, MLP, n, 4)  # independently of plan_section
    for kind, per_rank in state.items():  # optim_scalar too: Adam's step scalars, the explained residual
        rows = frame[frame.kind == kind].sort_values("rank")
        assert list(zip(rows.logical_bytes, rows.physical_bytes)) == per_rank, kind
    assert set(frame.kind) - set(state) <= {"param_unsharded"}
    assert (frame[frame.kind == "param_unsharded"].physical_bytes == 0).all()
    assert section["predicted_bytes"]["total"] == sum(section["predicted_bytes"][k] for k in section["predicted_bytes"]
                                                      if k != "total")


def test_planned_padding_equals_measured(cell):
    """FSDP pads each 10 x 10 unit to 102 elements over 3 ranks: the planner models it from the model's shapes."""
    r = cell("strategy=fsdp_full", "prefetch=pre", "world_size=3", "model.width=10")  # as in tests/test_state.py
    section, frame, _, _ = _check_plan(r)
    params = frame[frame.kind == "param"].sort_values("rank")
    assert (list(params.logical_bytes) == [8 * 34 * 4, 8 * 34 * 4, 8 * 32 * 4]
            and set(params.physical_bytes) == {8 * 34 * 4})


# --- a model far too big for this machine ------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_34b_model_plans_in_seconds_without_allocating():
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=["model=seed_ch31", "model.width=65536", "model.depth=8",
                                                     "world_size=[8,64,1024]", "device_memory=80GiB"])
    from zeroexp.strategies import registered

    registered()  # import the strategy modules first (composing the config does): not the planner's work
    rss, peak, start = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.perf_counter()
    records, notes = run(cfg)
    elapsed = time.perf_counter() - start
    grown = max(_rss() - rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak)
    numel = 8 * 65536 ** 2  # 34.4e9 parameters: 137 GB of fp32 weights alone
    assert elapsed < 10 and grown < 256 * 2**20, (elapsed, grown)
    full = {(r["strategy"], r["world_size"]): r for r in records}
    hybrid = [name for name, layout in strategy_table().items() if layout.hybrid]  # no shard_size=: a note each
    assert all(r["numel"] == numel for r in records) and len(records) == 3 * (len(strategy_table()) - len(hybrid))
    assert [n.split(":")[0] for n in notes] == [*hybrid, "device=cuda"]  # a device memory plans a GPU's semantics
    assert full["ddp", 8]["total_bytes"] == 16 * numel and not full["ddp", 8]["fits"]
    fsdp = full["fsdp_full", 1024]
    assert fsdp["largest_unit_bytes"] == fsdp["gather_floor_bytes"] == 4 * 65536 ** 2  # one Linear, unsharded
    assert fsdp["total_bytes"] == 16 * numel // 1024 and fsdp["fits"]


# --- the command line ------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m zeroexp.plan <args>`` in this process (conftest.run_cli), from the repository's root."""
    return run_cli(*args, app="zeroexp.cli.plan", cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FIG1_ARGS = ("params=7.5e9", "world_size=64", "precision=fp16", f"strategies=[{','.join(PAPER)}]")


def test_cli_json_reproduces_figure_1():
    out = _cli(*FIG1_ARGS, "format=json")
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)
    assert [r["strategy"] for r in records] == PAPER
    assert [round(r["total_bytes"] / 1e9, 1) for r in records] == FIGURE_1
    assert all(isinstance(r[k], int) for r in records for k in ("param_bytes", "grad_bytes", "optim_bytes",
                                                                 "master_bytes", "total_bytes", "host_bytes"))
    assert records[0]["payload_bytes"] == {"all_reduce": 2 * 7_500_000_000}
    assert records[3]["bus_bytes"]["all_gather"] == round(4 * 7_500_000_000 * 63 / 64)


def test_cli_table_says_its_unit():
    out = _cli(*FIG1_ARGS, "device_memory=32GB", "units=GB")  # the paper's unit
    assert out.returncode == 0, out.stderr
    assert "GB = 1e9 bytes" in out.stdout and "fits 28.8 GB (32.0 less 10 %)" in out.stdout
    for label, total in zip(("baseline", "P_os ", "P_os+g ", "P_os+g+p"), FIGURE_1):
        line = next(x for x in out.stdout.splitlines() if label in x)
        assert f" {total} " in line, line
    gib = _cli(*FIG1_ARGS)  # GiB by default, as a run reports
    assert gib.returncode == 0 and "GiB = 2^30 bytes" in gib.stdout and "111.8" in gib.stdout  # 120e9 / 2^30


@pytest.mark.parametrize("args, key", [(("params=1e9", "nosuchkey=1"), "nosuchkey"),
                                       (("params=1e9", "units=MB"), "units"),
                                       (("params=1e9", "device_memory=lots"), "device_memory"), ((), "params")])
def test_cli_refuses_bad_input_with_exit_2(args, key):
    out = _cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert key in out.stderr and "Traceback" not in out.stderr


def test_cli_fsdp2_knobs_as_in_a_cell():
    """The planner's ``reshard_after_forward``, ``forward_prefetch``, ``backward_prefetch`` and ``reduce_dtype`` are
    a cell's ``strategy.*`` keys of the FSDP2 rows: null gathers fsdp2_full's root once (fsdp2_hybrid passes true:
    unchanged); prefetch sends the same and raises the planned peak of the phase it prefetches in; reduce_dtype=float32
    under bf16 doubles what is reduced, and raises fsdp2_full's backward peak, where it lowers fsdp2_hybrid's (reduced
    in bf16, each unit's bf16 all-reduce buffer is held beside its fp32 gradient to backward's end; reduced in fp32,
    the buffer is the gradient: measured so on the mlp at N=4, 49,160 B against 43,016 B); bad values exit 2."""
    args = ("model=gpt", "model.n_embd=128", "world_size=4", "batch_size=2", "shard_size=2", "format=json",
            "strategies=[fsdp2_full,fsdp2_hybrid]")

    def rows(*more: str) -> dict[str, dict]:
        out = _cli(*args, *more)
        assert out.returncode == 0, out.stderr
        return {r["strategy"]: r for r in json.loads(out.stdout)}

    default, kept, ahead = rows(), rows("reshard_after_forward=null"), rows("forward_prefetch=3", "backward_prefetch=3")
    assert kept["fsdp2_full"]["counts"]["all_gather"] == default["fsdp2_full"]["counts"]["all_gather"] - 1
    assert kept["fsdp2_hybrid"]["counts"] == default["fsdp2_hybrid"]["counts"]
    for name in ("fsdp2_full", "fsdp2_hybrid"):
        assert ahead[name]["payload_bytes"] == default[name]["payload_bytes"]
        assert all(ahead[name]["phase_bytes"][ph] > default[name]["phase_bytes"][ph] for ph in ("forward", "backward"))
    bf16, fp32 = rows("precision=bf16"), rows("precision=bf16", "reduce_dtype=float32")  # reduced in fp32
    for name in ("fsdp2_full", "fsdp2_hybrid"):
        assert {op: 2 * b for op, b in bf16[name]["payload_bytes"].items() if op != "all_gather"} == \
            {op: b for op, b in fp32[name]["payload_bytes"].items() if op != "all_gather"}
        assert fp32[name]["payload_bytes"]["all_gather"] == bf16[name]["payload_bytes"]["all_gather"]
    assert fp32["fsdp2_full"]["phase_bytes"]["backward"] > bf16["fsdp2_full"]["phase_bytes"]["backward"]
    assert fp32["fsdp2_hybrid"]["phase_bytes"]["backward"] < bf16["fsdp2_hybrid"]["phase_bytes"]["backward"]
    for bad, key in (("reshard_after_forward=false", "reshard_after_forward"), ("forward_prefetch=-1",
                                                                                  "forward_prefetch"),
                     ("backward_prefetch=0", "backward_prefetch"), ("reduce_dtype=bfloat16", "reduce_dtype")):
        out = _cli(*args, bad)
        assert out.returncode == 2 and key in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_cli_fsdp2_reshard_to_a_smaller_group():
    """``reshard_after_forward=2`` (ZeRO++'s hpZ in FSDP2) on mlp (8 units of 256 x 256 fp32, P = 2 MiB a pass): the
    same calls and payload as true, backward's all_gathers over 2 ranks: bus bytes P (N-1)/N + P / 2; forward holds
    each unit's half after its forward (planned above true's); fsdp2_hybrid (which passes true) unchanged; an int
    equal to a world size is true there; one that does not divide every world size exits 2 naming the key."""
    args = ("model=mlp", "world_size=[4,8]", "batch_size=2", "shard_size=2", "format=json",
            "strategies=[fsdp2_full,fsdp2_hybrid]")

    def rows(*more: str) -> dict[tuple[str, int], dict]:
        out = _cli(*args, *more)
        assert out.returncode == 0, out.stderr
        return {(r["strategy"], r["world_size"]): r for r in json.loads(out.stdout)}

    default, hpz, p = rows(), rows("reshard_after_forward=2"), 8 * 256 * 256 * 4
    for n in (4, 8):
        full, base = hpz["fsdp2_full", n], default["fsdp2_full", n]
        assert (full["counts"], full["payload_bytes"]) == (base["counts"], base["payload_bytes"])
        assert full["bus_bytes"]["all_gather"] == p * (n - 1) // n + p // 2 < base["bus_bytes"]["all_gather"]
        assert full["phase_bytes"]["forward"] > base["phase_bytes"]["forward"]
        assert hpz["fsdp2_hybrid", n]["bus_bytes"] == default["fsdp2_hybrid", n]["bus_bytes"]
    four = rows("reshard_after_forward=4")  # true at N=4 (FSDP2 takes world_size as true), 4 ranks at N=8
    assert four["fsdp2_full", 4]["bus_bytes"] == default["fsdp2_full", 4]["bus_bytes"]
    assert four["fsdp2_full", 8]["bus_bytes"]["all_gather"] == p * 7 // 8 + p * 3 // 4
    out = _cli(*args, "reshard_after_forward=3")
    assert out.returncode == 2 and "reshard_after_forward" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_fsdp2_cpu_offload_policy_is_planned_on_the_host():
    """offload=full on the FSDP2 rows (CPUOffloadPolicy): the sharded parameters, gradients and optimizer state on
    the host, none on the device, the same bytes as without; no optimizer-only offload in FSDP2."""
    for name in ("fsdp2_full", "fsdp2_grad_op"):
        off, on = (plan(ModelShape.from_count(7_500_000_000), [64], Precision("fp32", "float32"), offload,
                        [name])[0][0] for offload in ("full", "none"))
        assert off["device_bytes"] == 0 and off["host_bytes"] == on["device_bytes"] == on["total_bytes"]
        records, notes = plan(ModelShape.from_count(7_500_000_000), [64], Precision("fp32", "float32"), "optimizer",
                              [name])
        assert records == [] and any(name in n and "offload=optimizer" in n for n in notes)
