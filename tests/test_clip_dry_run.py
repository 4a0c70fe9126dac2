"""Clipping in the dry run: FSDP2's ``clip_grad_norm`` all-reduces the stacked partial norms through a
functional collective (DTensor's redistribution of a Partial norm), which ``FakeTensorMode`` would run as a fake kernel
only; the dry run issues it on the fake process group (zeroexp/_lib/fake_collectives.py), so its collectives check
PASSes and equals the real run's, as FSDP1's (a plain c10d all_reduce) does. The collectives probe names the group of
the collectives DTensor issues (the shard group under hybrid sharding), in a real run and a dry run alike.
"""

from __future__ import annotations

import pytest

CLIP = "strategy.clip_grad_norm=1.0"
DEPTH, P = 8, 8 * 64 * 64 * 4  # conftest.BASE's mlp: 8 Linear(64, 64), fp32
#: strategy -> the clipping norm's all_reduce per step: FSDP1 the squared norm of the rank's shards (4 bytes), FSDP2
#: the 8 stacked partial norms (4 bytes each)
NORM = {"fsdp_full": 4, "fsdp2_full": 4 * DEPTH, "fsdp_hybrid": 4, "fsdp2_hybrid": 4 * DEPTH}


@pytest.mark.parametrize("strategy", ["fsdp_full", "fsdp2_full"])
def test_dry_run_traces_the_clip_all_reduce_as_the_real_run_issues_it(cell, strategy):
    """N=2: the dry run's fingerprint, the clip's all_reduce included, equals the real run's; both PASS."""
    real = cell(f"strategy={strategy}", "world_size=2", CLIP)
    dry = cell(f"strategy={strategy}", "world_size=2", CLIP, "dry_run=true")
    assert real.status == dry.status == "ok", (real.error, dry.error)
    r, d = real.summary["collectives"], dry.summary["collectives"]
    assert d["check"] == r["check"] == "PASS", (d["reasons"], r["reasons"])
    assert dry.summary["dry_run"]["source"].startswith("traced")
    assert ({k: d[k] for k in ("counts", "payload_bytes", "groups")}
            == {k: r[k] for k in ("counts", "payload_bytes", "groups")})
    assert d["groups"]["all_reduce"] == {"world": {"size": 2, "count": 1, "payload_bytes": NORM[strategy]}}
    assert dry.summary["plan"]["check"] == "PASS", dry.summary["plan"]["reasons"]


@pytest.mark.parametrize("strategy", ["fsdp_hybrid", "fsdp2_hybrid"])
def test_hsdp_dry_run_with_clipping_as_128_nodes_of_8(cell, strategy):
    """experiment=hsdp_vs_fsdp_dry_run (N=1024, shard_size=8), shrunk to the test mlp, clipped: the norm's all_reduce
    runs once per step within the shard group of 8 ranks, beside the 8 gradient all_reduces across 128 replicas."""
    r = cell("experiment=hsdp_vs_fsdp_dry_run", f"strategy={strategy}", "model.depth=8", CLIP)
    assert r.status == "ok", r.error
    c = r.summary["collectives"]
    assert c["check"] == "PASS", c["reasons"]
    assert c["groups"]["all_reduce"] == {"replicate": {"size": 128, "count": DEPTH, "payload_bytes": P // 8},
                                         "shard": {"size": 8, "count": 1, "payload_bytes": NORM[strategy]}}
    assert c["expected_groups"]["all_reduce"] == c["groups"]["all_reduce"]
    assert r.summary["plan"]["check"] == "PASS", r.summary["plan"]["reasons"]


@pytest.mark.parametrize("strategy", ["fsdp_hybrid", "fsdp2_hybrid"])
def test_real_hybrid_clip_all_reduce_runs_in_the_shard_group(cell, strategy):
    """N=4, shard_size=2, clipped: measured, the norm's all_reduce is the shard group's (2 ranks), as modelled."""
    r = cell(f"strategy={strategy}", "world_size=4", "strategy.shard_size=2", "strategy.clip_grad_norm=5e-5")
    assert r.status == "ok", r.error
    s = r.summary
    assert all(s[k]["check"] == "PASS" for k in ("state", "collectives", "equivalence", "plan")), s["collectives"]
    assert s["collectives"]["groups"]["all_reduce"] == {
        "replicate": {"size": 2, "count": DEPTH, "payload_bytes": P // 2},
        "shard": {"size": 2, "count": 1, "payload_bytes": NORM[strategy]}}
