"""DeepSpeed ZeRO stages 0-3 as runtime cells on 2 CPU ranks (gloo): they train, their state matches
zeroexp.formulas.state_factors of the deepspeed_stage<k> rows, the fp32 master DeepSpeed keeps beyond the canonical
formula is reported, ZeRO-3 parameters are gathered for the equivalence check, and an offload cell reports its state
on the host. Foreign models (tests/corpus.py: odd-sized biased layers, BatchNorm buffers, a frozen layer) at stages 2
and 3 on 2 and 3 ranks hold every check, their partitions padded as DeepSpeed pads them."""

from __future__ import annotations

import math

import pytest

from conftest import PROBED, STEPS, WINDOWS, read_csv

from zeroexp.cell.policy import CellPolicy
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.strategies import deepspeed as ds_adapter
from zeroexp.results.verdict import Code

pytestmark = pytest.mark.skipif(not ds_adapter.deepspeed_available(),
                                reason="deepspeed is not installed (pip install -e '.[deepspeed]')")

N2 = ("strategy=deepspeed", "world_size=2")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_trains_with_its_state_factors_and_matches_the_reference(cell, stage):
    res = cell(*N2, f"strategy.stage={stage}")
    assert res.status == "ok", res.error
    s = res.summary
    assert s["cell"]["stage"] == stage
    st = s["state"]
    assert st["check"] == "PASS", st["reasons"]
    f = st["factors"]
    if stage == 3:
        assert f["param"] == 1.0 and f["grad"] == 1.0 and f["optim"] >= 2.0
    if stage == 1:
        assert f["optim"] == pytest.approx(2.0) and f["param"] == 2.0
    if stage >= 1:  # the fp32 partition DeepSpeed keeps in fp32 training too: reported, with its tensors
        beyond = st["beyond_canonical"]["master"]
        assert beyond["bytes"] == s["state"]["logical_param_bytes"] and "fp32" in beyond["tensors"]
    else:
        assert st["beyond_canonical"] == {} and "master" not in f
    assert set(st["dtypes"][k] for k in ("param", "grad", "optim")) == {"float32"}
    eq = s["equivalence"]
    assert eq["check"] == "PASS" and eq["max_abs_err"] <= eq["threshold"]
    co = s["collectives"]
    assert co["check"] == "PASS", co["reasons"]  # held against the deepspeed_stage<k> row over the engine's groups
    # 8 Linear(64, 64) in one 25 MiB bucket: ZeRO-0 one all_reduce; 1/2 one bucket all_reduce + the norm
    # scalar and one all_gather of the flat group; 3 one prefetch all_gather, one reduce_scatter, the norm.
    want = {0: {"all_reduce": 1}, 1: {"all_reduce": 2, "all_gather": 1}, 2: {"all_reduce": 2, "all_gather": 1},
            3: {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}}[stage]
    assert co["counts"] == co["expected_counts"] == want
    p = s["state"]["logical_param_bytes"]
    assert co["payload_bytes"] == {0: {"all_reduce": p}, 1: {"all_reduce": p + 4, "all_gather": p},
                                   2: {"all_reduce": p + 4, "all_gather": p},
                                   3: {"all_gather": p, "reduce_scatter": p, "all_reduce": 8}}[stage]  # fp64 norm
    assert s["memory"]["peak_bytes_max"] > 0
    # DeepSpeed's shared-memory comm op (inference_all_reduce only) is not built: no JIT compile at a first cell
    # (deepspeed.comm.torch.build_shm_op prints that line to the rank's stdout, which its log holds, when it loads it)
    from pathlib import Path
    logs = "".join(f.read_text() for f in (Path(res.cell_dir) / "logs").glob("rank*.log"))
    assert ds_adapter.SHM_COMM_OP not in logs and "built successfully" not in logs


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_depth_and_bucket_size_move_the_collectives_as_modelled(cell, stage):
    # reduce_bucket_size = 0.03 MiB / 4 = 7864 elements: one Linear(64, 64) (4096) per gradient bucket
    res = cell(*N2, f"strategy.stage={stage}", "model.depth=5", "strategy.bucket_cap_mb=0.03")
    assert res.status == "ok", res.error
    co = res.summary["collectives"]
    assert co["check"] == "PASS", co["reasons"]
    p = res.summary["state"]["logical_param_bytes"]
    if stage == 3:
        assert co["counts"] == {"all_gather": 1, "reduce_scatter": 5, "all_reduce": 1}
        assert co["payload_bytes"]["reduce_scatter"] == co["payload_bytes"]["all_gather"] == p
    else:
        assert co["counts"] == {"all_reduce": 5 + 1, "all_gather": 1}
        assert co["payload_bytes"] == {"all_reduce": p + 4, "all_gather": p}


