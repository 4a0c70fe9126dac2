"""FSDP2's reshard policies (``strategy.reshard_policy``, torchtitan's) and AdamW's update paths (``optimizer.impl``):
refused before launch where they do not apply, absent from the identity of the cells that do not set them, planned
(all_gather counts, AdamW's temporaries) and run as cells whose every check passes."""

from __future__ import annotations

import pytest

from conftest import PROBED, WINDOWS, compose_config
from zeroexp.cell.identity import cell_id, cell_identity
from zeroexp.config.schemas import validate
from zeroexp.errors import ConfigError
from zeroexp.formulas.peak.adamw import adamw_temporary_blocks

CHECK = ("logger=none", "world_size=2", "steps=8", "resources.check=false")
GPT = ("model=gpt", "model.n_layer=2")
LLAMA = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
BASE = ("logger=none", f"steps={PROBED + 1}", *WINDOWS)


def _planned(*overrides: str, n: int = 2) -> dict:
    """The planner's one row for the GPT's overrides at N=``n``, 8 samples a rank."""
    from hydra import compose, initialize_config_dir

    from zeroexp.cli.plan import register, run
    from zeroexp.cli.run import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="plan", overrides=[*GPT, f"world_size={n}", "batch_size=8", *overrides])
    return run(cfg)[0][0]


@pytest.mark.parametrize("overrides, key", [
    (("strategy=fsdp2_full", "strategy.reshard_policy=sometimes"), "strategy.reshard_policy"),
    (("strategy=fsdp2_full", "strategy.reshard_policy=default", "strategy.reshard_after_forward=null"),
     "strategy.reshard_policy"),
    (("strategy=fsdp2_full", "strategy.reshard_policy=always", "strategy.reshard_after_forward=2", "world_size=4"),
     "strategy.reshard_policy"),
    (("strategy=fsdp2_grad_op", "strategy.reshard_policy=default"), "strategy.reshard_policy"),
    (("strategy=fsdp2_full", "strategy.reshard_policy=never", "strategy.backward_prefetch=1"),
     "strategy.backward_prefetch"),
    (("strategy=ddp", "optimizer.impl=fast"), "optimizer.impl"),
], ids=["unknown", "beside-null", "beside-int", "grad_op-default", "never-prefetch", "impl"])
def test_bad_settings_are_refused_before_launch_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_config([*CHECK, *overrides]))
    assert e.value.key == key
    if "beside" in str(overrides):
        assert "reshard_after_forward" in str(e.value)  # names both keys


def test_the_settings_enter_the_identity_only_when_set():
    plain = compose_config([*CHECK, "strategy=fsdp2_full"])
    assert "reshard_policy" not in cell_identity(plain)["strategy"]
    assert "impl" not in cell_identity(plain)["optimizer"]
    assert cell_id(plain) == cell_id(compose_config([*CHECK, "strategy=fsdp2_full", "strategy.reshard_policy=null",
                                                     "optimizer.impl=null"]))
    ids = {cell_id(compose_config([*CHECK, "strategy=fsdp2_full", *o])) for o in
           [(), ("strategy.reshard_policy=always",), ("strategy.reshard_policy=default",), ("optimizer.impl=fused",)]}
    assert len(ids) == 4
    cell = validate(compose_config([*CHECK, "strategy=fsdp2_grad_op", "strategy.reshard_policy=never"]))
    assert cell.knobs.reshard_policy == "never" and cell.row_name == "fsdp2_grad_op"


def test_the_planner_counts_one_all_gather_less_for_each_unit_kept_after_forward():
    """gpt, 2 blocks and the root at N=2: always 2 x 3 all_gathers (every unit gathered again in backward), default
    2 + 1 + 1 (the last block and the root kept), never 3 (fsdp2_grad_op's); the flat key plans as strategy.*;
    each unit kept after forward raises the forward peak; fsdp2_hybrid follows the policy alike."""
    planned = _planned
    rows = {p: planned("strategy=fsdp2_full", f"strategy.reshard_policy={p}") for p in ("always", "default", "never")}
    assert {p: r["counts"]["all_gather"] for p, r in rows.items()} == {"always": 6, "default": 4, "never": 3}
    assert all(r["counts"]["reduce_scatter"] == 3 for r in rows.values())
    assert rows["always"]["phase_bytes"] == planned("strategy=fsdp2_full")["phase_bytes"]
    assert planned("strategies=[fsdp2_full]", "reshard_policy=default")["counts"] == rows["default"]["counts"]
    forward = [rows[p]["phase_bytes"]["forward"] for p in ("always", "default", "never")]
    assert forward == sorted(forward) and len(set(forward)) == 3
    hybrid = planned("strategy=fsdp2_hybrid", "strategy.shard_size=2", "strategy.reshard_policy=default", n=4)
    assert hybrid["counts"]["all_gather"] == 4 and hybrid["phase_bytes"] == rows["default"]["phase_bytes"]
    with pytest.raises(ConfigError) as e:
        planned("strategies=[fsdp2_full]", "reshard_policy=default", "reshard_after_forward=null")
    assert e.value.key == "reshard_policy"


