"""The collectives probe: per-step collective fingerprints counted by torch.profiler vs the model."""

from __future__ import annotations

import pytest

from conftest import WARMUP, read_csv
from zeroexp.cell.resolved import Cell
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.formulas import bus_bytes, bus_factor, padded_numel
from zeroexp.probes.collectives import SOURCE, CollectivesProbe
from zeroexp.results.verdict import Code

N, WIDTH, DEPTH = 4, 64, 8  # conftest BASE: model.width=64, the mlp's default depth
P = WIDTH * WIDTH * DEPTH * 4  # 128 KiB of fp32 parameters: 8 Linear units of 16 KiB
TWO_BUCKETS = "strategy.bucket_cap_mb=0.0625"  # 64 KiB: the 8 gradients of 16 KiB fill exactly two DDP buckets
#: Overrides in the order other test modules use (shared runs), and the reference fingerprint per rank per
#: step: op -> (count, payload S in units of P).
CELLS = {
    "ddp": (("strategy=ddp", f"world_size={N}", TWO_BUCKETS), {"all_reduce": (2, 1)}),
    "zro": (("strategy=zro", f"world_size={N}", TWO_BUCKETS), {"all_reduce": (2, 1), "broadcast": (8, 1)}),
    "fsdp_grad_op": (("strategy=fsdp_grad_op", f"world_size={N}"), {"all_gather": (8, 1), "reduce_scatter": (8, 1)}),
    **{f"fsdp_full-{p}": (("strategy=fsdp_full", f"world_size={N}", f"prefetch={p}"),
                          {"all_gather": (16, 2), "reduce_scatter": (8, 1)}) for p in ("pre", "post", "none")},
}


@pytest.mark.parametrize("name", list(CELLS))
def test_reference_fingerprint(cell, name):
    overrides, want = CELLS[name]
    r = cell(*overrides)
    assert r.status == "ok", r.error
    s = r.summary["collectives"]
    assert s["check"] == "PASS" and s["reasons"] == [], s["reasons"]
    assert s["source"] == SOURCE and s["profiled_steps"] == [WARMUP] and s["rank_disagreements"] == []
    assert s["counts"] == {op: c for op, (c, _) in want.items()} == s["expected_counts"]
    assert s["payload_bytes"] == {op: k * P for op, (_, k) in want.items()} == s["expected_payload_bytes"]
    assert s["bus_bytes"] == {op: round(k * P * bus_factor(op, N)) for op, (_, k) in want.items()}
    assert s["dtypes"] == {op: "float32" for op in want}
    assert s["param_bytes"] == P and s["payload_total_bytes"] == sum(k for _, k in want.values()) * P
    csv = read_csv(r, "collectives.csv")
    assert list(csv.columns) == ["rank", "op", "count", "dtype", "payload_bytes", "bus_bytes", "mesh_dim", "group_size"]
    assert set(csv["mesh_dim"]) == {"world"} and set(csv["group_size"]) == {N}  # every call on the default group
    assert sorted(csv["rank"].unique()) == list(range(N)) and len(csv) == N * len(want)
    for row in csv.itertuples():
        assert (row.count, row.payload_bytes) == (want[row.op][0], want[row.op][1] * P)
        assert row.bus_bytes == bus_bytes(row.op, row.payload_bytes, N)


def test_layers_and_bucket_size_move_the_counts(cell):
    # 5 layers of 16 KiB, 32 KiB buckets: gradients fill buckets of 32, 32 and 16 KiB; 5 owned broadcasts.
    r = cell("strategy=zro", f"world_size={N}", "strategy.bucket_cap_mb=0.03125", "model.depth=5")
    assert r.status == "ok", r.error
    s = r.summary["collectives"]
    assert s["check"] == "PASS", s["reasons"]
    assert s["counts"] == {"all_reduce": 3, "broadcast": 5}
    assert s["payload_bytes"] == {"all_reduce": 5 * 16384, "broadcast": 5 * 16384}


def test_fsdp_padding_enters_the_payload(cell):
    # width 63: 3969 elements per unit, padded to 3972 (a multiple of N) before it is sharded and gathered.
    r = cell("strategy=fsdp_full", f"world_size={N}", "prefetch=post", "model.width=63", "model.depth=5")
    assert r.status == "ok", r.error
    s = r.summary["collectives"]
    assert s["check"] == "PASS", s["reasons"]
    unit = padded_numel(63 * 63, N) * 4
    assert s["counts"] == {"all_gather": 10, "reduce_scatter": 5}
    assert s["payload_bytes"] == {"all_gather": 10 * unit, "reduce_scatter": 5 * unit}
    assert s["param_bytes"] == 5 * 63 * 63 * 4 < 5 * unit


def test_ddp_warmup_too_short_for_the_steady_fingerprint_is_refused(compose):
    for strategy in ("ddp", "zro"):
        with pytest.raises(ConfigError, match="warmup_steps"):
            validate(compose(f"strategy={strategy}", "warmup_steps=1"))
    validate(compose("strategy=ddp", "warmup_steps=2"))
    validate(compose("strategy=fsdp_full", "warmup_steps=0"))


def _rank(records, expected=None):
    return {"records": records, "steps": [3, 4], "expected": expected, "expected_error": "no model",
            "param_bytes": P, "source": SOURCE}


def test_aggregate_reports_disagreeing_ranks_and_unsteady_steps(compose):
    cfg = compose("strategy=ddp", "world_size=2")
    ar = {"phase": "step", "op": "all_reduce", "dtype": "float32", "count": 2, "payload_bytes": P}
    steady = [{**ar, "step": 3}, {**ar, "step": 4}]
    extra = {"phase": "step", "step": 4, "op": "broadcast", "dtype": "int32", "count": 2, "payload_bytes": 44}
    expected = {"all_reduce": {"count": 2, "payload_bytes": P}}
    ok = CollectivesProbe.aggregate([_rank(steady, expected), _rank(steady, expected)], Cell.of(cfg)).section
    assert ok["check"] == "PASS" and ok["counts"] == {"all_reduce": 2}
    bad = CollectivesProbe.aggregate([_rank(steady, expected), _rank([*steady, extra], expected)], Cell.of(cfg)).section
    assert bad["check"] == "FAIL"
    assert bad["rank_disagreements"] == [{"op": "broadcast", "dtype": "int32", "mesh_dim": "world", "group_size": 2,
                                          "counts": [0, 1], "payload_bytes": [0, 22]}]
    assert bad["reason_codes"] == [Code.COLLECTIVES_UNSTEADY, Code.COLLECTIVES_RANKS_DISAGREE]
    assert bad["reasons"][0].startswith("rank 1: step 4")  # the rank and the step it names
    none = CollectivesProbe.aggregate([_rank(steady), _rank(steady)], Cell.of(cfg)).section
    assert none["check"] == "n/a" and none["reason_codes"] == [Code.COLLECTIVES_NOT_MODELLED]  # nothing to hold to
