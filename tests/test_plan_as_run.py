"""A run's command line plans as it is: ``python -m zeroexp.plan`` takes ``strategy=`` with its ``strategy.*`` keys
(that row alone, its keys over the planner's flat aliases), and drops the keys only a run reads, each with a note."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeroexp.cli.plan import RUN_ONLY, run, split_run_only
from zeroexp.errors import ConfigError
from test_recommend import ROOT, _compose

GPT = ["model=gpt", "model.n_layer=2", "model.n_embd=32", "model.seq_len=16", "model.vocab_size=64"]


def test_the_run_only_keys_are_split_off_and_the_rest_kept():
    keep, dropped = split_run_only(["model=gpt", "steps=8", "logger=none", "+probes.x=1", "optimizer.lr=0.1",
                                    "strategy=zero2", "strategy.bucket_cap_mb=1", "world_size=2", "--cfg", "job"])
    assert dropped == ["steps=8", "logger=none", "+probes.x=1", "optimizer.lr=0.1"]
    assert keep == ["model=gpt", "strategy=zero2", "strategy.bucket_cap_mb=1", "world_size=2", "--cfg", "job"]
    from zeroexp.cli.plan import PlanConfig
    from zeroexp.config.schemas import ZeroexpConfig
    # every key of a run is the planner's own or one it drops: none is refused as unknown
    run_keys, plan_keys = set(ZeroexpConfig.__dataclass_fields__), set(PlanConfig.__dataclass_fields__)
    assert run_keys - plan_keys == set(RUN_ONLY)


@pytest.mark.parametrize("overrides, row, knob", [
    (("strategy=fsdp2_full", "strategy.reshard_after_forward=null"), "fsdp2_full", ("all_gather", 2 * 2 + 1)),
    (("strategy=fsdp2_full",), "fsdp2_full", ("all_gather", 2 * 2 + 2)),
    (("strategy=deepspeed", "strategy.stage=3"), "deepspeed_stage3", None),
    (("strategy=zero2", "strategy.bucket_cap_mb=0.01"), "zero2", None),
])
def test_a_cells_strategy_plans_its_row_with_its_keys(overrides, row, knob):
    records, _ = run(_compose("plan", *GPT, "world_size=2", "batch_size=2", *overrides))
    assert [r["strategy"] for r in records] == [row]
    if knob:  # FSDP2 with the root kept from forward to backward gathers it once, else twice
        assert records[0]["counts"][knob[0]] == knob[1]
    if row == "zero2":  # 0.01 MiB buckets: many all_gathers where the 25 MiB default has one
        default, _ = run(_compose("plan", *GPT, "world_size=2", "batch_size=2", "strategy=zero2"))
        assert records[0]["counts"]["all_gather"] > default[0]["counts"]["all_gather"] == 1


#: Every strategy of conf/strategy/, each with what it needs to plan (the hybrids a 2 x 2 mesh).
STRATEGY_OPTIONS = sorted(p.stem for p in (Path(ROOT) / "conf" / "strategy").glob("*.yaml"))


@pytest.mark.parametrize("strategy", STRATEGY_OPTIONS)
def test_every_strategy_of_a_run_plans_its_row(strategy):
    """``strategy=<any strategy>`` with its defaults plans the row a cell of it runs (exit 0): no strategy key of a
    run is refused by the planner's key of the same name (FSDP1's ``forward_prefetch`` is a bool where FSDP2's counts
    units; both plan as a cell plans them, ``zeroexp.cell.resolved.units_ahead``)."""
    from zeroexp.cell.resolved import knobs_of
    from conftest import compose_config

    extra = ("world_size=4", "strategy.shard_size=2") if "hybrid" in strategy else ("world_size=2",)
    records, _ = run(_compose("plan", *GPT, "batch_size=2", f"strategy={strategy}", *extra))
    cell = compose_config([*GPT, f"strategy={strategy}", *extra])
    assert [r["strategy"] for r in records] == [str(cell.strategy.layout)]
    if strategy.startswith("fsdp_"):  # FSDP1's bool prefetch plans as the cell's knob: the next unit's or none
        ahead, _ = run(_compose("plan", *GPT, "batch_size=2", f"strategy={strategy}", *extra,
                                "strategy.forward_prefetch=true"))
        assert knobs_of(compose_config([*GPT, f"strategy={strategy}", *extra, "strategy.forward_prefetch=true"])
                        ).forward_prefetch == 1
        assert [r["strategy"] for r in ahead] == [str(cell.strategy.layout)]


def test_strategy_and_strategies_together_are_refused():
    with pytest.raises(ConfigError) as e:
        run(_compose("plan", *GPT, "strategy=ddp", "strategies=[ddp,zero2]"))
    assert e.value.key == "strategies"


def test_a_recommended_command_plans_as_printed():
    """A run's overrides as recommend prints them (the strategy and its selecting key, the model, N, precision,
    offload, checkpointing, micro-batch, accumulation, a bucket) plus run-only keys: the planner answers that row,
    exit 0, and says what it ignored."""
    argv = ["strategy=deepspeed", "strategy.stage=2", *GPT, "world_size=2", "precision=bf16", "offload=none",
            "activation_checkpointing=full", "batch_size=2", "grad_accum=2", "strategy.bucket_cap_mb=25",
            "steps=8", "logger=none", "format=json"]
    out = subprocess.run([sys.executable, "-m", "zeroexp.plan", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    records = json.loads(out.stdout)
    assert [(r["strategy"], r["grad_accum"], r["activation_checkpointing"]) for r in records] == [
        ("deepspeed_stage2", 2, "full")]
    assert "note: ignored: steps=8" in out.stderr and "note: ignored: logger=none" in out.stderr


def test_a_recommended_command_recommends_itself():
    """The overrides of a recommendation, given back to recommend (the network and memory added), fix every axis
    they name: the answer is that configuration alone, at the same step time."""
    from zeroexp.cli.recommend import run as recommend

    question = ["world_size=4", "network=a100_ib", "device_memory=80GB", "global_batch=8", "precisions=[bf16]"]
    first = recommend(_compose("recommend", *GPT, *question, "recommend.top_k=3"), ["model=gpt", *GPT[1:]])
    assert len(first["recommendations"]) == 3
    for rec in first["recommendations"]:
        again = recommend(_compose("recommend", *rec["overrides"], "network=a100_ib", "device_memory=80GB"),
                          ["model=gpt", *GPT[1:]])
        assert again["recommendations"][0]["config"] == rec["config"], (rec["config"], again["recommendations"])
        assert again["recommendations"][0]["step_ms"] == rec["step_ms"]
    with pytest.raises(ConfigError) as e:
        recommend(_compose("recommend", *GPT, *question, "strategy=ddp", "recommend.strategies=[ddp]"))
    assert e.value.key == "recommend.strategies"