def test_collectives_model_follows_buckets_and_depth():
    from zeroexp.formulas import LAYOUTS, Groups, PlanKnobs, Shard, deepspeed_buckets, step_collectives

    assert deepspeed_buckets(1, [3, 3, 3], 6) == ((3, 3), (3,))
    assert deepspeed_buckets(1, [3, 3, 3], 5) == ((3,), (3,), (3,))
    for depth in (4, 8):
        numels = (4096,) * depth
        g = Groups("deepspeed_stage2", 2, numels, (Shard((), depth * 4096),),
                   buckets=deepspeed_buckets(2, numels, 8192))
        assert step_collectives(LAYOUTS["deepspeed_stage2"], g, 4) == {
            "all_reduce": {"count": depth // 2 + 1, "payload_bytes": depth * 4096 * 4 + 4},
            "all_gather": {"count": 1, "payload_bytes": depth * 4096 * 4}}
        numels = (4097,) * depth
        g3 = Groups("deepspeed_stage3", 2, numels, tuple(Shard(((0, 4097),), 4098) for _ in numels),
                    buckets=deepspeed_buckets(3, numels, 4097), gathers=(numels,))
        assert step_collectives(LAYOUTS["deepspeed_stage3"], g3, 2) == {
            "reduce_scatter": {"count": depth, "payload_bytes": depth * 4098 * 2},
            "all_reduce": {"count": 1, "payload_bytes": 8},
            "all_gather": {"count": 1, "payload_bytes": depth * 4098 * 2}}
        # the optimizer offloaded (optimizer, full): the same gradients and parameters, the norm an fp32 scalar
        for off in ("optimizer", "full"):
            assert step_collectives(LAYOUTS["deepspeed_stage3"], g3, 2, PlanKnobs(offload=off))["all_reduce"] == {
                "count": 1, "payload_bytes": 4}
        assert step_collectives(LAYOUTS["deepspeed_stage2"], g, 4, PlanKnobs(offload="optimizer")) == \
            step_collectives(LAYOUTS["deepspeed_stage2"], g, 4)
    g0 = Groups("deepspeed_stage0", 2, (4096,) * 8, buckets=deepspeed_buckets(0, [4096] * 8, 0))
    assert step_collectives(LAYOUTS["deepspeed_stage0"], g0, 2) == {"all_reduce": {"count": 1, "payload_bytes": 65536}}


def test_stage3_hooks_fire_a_biased_linears_weight_before_its_bias():
    """Stage 3's F.linear (LinearFunctionForZeroStage3) returns the weight's gradient before the bias's: each pair
    torch's backward fires bias first is swapped, the rest of the order kept."""
    from zeroexp.formulas.deepspeed import ds_stage3_hooks

    assert ds_stage3_hooks((3, 2, 4, 1, 0), ((2, 3), (0, 1))) == [2, 3, 4, 0, 1]
    assert ds_stage3_hooks((2, 3, 1, 0), ((2, 3),)) == [2, 3, 1, 0]  # already weight first
    assert ds_stage3_hooks((5, 1, 0), ((0, 1), (7, 8))) == [5, 0, 1]  # a pair without gradient: left out


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_smaller_than_a_layer_fill_in_the_order_the_hooks_fire(cell, stage):
    """A 2-layer Llama with 0.01 MiB buckets: its norms' gradients come between the attention's and the MLP's, not
    beside each other as in the reverse of the parameters' order: 21 buckets, planned and measured (18 when the
    planner took a stack's order)."""
    llama = ("model=llama3_8b", "model.num_hidden_layers=2", "model.hidden_size=64", "model.intermediate_size=128",
             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=256", "model.seq_len=16")
    r = cell("strategy=deepspeed", f"strategy.stage={stage}", "world_size=2", "strategy.bucket_cap_mb=0.01", *llama,
             base=("logger=none", f"steps={STEPS}", *WINDOWS))
    assert r.status == "ok", r.error
    plan = r.summary["plan"]
    assert plan["groups"]["check"] == plan["calls"]["check"] == r.summary["collectives"]["check"] == "PASS"
    op, coll = "reduce_scatter" if stage == 3 else "all_reduce", r.summary["collectives"]
    # stage 2: one all_reduce a bucket and the norm's
    assert coll["counts"][op] == coll["expected_counts"][op] == 21 + (stage == 2)


def test_bf16_optimizer_offload_cell_keeps_optimizer_state_on_the_host(cell):
    res = cell(*N2, "strategy.stage=2", "precision=bf16", "offload=optimizer")
    assert res.status == "ok", res.error
    st = res.summary["state"]
    assert st["check"] == "PASS", st["reasons"]
    assert st["dtypes"]["param"] == "bfloat16" and st["dtypes"]["optim"] == "float32"
    assert st["dtypes"]["master"] == "float32" and st["dtypes"]["grad"] == "float32"  # fp32 partition on the host
    for kind in ("optim", "master"):
        assert st["placement"][kind]["host_bytes"] > 0
    assert st["offload"] == "optimizer"
    # 2P' + 2P' / N ... per rank: bf16 parameters (P/2 in units of P = 4 P'), master + moments 12P'/N
    assert st["factors"]["param"] == pytest.approx(2 * 0.5) and st["factors"]["optim"] == pytest.approx(2.0)
    eq = res.summary["equivalence"]
    assert eq["check"] == "PASS" and eq["threshold"] == pytest.approx(2e-2)


def test_stage_names_the_cell(compose):
    from zeroexp.cell.identity import cell_name

    assert cell_name(compose(*N2, "strategy.stage=3")).startswith("deepspeed-stage3_mlp_fp32_n2_")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_both_checkpoint_kinds_validate_at_every_stage(compose, stage):
    """Round trips in tests/test_checkpoint.py. The format names what this stage writes: stage 0 (nothing
    partitioned) rank 0's mp_rank_00_model_states.pt with the optimizer in it, stages 1-3 each rank's partitions."""
    formats = {}
    for kind in ("full", "sharded"):
        cfg = compose(*N2, f"strategy.stage={stage}", f"checkpoint={kind}")
        validate(cfg)
        formats[kind] = ds_adapter.DeepSpeedAdapter(CellPolicy.of(cfg)).checkpoint_format(kind)
    assert ds_adapter.DS_FULL_FILE in formats["full"] and ("all-gathered" if stage == 3 else "all_reduce" if stage
                                                           else "no collective") in formats["full"]
    assert ("zero_pp_rank_<r>_" in formats["sharded"]) == (stage > 0)
    assert ("mp_rank_00_model_states.pt" in formats["sharded"]) == (stage < 3)
    if stage < 3:
        with pytest.raises(ConfigError, match="offload"):  # a checkpoint does not lift the offload rules
            validate(compose(*N2, f"strategy.stage={stage}", "checkpoint=sharded", "offload=full"))


def test_refusals(compose, monkeypatch):
    with pytest.raises(ConfigError, match="offload_param needs ZeRO stage 3"):
        validate(compose(*N2, "strategy.stage=2", "offload=full"))
    with pytest.raises(ConfigError, match="strategy.stage"):
        validate(compose(*N2, "strategy.stage=4"))
    if not ds_adapter._cuda_for(compose(*N2)):
        with pytest.raises(ConfigError, match="does not support fp16"):
            validate(compose(*N2, "precision=fp16"))
    monkeypatch.setattr(ds_adapter, "deepspeed_available", lambda: False)
    with pytest.raises(ConfigError, match=r"strategy.*pip install -e '\.\[deepspeed\]'"):
        validate(compose(*N2))


# --- foreign models (tests/corpus.py; the tests' directory is on the ranks' path) --------------------------------
#: Each corpus model and its sample's shape.
CORPUS = {"biased": "[10]", "conv_bn": "[3,8,8]", "frozen_mlp": "[16]"}
#: conftest.BASE without model.width (the default Linear stack's), which the corpus factories do not take.
FOREIGN_BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)


def _foreign(cell, model: str, stage: int, n: int, *extra: str):
    return cell("strategy=deepspeed", f"world_size={n}", f"strategy.stage={stage}", "model=custom",
                f"model._target_=corpus.{model}", f"model.input_shape={CORPUS[model]}", *extra, base=FOREIGN_BASE)


def _checks(section, path: str = "summary"):
    """Every (path, check, reasons) in a summary, sections and their parts."""
    if isinstance(section, dict):
        if "check" in section:
            yield path, section["check"], section.get("reasons")
        for key, value in section.items():
            yield from _checks(value, f"{path}.{key}")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("model", list(CORPUS))
def test_foreign_models_hold_every_check(cell, model, stage, n):
    res = _foreign(cell, model, stage, n)
    assert res.status == "ok", res.error
    held = list(_checks(res.summary))
    assert {"summary.state", "summary.collectives", "summary.plan.groups", "summary.plan.memory"} <= {
        p for p, _, _ in held}
    bad = [(p, c, r) for p, c, r in held if c != "PASS" and not (c == "n/a" and r)]
    assert not bad, bad
    assert res.summary["state"]["factors"]["master"] == pytest.approx(
        res.summary["state"]["trained_param_bytes"] / res.summary["state"]["logical_param_bytes"], abs=1e-12)


def _per_rank(res, kind: str) -> list[tuple[int, int]]:
    rows = read_csv(res, "rank_state.csv")
    rows = rows[rows.kind == kind].sort_values("rank")
    return list(zip(rows.logical_bytes, rows.physical_bytes))


def test_biased_partitions_at_n3_are_padded_as_deepspeed_pads_them(cell):
    numels, n = (10 * 7, 7, 7 * 3, 3), 3  # Linear(10, 7) and Linear(7, 3), weights and biases: 101 elements
    psi = sum(numels)
    # Stage 2: one flat group padded to 2N (nccl_start_alignment_factor 2 x N): 102 elements, 34 per rank; the
    # padding is the last rank's last element (groups_padding), physical, not logical.
    res = _foreign(cell, "biased", 2, n)
    flat = math.ceil(psi / (2 * n)) * 2 * n
    shard = flat // n
    assert (flat, shard) == (102, 34)
    spans = [[a, a + k] for a, k in zip([0, 70, 77, 98], numels)]
    assert res.summary["plan"]["groups"]["planned"]["shards"] == [[spans, flat]]
    real = [min(shard, max(0, psi - r * shard)) for r in range(n)]
    assert real == [34, 34, 33]
    assert _per_rank(res, "master") == [(4 * k, 4 * shard) for k in real]
    assert _per_rank(res, "optim") == [(8 * k, 8 * shard) for k in real]
    assert res.summary["collectives"]["payload_bytes"]["all_gather"] == 4 * flat
    # Stage 3: each parameter padded to N on its own (partition_parameters.py _padding_size): ceil(numel / 3) per
    # rank, 24 + 3 + 7 + 1 = 35; the last rank holds 70 - 48 and 7 - 6 of the two parameters 3 does not divide.
    res = _foreign(cell, "biased", 3, n)
    part = [math.ceil(k / n) for k in numels]
    assert part == [24, 3, 7, 1]
    assert res.summary["plan"]["groups"]["planned"]["shards"] == [[[[0, k]], n * p] for k, p in zip(numels, part)]
    real = [sum(min(p, max(0, k - r * p)) for k, p in zip(numels, part)) for r in range(n)]
    assert real == [35, 35, 31]
    for kind, nbytes in (("param", 4), ("grad", 4), ("master", 4), ("optim", 8)):
        assert _per_rank(res, kind) == [(nbytes * k, nbytes * sum(part)) for k in real], kind
    assert res.summary["collectives"]["payload_bytes"] == {"all_gather": 4 * n * sum(part), "all_reduce": 8,
                                                           "reduce_scatter": 4 * n * sum(part)}


@pytest.mark.parametrize("n", [2, 3])
def test_a_frozen_layer_is_held_whole_at_stage2_and_partitioned_and_fetched_at_stage3(cell, n):
    k, depth = 16 * 16, 4  # four bias-free Linear(16, 16), the first frozen
    trained = (depth - 1) * k
    res = _foreign(cell, "frozen_mlp", 2, n)
    flat = math.ceil(trained / (2 * n)) * 2 * n
    assert _per_rank(res, "param") == [(4 * (trained + k), 4 * (flat + k))] * n  # the flat group, the frozen weight
    assert res.summary["collectives"]["payload_bytes"]["all_gather"] == 4 * flat
    # Stage 3: every weight partitioned (ceil(k / N) per rank), the frozen one too, and all four fetched; the
    # gradients, master and moments of the three that train.
    res = _foreign(cell, "frozen_mlp", 3, n)
    part = math.ceil(k / n)
    real = [min(part, max(0, k - r * part)) for r in range(n)]
    assert _per_rank(res, "param") == [(4 * depth * x, 4 * depth * part) for x in real]
    assert _per_rank(res, "master") == [(4 * (depth - 1) * x, 4 * (depth - 1) * part) for x in real]
    payload = res.summary["collectives"]["payload_bytes"]
    assert payload["all_gather"] == 4 * depth * n * part and payload["reduce_scatter"] == 4 * (depth - 1) * n * part
    assert res.summary["plan"]["groups"]["planned"]["frozen"] == [k]


# --- a trainable parameter forward never uses (tests/corpus.py unused_branch: Linear a, unused, b; 64 elements each) -
#: tests/test_corpus.py's cell of unused_branch (its base and overrides): a cell both modules run is run once.
UNUSED = ("strategy=deepspeed", "model=custom", "model._target_=corpus.unused_branch", "model.input_shape=[8]",
          "model.wrap=[torch.nn.Linear]")
CORPUS_BASE = ("logger=none", f"steps={PROBED}", *WINDOWS, "batch_size=2")


@pytest.mark.parametrize("stage, n, decay", [(1, 3, False), (3, 2, False), (2, 2, True), (3, 3, True)])
def test_a_parameter_forward_never_uses_holds_every_check_and_weight_decay_is_named(cell, stage, n, decay):
    """DeepSpeed fills the unused parameter's gradient with zeros and steps it: stages 1-3 reduce only a's and b's
    gradients (the bucket's payload) and stage 3 gathers only theirs; state, collectives, groups and every rank's peak
    as planned. With weight decay (the default, 0.01) the decay moves the unused weight, which the reference's torch
    AdamW leaves (its gradient is None): equivalence FAILs with the cause named, every other check holds."""
    res = cell(*UNUSED, f"strategy.stage={stage}", f"world_size={n}", *(() if decay else ("optimizer.weight_decay=0",)),
               base=CORPUS_BASE)
    assert res.status == "ok", res.error
    held = list(_checks(res.summary))
    eq = res.summary["equivalence"]
    bad = [(p, c, r) for p, c, r in held if c != "PASS" and not (c == "n/a" and r) and p != "summary.equivalence"]
    assert not bad, bad
    assert [rank["check"] for rank in res.summary["plan"]["memory"]["ranks"]] == ["PASS"] * n
    assert res.summary["plan"]["groups"]["planned"]["ungraded"] == [1]
    k = 64
    payload = res.summary["collectives"]["payload_bytes"]
    if stage == 3:
        padded = 4 * 2 * math.ceil(k / n) * n  # a and b, each padded to N
        assert payload == {"all_gather": padded, "reduce_scatter": padded, "all_reduce": 8}
    else:
        assert payload == {"all_reduce": 4 * 2 * k + 4, "all_gather": 4 * 3 * k}
    if decay:
        assert eq["check"] == "FAIL" and eq["cause"] == ds_adapter.DECAYS_UNGRADED
        assert eq["reason_codes"] == [Code.EQUIVALENCE_ABOVE_BOUND] and "unused.weight" in eq["why"]
    else:
        assert eq["check"] == "PASS" and "cause" not in eq


def test_the_cause_is_named_only_with_weight_decay_and_a_parameter_without_gradient(compose):
    adapter = ds_adapter.DeepSpeedAdapter(compose(*N2))
    assert adapter.known_divergence(["unused.weight"])[0] == ds_adapter.DECAYS_UNGRADED
    assert adapter.known_divergence([]) is None
    assert ds_adapter.DeepSpeedAdapter(compose(*N2, "optimizer.weight_decay=0")).known_divergence(["w"]) is None


# --- one rank (a single device: ZeRO-Offload's case) ---------------------------------------------------------------
@pytest.mark.parametrize("stage,extra", [(1, ()), (2, ("offload=optimizer",))], ids=["stage1", "stage2-offload"])
def test_stages_1_and_2_at_one_rank_gather_nothing_and_hold_every_check(cell, stage, extra):
    """At one rank DeepSpeed skips the parameters' all_gather (runtime/utils.py ``all_gather_into_tensor_dp_groups``:
    ``dp_world_size == 1``); the plan says so, and every check holds (a FAIL before: 1 all_gather planned)."""
    r = cell(*N2[:1], "world_size=1", f"strategy.stage={stage}", *extra)
    assert r.status == "ok", r.error
    coll, plan = r.summary["collectives"], r.summary["plan"]
    assert coll["check"] == "PASS" and "all_gather" not in coll["counts"] and coll["counts"]["all_reduce"] >= 2
    assert [plan[k]["check"] for k in ("state", "calls", "groups", "memory")] == ["PASS"] * 4


def test_stage3_at_one_rank_is_refused_and_planned_from_two(compose):
    from zeroexp.config.schemas import NotApplicableHere
    from zeroexp.formulas import LAYOUTS, ModelShape, derive_groups, step_collectives
    from zeroexp.plan import Precision, plan

    with pytest.raises(NotApplicableHere, match="stage 3 gathers nothing") as e:
        validate(compose(*N2[:1], "world_size=1", "strategy.stage=3"))
    assert e.value.key == "world_size"
    records, notes = plan(ModelShape.from_count(10**6), [1, 2], Precision("fp32", "float32"),
                          strategies=["deepspeed_stage2", "deepspeed_stage3"])
    assert sorted((r["strategy"], r["world_size"]) for r in records) == [
        ("deepspeed_stage2", 1), ("deepspeed_stage2", 2), ("deepspeed_stage3", 2)]
    assert any("deepspeed_stage3 at world_size=1" in n for n in notes)
    layout = LAYOUTS["deepspeed_stage2"]
    one = step_collectives(layout, derive_groups("deepspeed_stage2", layout, ModelShape.from_count(10**6), 1, 4), 4)
    assert "all_gather" not in one and one["all_reduce"]["count"] >= 2