def test_adamw_temporaries_follow_the_path():
    """single: the sqrt and the quotient of one parameter beside the previous denom; foreach: one sqrt per tensor
    alive at once; fused: none (torch._fused_adamw_ updates in place)."""
    n = (10, 4, 6)
    single = (max(2 * 10, 10 + 2 * 4, 4 + 2 * 6) * 4,)
    assert adamw_temporary_blocks(n, 4, "single") == adamw_temporary_blocks(n, 4, False) == single
    assert adamw_temporary_blocks(n, 4, "foreach") == adamw_temporary_blocks(n, 4, True) == (40, 16, 24)
    assert adamw_temporary_blocks(n, 4, "fused") == ()


def test_the_planner_plans_a_runs_adamw_path():
    """``python -m zeroexp.plan ... optimizer.impl=fused`` plans as ``adamw_impl=fused``: nothing above the state in
    the update; single-tensor's two of one parameter below foreach's one of every parameter; beside ``foreach=``
    it is refused, naming it."""
    from zeroexp.cli.plan import as_plan_keys, split_run_only

    assert split_run_only(as_plan_keys(["optimizer.impl=fused", "optimizer.lr=0.1"])) == (
        ["adamw_impl=fused"], ["optimizer.lr=0.1"])
    optimizer = {impl: _planned("strategy=fsdp2_full", f"adamw_impl={impl}")["phase_bytes"]["optimizer"]
                 for impl in ("single", "foreach", "fused")}
    assert optimizer["fused"] == 0 < optimizer["single"] < optimizer["foreach"]
    with pytest.raises(ConfigError) as e:
        _planned("strategy=fsdp2_full", "adamw_impl=fused", "foreach=true", "device=cuda")
    assert e.value.key == "adamw_impl"



@pytest.mark.parametrize("overrides, gathers", [
    ((*GPT, "strategy=fsdp2_full", "world_size=2", "strategy.reshard_policy=default", "optimizer.impl=fused"), 4),
    ((*GPT, "strategy=fsdp2_full", "world_size=3", "strategy.reshard_policy=never", "optimizer.impl=foreach"), 3),
    ((*LLAMA, "strategy=fsdp2_full", "world_size=3", "strategy.reshard_policy=default", "optimizer.impl=single"), 4),
    ((*LLAMA, "strategy=fsdp2_grad_op", "world_size=2", "strategy.reshard_policy=never", "optimizer.impl=fused"), 3),
], ids=["gpt-default-fused-n2", "gpt-never-foreach-n3", "llama-default-single-n3", "llama-grad_op-never-fused-n2"])
def test_a_cell_with_a_policy_and_a_path_holds_every_check(cell, overrides, gathers):
    """Two blocks and the root: each unit resharded after forward all-gathers twice, each kept once; the peak model
    follows the kept units and AdamW's path (fused: nothing above the state in the update)."""
    from zeroexp.report.checks import cell_checks

    r = cell(*overrides, base=BASE)
    assert r.status == "ok", r.error
    checks = cell_checks(r.summary)
    assert not [(c.name, c.reasons) for c in checks if c.verdict not in ("PASS", "n/a")]
    assert all(c.reasons for c in checks if c.verdict == "n/a")  # each n/a with its reason
    assert {"state", "collectives", "equivalence", "plan.collectives", "plan.groups", "plan.memory"} <= {
        c.name for c in checks if c.verdict == "PASS"}
    counts = r.summary["collectives"]["counts"]
    assert (counts["all_gather"], counts["reduce_scatter"]) == (gathers, 3)
    if "optimizer.impl=fused" in overrides:
        assert r.summary["plan"]["memory"]["phases"]["optimizer"]["predicted_bytes"] == 0


def test_the_report_names_a_cells_policy_and_path():
    """The cells table's axes: a column for the reshard policy and one for AdamW's path where a cell sets them, and
    a label suffix each (the cell's row stays its strategy's: fsdp2_full)."""
    import pandas as pd

    from zeroexp.results.axes import axis_values, label_axes, set_axes

    frame = pd.DataFrame({"cell_name": ["a", "b"], "label": ["fsdp2_full", "fsdp2_full"], "cell.world_size": [2, 2],
                          "config.strategy.reshard_policy": [None, "never"], "config.optimizer.impl": [None, "fused"]})
    assert [a.key for a in set_axes(frame)] == ["axis.reshard_policy", "axis.adamw_impl"]
    assert list(axis_values(frame)["axis.reshard_policy"]) == [None, "never"]
    assert label_axes(frame) == [[], ["reshard=never", "adamw=fused"]]
