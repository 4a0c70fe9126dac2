"""Axes of every strategy (issue 19): global-norm clipping (``strategy.clip_grad_norm``) on every strategy, its
collective in the one expectation model, the clipped reference; the axes in the cell's identity only where set."""

from __future__ import annotations

import pytest

from zeroexp.cell import cell_id, cell_identity
from zeroexp.config import ConfigError, validate
from zeroexp.expect import knobs_of, layout_of
from zeroexp.formulas import Groups, Unit, step_collectives
from zeroexp.probes.equivalence import max_abs_diff, train_reference

CLIP = 5e-5  # below every gradient norm of these cells: every step is clipped
N2 = ("world_size=2",)
#: case -> overrides; each runs once (the `cell` cache), every check must PASS.
CLIPPED = {
    "ddp": ("strategy=ddp",),
    "fsdp_full-fp16": ("strategy=fsdp_full", "precision=fp16"),  # the ShardedGradScaler unscales, then FSDP clips
    "fsdp2_full": ("strategy=fsdp2_full",),
    "deepspeed": ("strategy=deepspeed",),
}
#: The all_reduce bytes per step each clipped cell sends (mlp, width 64, depth 8, N = 2): ddp its one gradient bucket
#: (clipping adds nothing: every rank holds the whole gradient); FSDP1 fp16 the ShardedGradScaler's found_inf flag and
#: the one fp32 squared norm of the shards; FSDP2 one fp32 partial norm per gradient DTensor (8 Linear weights).
P = 64 * 64 * 8 * 4
ALL_REDUCE_BYTES = {"ddp": P, "fsdp_full-fp16": 4 + 4, "fsdp2_full": 4 * 8}


@pytest.mark.parametrize("strategy", ["ddp", "zro", "fsdp_full", "fsdp_grad_op", "fsdp2_full", "fsdp2_grad_op",
                                      "zero1", "zero2", "deepspeed"])
def test_every_strategy_has_clip_grad_norm_and_refuses_a_bad_one(compose, strategy):
    plain = compose(f"strategy={strategy}")
    assert plain.strategy.clip_grad_norm is None
    clipped = compose(f"strategy={strategy}", "strategy.clip_grad_norm=0.05")
    validate(clipped, ("strategy.clip_grad_norm",))
    assert cell_identity(clipped)["strategy"]["clip_grad_norm"] == 0.05 and cell_id(clipped) != cell_id(plain)
    with pytest.raises(ConfigError) as e:
        validate(compose(f"strategy={strategy}", "strategy.clip_grad_norm=0"), ("strategy.clip_grad_norm",))
    assert e.value.key == "strategy.clip_grad_norm"


def test_clipping_enters_the_identity_only_where_set(compose):
    """A strategy that gained the key keeps its cell ids (the null is left out: tests/test_config_keys.py pins them);
    zero1/zero2 had it before and keep it."""
    assert "clip_grad_norm" not in cell_identity(compose("strategy=fsdp_full"))["strategy"]
    assert cell_identity(compose("strategy=zero2"))["strategy"]["clip_grad_norm"] is None


def test_the_model_adds_the_clip_all_reduce_of_fsdp1_and_fsdp2(compose):
    units = (Unit(64, 2), Unit(64, 2))
    for strategy, added in (("fsdp_full", [4]), ("fsdp2_full", [4 * 3]), ("ddp", [])):
        plain, clipped = (compose(f"strategy={strategy}", *extra) for extra in ((), ("strategy.clip_grad_norm=1",)))
        name, layout = layout_of(clipped)
        groups = Groups(name, 4, (10, 20, 30), units=units, buckets=((10, 20, 30),))
        before, after = (step_collectives(layout, groups, 4, knobs_of(c)) for c in (plain, clipped))
        assert knobs_of(clipped).clipping and not knobs_of(plain).clipping
        was = before.get("all_reduce", {"count": 0, "payload_bytes": 0})
        assert after["all_reduce"] == {"count": was["count"] + len(added),
                                       "payload_bytes": was["payload_bytes"] + sum(added)}, strategy


@pytest.mark.parametrize("case", sorted(CLIPPED))
def test_clipped_cells_pass_every_check_against_the_clipped_reference(cell, compose, case):
    overrides = (*CLIPPED[case], *N2, f"strategy.clip_grad_norm={CLIP}")
    r = cell(*overrides)
    assert r.status == "ok", r.error
    for probe in ("state", "collectives", "equivalence", "plan"):
        assert r.summary[probe]["check"] == "PASS", (probe, r.summary[probe].get("reasons"))
    if case in ALL_REDUCE_BYTES:
        assert r.summary["collectives"]["payload_bytes"]["all_reduce"] == ALL_REDUCE_BYTES[case]
    cfg = compose(*overrides)
    steps = r.summary["equivalence"]["steps"]
    moved = max_abs_diff(train_reference(cfg, steps, clip_grad_norm=CLIP), train_reference(cfg, steps))
    assert moved > 10 * r.summary["equivalence"]["max_abs_err"], (moved, r.summary["equivalence"])  # clipping mattered
