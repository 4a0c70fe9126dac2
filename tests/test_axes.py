"""Axes of every strategy: global-norm clipping (``strategy.clip_grad_norm``) on every strategy, its
collective in the one expectation model, the clipped reference; the axes in the cell's identity only where set."""

from __future__ import annotations

import pytest

from conftest import PROBED, STEPS, WINDOWS, read_csv
from zeroexp.cell.identity import cell_id, cell_identity, cell_name
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.cell.resolved import knobs_of, layout_of
from zeroexp.formulas import Groups, Unit, step_collectives
from zeroexp.probes.equivalence import max_abs_diff, train_reference

CLIP = 5e-5  # below every gradient norm of these cells: every step is clipped
N2 = ("world_size=2",)
P = 64 * 64 * 8 * 4  # the mlp of conftest.BASE: 8 Linear(64, 64), fp32
#: case -> overrides (N = 2); each runs once (the `cell` cache) and every check must PASS. The clipped cells are
#: compared with the unclipped reference (clipping must have changed the training).
CELLS = {
    "ddp": ("strategy=ddp",),
    "ddp-ga4-clip": ("strategy=ddp", "grad_accum=4", f"strategy.clip_grad_norm={CLIP}"),
    "fsdp_full-fp16-ga2-clip": ("strategy=fsdp_full", "precision=fp16", "grad_accum=2",
                                f"strategy.clip_grad_norm={CLIP}"),  # the scaler unscales, FSDP clips, once a step
    "fsdp2_full-clip": ("strategy=fsdp2_full", f"strategy.clip_grad_norm={CLIP}"),
    "fsdp_grad_op-ga4": ("strategy=fsdp_grad_op", "grad_accum=4"),
    "zero2-fp16-ga4-clip": ("strategy=zero2", "precision=fp16", "grad_accum=4", f"strategy.clip_grad_norm={CLIP}"),
    "deepspeed-ga4-clip": ("strategy=deepspeed", "grad_accum=4", f"strategy.clip_grad_norm={CLIP}"),
}
#: Measured per optimizer step (calls, payload bytes), the facts the expectation model must (and does) predict:
#: ddp under no_sync one bucket all_reduce per step as without accumulation; FSDP1 FULL_SHARD fp16 gathers each of
#: its 8 units twice per micro-batch and reduce-scatters once (no_sync), its all_reduces the scaler's found_inf and
#: the clip norm; FSDP2 clipping one all_reduce of 8 partial norms; SHARD_GRAD_OP under no_sync gathers once per
#: step; zero2 reduce-scatters each micro-batch; DeepSpeed stage 2 all-reduces its bucket each micro-batch.
COUNTS = {
    "ddp": {"all_reduce": (1, P)},
    "ddp-ga4-clip": {"all_reduce": (1, P)},
    "fsdp_full-fp16-ga2-clip": {"all_gather": (8 * 2 * 2, P // 2 * 2 * 2), "reduce_scatter": (8, P // 2),
                                "all_reduce": (2, 8)},
    "fsdp2_full-clip": {"all_gather": (16, 2 * P), "reduce_scatter": (8, P), "all_reduce": (1, 4 * 8)},
    "fsdp_grad_op-ga4": {"all_gather": (8, P), "reduce_scatter": (8, P)},
    "zero2-fp16-ga4-clip": {"reduce_scatter": (4, 4 * P // 2), "all_gather": (1, P // 2), "all_reduce": (1, 4)},
    "deepspeed-ga4-clip": {"all_reduce": (4 + 1, 4 * P + 4), "all_gather": (1, P)},
}


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


@pytest.mark.parametrize("case", sorted(CELLS))
def test_cells_of_the_axes_pass_every_check_with_the_measured_collectives(cell, compose, case):
    r = cell(*CELLS[case], *N2)
    assert r.status == "ok", r.error
    for probe in ("state", "collectives", "equivalence", "grad_norm", "plan"):
        assert r.summary[probe]["check"] == "PASS", (probe, r.summary[probe].get("reasons"))
    # the norm each strategy took when it clips (DeepSpeed's engine always, every step; the others' kept through no
    # memory-tracked step: PROBED - 1), else the probe's own at the warm-up steps
    norm = r.summary["grad_norm"]
    steps = list(range(STEPS)) if case.startswith("deepspeed") else [s for s in range(STEPS) if s != PROBED - 1]
    assert (norm["source"], norm["steps"]) == (("strategy", steps) if "clip" in case else ("probe", [0, 1])), norm
    assert norm["ranks"] == [0, 1]
    c = r.summary["collectives"]
    assert {op: (c["counts"][op], c["payload_bytes"][op]) for op in c["counts"]} == COUNTS[case]
    if "clip" in case:
        cfg = compose(*CELLS[case], *N2)
        steps = r.summary["equivalence"]["steps"]
        moved = max_abs_diff(train_reference(cfg, steps, clip_grad_norm=CLIP), train_reference(cfg, steps))
        assert moved > 10 * r.summary["equivalence"]["max_abs_err"], (moved, r.summary["equivalence"])


def test_grad_accum_keeps_ddps_all_reduces_per_step_and_counts_optimizer_steps(cell):
    one, four = (cell(*CELLS[case], *N2) for case in ("ddp", "ddp-ga4-clip"))
    assert one.summary["collectives"]["counts"] == four.summary["collectives"]["counts"] == {"all_reduce": 1}
    assert four.summary["equivalence"]["steps"] == one.summary["equivalence"]["steps"] == STEPS  # optimizer steps
    # The memory probe tracks each of a step's 4 micro-batches (MemTracker's module state reset between them).
    assert four.summary["memory"]["tracked_steps"] == one.summary["memory"]["tracked_steps"]


def test_grad_accum_names_the_cell_only_where_set_and_is_validated(compose):
    plain, four = compose("strategy=fsdp_full"), compose("strategy=fsdp_full", "grad_accum=4")
    assert "grad_accum" not in cell_identity(plain) and cell_identity(four)["grad_accum"] == 4
    assert "_ga4_" in cell_name(four) and "_ga" not in cell_name(plain)
    each = compose("strategy=fsdp_full", "grad_accum=4", "strategy.sync_each_microbatch=true")
    assert cell_identity(each)["strategy"]["sync_each_microbatch"] is True
    assert "sync_each_microbatch" not in cell_identity(four)["strategy"] and cell_id(each) != cell_id(four)
    for bad in ("grad_accum=0", "grad_accum=-2"):
        with pytest.raises(ConfigError) as e:
            validate(compose("strategy=ddp", bad))
        assert e.value.key == "grad_accum"


@pytest.mark.parametrize("strategy, extra, gathers, scatters", [
    ("fsdp_full", (), 2 * 4, 1), ("fsdp_full", ("strategy.sync_each_microbatch=true",), 2 * 4, 4),
    ("fsdp_grad_op", (), 1, 1), ("fsdp_grad_op", ("strategy.sync_each_microbatch=true",), 4, 4),
    ("fsdp2_grad_op", (), 4, 1)])
def test_the_model_gathers_and_reduces_per_micro_batch_as_fsdp_does(compose, strategy, extra, gathers, scatters):
    """Per unit and optimizer step at grad_accum=4 (measured by the cells above and in docs/results.md)."""
    cfg = compose(f"strategy={strategy}", "grad_accum=4", *extra)
    name, layout = layout_of(cfg)
    one = Unit(64, 2 if strategy == "fsdp_full" else 1)
    c = step_collectives(layout, Groups(name, 2, (64,), units=(one,)), 4, knobs_of(cfg))
    assert c["all_gather"]["count"] == gathers and c["reduce_scatter"]["count"] == scatters


def test_activation_checkpointing_is_a_group_in_the_identity_only_when_full(compose):
    plain, full = compose("strategy=ddp"), compose("strategy=ddp", "activation_checkpointing=full")
    validate(full)
    assert "activation_checkpointing" not in cell_identity(plain)
    assert cell_identity(full)["activation_checkpointing"] == "full" and "_ac-full_" in cell_name(full)
    with pytest.raises(Exception):  # not an option of the group: Hydra refuses it at composition
        compose("strategy=ddp", "activation_checkpointing=half")
    with pytest.raises(ConfigError) as e:  # nothing to checkpoint
        validate(compose("strategy=fsdp_full", "strategy.wrap=[]", "activation_checkpointing=full"))
    assert e.value.key == "activation_checkpointing"


GPT = ("model=gpt", "model.n_layer=2", "world_size=2")
GPT_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)  # conftest.BASE without the mlp's width


def test_checkpointing_recomputes_without_new_collectives_and_cuts_the_forward_peak(cell):
    """FSDP FULL_SHARD on gpt: the recompute runs inside each unit's backward, under the parameters FSDP gathered
    for it, so the fingerprint is that of no checkpointing (2 blocks and the root: 5 all_gather, 3 reduce_scatter);
    the forward peak drops by the activations the checkpointed blocks no longer keep."""
    none, full = (cell("strategy=fsdp_full", *GPT, f"activation_checkpointing={ac}", base=GPT_BASE)
                  for ac in ("none", "full"))
    for r in (none, full):
        assert r.status == "ok", r.error
        for probe in ("state", "collectives", "equivalence", "plan"):
            assert r.summary[probe]["check"] == "PASS", (probe, r.summary[probe].get("reasons"))
    assert full.summary["collectives"]["counts"] == none.summary["collectives"]["counts"] == \
        {"all_gather": 5, "reduce_scatter": 3}
    assert full.summary["collectives"]["payload_bytes"] == none.summary["collectives"]["payload_bytes"]
    before, after = (read_csv(r, "memory.csv") for r in (none, full))
    assert (after.forward_peak_bytes < before.forward_peak_bytes).all()
    assert full.summary["equivalence"]["max_abs_err"] == none.summary["equivalence"]["max_abs_err"]
