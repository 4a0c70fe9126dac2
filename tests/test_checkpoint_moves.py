"""Checkpoints that move (``checkpoint.load_from``, zeroexp.config.moves, zeroexp.probes.checkpoint): a checkpoint a
cell kept, written by one strategy at one world size, starts another cell under another strategy and world size;
the state it holds after the load equals the checkpoint's tensor by tensor, and its training from there equals the
unsharded reference started from the same state (the equivalence check), every other check as in any cell.

The sources are tests/test_checkpoint.py's cells (the 8 x Linear(64, 64) mlp at N=2, kept: shared, not run again);
the moves grow N (2 -> 3, 2 -> 4 hybrid), shrink it (3 -> 2, a moved cell's own checkpoint), change strategy
within torch's state-dict layout (DDP, FSDP1, FSDP2, HSDP) and kind (full, sharded), on the mlp, a shrunk Hugging
Face Llama in bf16 (rotary buffers) and a model with frozen parameters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import STEPS, WINDOWS, run_cli
from test_hf_models import SHRUNK
from zeroexp.cell.source import META
from zeroexp.config.schemas import validate
from zeroexp.errors import ConfigError, InvalidCell

#: Tensors of the mlp's state: 8 parameters, each with AdamW's exp_avg, exp_avg_sq and step.
MLP_TENSORS = 8 * 4


def _source(cell, strategy: str, kind: str, *more: str, world_size: int = 2, base=None) -> Path:
    """The kept checkpoint of a cell (tests/test_checkpoint.py's where the overrides are its)."""
    over = (f"strategy={strategy}", f"checkpoint={kind}", f"world_size={world_size}", "checkpoint.keep=true", *more)
    result = cell(*over) if base is None else cell(*over, base=base)
    assert result.status == "ok", result.error
    return Path(result.cell_dir) / "checkpoint"


def _moved(result, tensors: int | None, source: Path, strategy: str, world_size: int) -> dict:
    """Every check of a cell that started from ``source`` held, its moved state bit-identical (``tensors`` of them,
    where given); its section."""
    from conftest import held_checks

    checks = held_checks(result)
    assert checks["equivalence"].verdict == "PASS" and checks["checkpoint"].verdict == "PASS"
    assert result.summary["plan"]["check"] == "PASS" and "plan.state" in checks
    assert result.summary["plan"].get("checkpoint", {"check": "PASS"})["check"] == "PASS"  # a saving mover's files
    moved = result.summary["checkpoint"]["moved"]
    assert moved["check"] == "PASS" and moved["reason_codes"] == []
    assert moved["compared_tensors"] == moved["bit_identical_tensors"] == (tensors or moved["compared_tensors"])
    assert moved["max_abs_diff"] == 0.0 and not (moved["differ"] or moved["lost"] or moved["added"] or moved["cast"])
    src = json.loads((source / META).read_text())
    assert moved["source"] == {"dir": str(source.resolve()), "kind": src["kind"], "strategy": strategy,
                               "label": src.get("strategy_label", strategy), "world_size": world_size,
                               "step": src["step"], "precision": src["cell"]["precision"]["name"]}
    assert len(moved["load"]["rank_ms"]) == result.summary["cell"]["world_size"]
    assert "resumed" in json.loads((Path(result.cell_dir) / "manifest.json").read_text())["cell_name"]
    return moved


MOVES = [  # (source strategy, kind, N) -> (target strategy, N, its own keys)
    (("fsdp_full", "sharded"), ("ddp", 3, ())),                                  # FSDP1's shards resharded to DDP
    (("ddp", "full"), ("fsdp2_full", 3, ())),                                    # whole state into uneven DTensors
    (("zro", "full"), ("fsdp_full", 3, ())),                                     # owners' state consolidated, by name
    (("fsdp2_full", "full"), ("zro", 3, ())),                                    # re-partitioned over 3 owners
    (("zero2", "sharded"), ("fsdp2_full", 3, ())),                               # zeroexp's buckets' pieces, by DCP
    (("fsdp2_full", "sharded"), ("zero1", 3, ())),                               # DCP's shards into 3-way buckets
    (("ddp", "full"), ("zero1", 3, ())),                                         # laid out in 3-way buckets
    (("fsdp2_full", "sharded"), ("fsdp2_hybrid", 4, ("strategy.shard_size=2",))),  # onto a 2 x 2 mesh
]


@pytest.mark.parametrize("source, target", MOVES, ids=[f"{s[0]}-{s[1]}-to-{t[0]}-n{t[1]}" for s, t in MOVES])
def test_a_checkpoint_moves_to_another_strategy_and_world_size(cell, source, target):
    strategy, n, keys = target
    where = _source(cell, *source)
    result = cell(f"strategy={strategy}", f"world_size={n}", *keys, f"checkpoint.load_from={where}")
    moved = _moved(result, MLP_TENSORS, where, source[0], 2)
    assert moved["source"]["step"] == STEPS and moved["not_moved"] == []
    assert result.summary["equivalence"]["steps"] == STEPS  # the cell's own steps, after the checkpoint's
    if strategy == "fsdp2_full":  # the whole state in padded shards: planned (PlanKnobs.state_loaded_whole)
        assert result.summary["plan"]["state"]["check"] == "PASS"


def test_a_moved_cell_trains_from_the_checkpoints_state_and_data_position(cell, compose):
    """What the moved cell's first step computes is the checkpoint's model on the batches of the step after the
    checkpoint's: each rank's first loss (iterations.csv) is the loss of the checkpoint's parameters, read whole here,
    on that rank's batch of step STEPS (within the rounding a rank's thread count may change), not on its batch of
    step 0, nor that of freshly initialised parameters. (The equivalence check's bound cannot tell these apart on this
    mlp: its loss, driven to zero, leaves AdamW's reduction-order floor at a few learning-rate steps after 12 steps,
    and the bound at 10x that.)"""
    from conftest import read_csv
    from omegaconf import OmegaConf

    from zeroexp.cell.source import Source
    from zeroexp.models import LOSSES, build_model, make_batch
    from zeroexp.strategies._checkpoint import read_whole

    where = _source(cell, "fsdp_full", "sharded")
    over = ("strategy=ddp", "world_size=3", f"checkpoint.load_from={where}")
    result = cell(*over)
    cfg = compose(*over)
    source = Source.read(where)
    whole = read_whole(source.kind, where)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    fresh = build_model(model_cfg)  # initial weights of its own
    net = build_model(model_cfg)
    net.load_state_dict({n.removeprefix("net."): t for n, t in whole["model"].items()})
    loss_of = LOSSES[cfg.model.loss]
    iterations = read_csv(result, "iterations.csv")
    with torch.no_grad():
        for rank in range(3):
            first = float(iterations[(iterations["rank"] == rank) & (iterations["step"] == 0)]["loss"].iloc[0])
            batch = {step: make_batch(model_cfg, int(cfg.batch_size), int(cfg.seed), step, rank)
                     for step in (source.step, 0)}
            at = {step: float(loss_of(net(b), b)) for step, b in batch.items()}
            assert at[source.step] == pytest.approx(first, rel=1e-5), (rank, at, first)
            assert abs(at[0] - first) > 1e-3 * abs(first), (rank, at, first)
            from_fresh = float(loss_of(fresh(batch[source.step]), batch[source.step]))
            assert abs(from_fresh - first) > 1e-3 * abs(first), (rank, from_fresh, first)


@pytest.mark.parametrize("strategy, kind", [("zero1", "full"), ("zero2", "sharded")])
def test_zeroexps_zero_saves_and_restores_a_checkpoint(cell, strategy, kind):
    """zero1 (bf16: its load casts each bucket's master) and zero2 at N=2. Full: each bucket's master and both
    moments all-gathered (3 calls: the mlp is one bucket) and written by name on rank 0. Sharded: each rank its
    pieces of every parameter (a bucket's shard cuts them anywhere), no tensor gathered, the files' tensors the whole
    state once. Restored into a fresh model beside the trained one, one more step bit-identical; the plan's bytes and
    peaks PASS."""
    bf16 = ("precision=bf16",) if kind == "full" else ()
    result = cell(f"strategy={strategy}", f"checkpoint={kind}", "world_size=2", "checkpoint.keep=true", *bf16)
    assert result.status == "ok", result.error
    ck, plan = result.summary["checkpoint"], result.summary["plan"]["checkpoint"]
    assert ck["check"] == "PASS" and ck["restored_bit_identical"] and ck["continuation_bit_identical"]
    assert ck["compared_tensors"] == 8 and plan["check"] == plan["peaks"]["check"] == "PASS"
    assert plan["peaks"]["load"]["check"] == "PASS"  # judged: sized, not a bound of nothing
    if kind == "full":
        assert ck["save"]["collectives"]["counts"] == {"all_gather": 3}
        assert ck["save"]["rank_bytes_written"][1] == 0 and ck["save"]["bytes_written"] > 3 * 8 * 64 * 64 * 4
    else:
        assert "all_gather" not in ck["save"]["collectives"]["counts"] or ck["save"]["collectives"]["payload_bytes"][
            "all_gather"] < 1024  # DCP's plan exchange alone
        assert all(b > 0 for b in ck["save"]["rank_payload_bytes"])
        assert sum(ck["save"]["rank_payload_bytes"]) == plan["predicted_bytes"] == 8 * 64 * 64 * 12 + 8 * 4


def test_a_moved_cell_saves_where_it_stands_and_shrinks_back(cell):
    """A cell that started from step STEPS writes its checkpoint at step 2 x STEPS; a cell at a smaller N starts from
    it (FSDP1 at N=2 from DDP's checkpoint at N=3)."""
    first = _source(cell, "fsdp_full", "sharded")
    grown = cell("strategy=ddp", "world_size=3", "checkpoint=sharded", "checkpoint.keep=true",
                 f"checkpoint.load_from={first}")
    _moved(grown, MLP_TENSORS, first, "fsdp_full", 2)
    second = Path(grown.cell_dir) / "checkpoint"
    meta = json.loads((second / META).read_text())
    assert meta["step"] == 2 * STEPS and meta["world_size"] == 3 and meta["cell"]["world_size"] == 3
    assert grown.summary["checkpoint"]["continuation_step"] == 2 * STEPS  # its continuation: the step after its last
    shrunk = cell("strategy=fsdp_full", "world_size=2", f"checkpoint.load_from={second}")
    assert _moved(shrunk, MLP_TENSORS, second, "ddp", 3)["source"]["step"] == 2 * STEPS


def test_foreign_models_move(cell):
    """A shrunk Hugging Face Llama in bf16 (FSDP2 N=2, full -> DDP N=3; its rotary inv_freq a buffer) and a model with
    frozen parameters (FSDP1 N=3, sharded -> FSDP2 N=2: the frozen ones hold no optimizer state)."""
    llama = ("logger=none", f"steps={STEPS}", *WINDOWS, *SHRUNK, "precision=bf16")
    where = _source(cell, "fsdp2_full", "full", base=llama)
    moved = _moved(cell("strategy=ddp", "world_size=3", f"checkpoint.load_from={where}", base=llama), 21 * 4, where,
                   "fsdp2_full", 2)
    assert moved["source"]["precision"] == "bf16"
    frozen = ("logger=none", f"steps={STEPS}", *WINDOWS, "model=custom", "model._target_=corpus.frozen_mlp",
              "model.input_shape=[16]", "+model.frozen=[1,2]", "model.wrap=[torch.nn.Linear]")
    where = _source(cell, "fsdp_full", "sharded", world_size=3, base=frozen)
    # 4 bias-free Linear layers, 2 of them frozen: 4 weights, and AdamW's 3 tensors for each of the 2 trained ones
    _moved(cell("strategy=fsdp2_full", "world_size=2", f"checkpoint.load_from={where}", base=frozen), 4 + 2 * 3,
           where, "fsdp_full", 3)
    from zeroexp.strategies import deepspeed as ds_adapter

    if ds_adapter.deepspeed_available():  # DeepSpeed stage 3 partitions the frozen ones too: gathered, as held
        where = _source(cell, "deepspeed", "full", "strategy.stage=3", base=frozen)
        ds = cell("strategy=deepspeed", "strategy.stage=3", "checkpoint=full", "world_size=2", "checkpoint.keep=true",
                  base=frozen).summary
        assert ds["checkpoint"]["check"] == "PASS" and ds["plan"]["checkpoint"]["check"] == "PASS", ds["checkpoint"]
        whole = torch.load(where / "full.pt", weights_only=True)
        assert len(whole["model"]) == 4 and len(whole["optim"]["state"]) == 2
        # its own sharded files: each rank's frozen fragments beside its partitions, planned to the byte
        own = cell("strategy=deepspeed", "strategy.stage=3", "checkpoint=sharded", "world_size=2", base=frozen).summary
        assert own["checkpoint"]["check"] == "PASS" and own["plan"]["checkpoint"]["check"] == "PASS"
        assert own["plan"]["checkpoint"]["predicted_rank_bytes"] == own["plan"]["checkpoint"]["measured_rank_bytes"]


def test_deepspeeds_sharded_partitions_convert_and_move(cell, compose, tmp_path):
    """DeepSpeed stage 3's sharded checkpoint at N=2 (its padded partitions in its own files) is refused as a cell's
    start, naming the convert command that turns it into torch's layout; converted (DeepSpeed's ds_to_universal merges
    the partitions), every tensor equals the twin cell's full checkpoint (same training, written whole) bit for bit,
    and FSDP2 at N=3 starts from it with every check PASS. Stage 0's (no partitions) is refused by name."""
    from test_checkpoint import _ds_cell

    from zeroexp.strategies._checkpoint import read_full

    sharded = Path(_ds_cell(cell, 3, "sharded").cell_dir) / "checkpoint"
    with pytest.raises(InvalidCell, match="checkpoint.load_from") as e:
        validate(compose("strategy=fsdp2_full", "world_size=3", f"checkpoint.load_from={sharded}"))
    printed = f"python -m zeroexp.checkpoint convert {sharded} {sharded}_full"
    assert printed in str(e.value)
    done = run_cli("convert", str(sharded), str(tmp_path / "full"), app="zeroexp.cli.checkpoint")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verified"]["bit_identical_tensors"] == MLP_TENSORS
    twin = read_full(Path(_ds_cell(cell, 3, "full").cell_dir) / "checkpoint")
    converted = read_full(tmp_path / "full")
    from zeroexp.probes.checkpoint import moved_state

    same = moved_state(twin, converted["model"], converted["optim"])
    assert same["bit_identical_tensors"] == same["compared_tensors"] == MLP_TENSORS, same
    _moved(cell("strategy=fsdp2_full", "world_size=3", f"checkpoint.load_from={tmp_path / 'full'}"), MLP_TENSORS,
           tmp_path / "full", "deepspeed", 2)
    stage0 = Path(_ds_cell(cell, 0, "sharded").cell_dir) / "checkpoint"
    done = run_cli("convert", str(stage0), str(tmp_path / "x"), app="zeroexp.cli.checkpoint")
    assert done.returncode == 2 and "SRC=" in done.stderr and "stage 0" in done.stderr, done.stderr


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_moves_its_full_state_both_ways(cell, stage):
    """DeepSpeed's full checkpoint is torch's state-dict layout (the fp32 masters, both moments and Adam's step by
    parameter name): a DeepSpeed cell at N=2 starts FSDP2 at N=3, and a DDP checkpoint at N=2 starts DeepSpeed at
    N=3 (its safe_set_full_* API), each with every tensor bit-identical after the move."""
    from test_checkpoint import _ds_cell

    where = Path(_ds_cell(cell, stage, "full").cell_dir) / "checkpoint"
    _moved(cell("strategy=fsdp2_full", "world_size=3", f"checkpoint.load_from={where}"), MLP_TENSORS, where,
           "deepspeed", 2)
    where = _source(cell, "ddp", "full")
    _moved(cell("strategy=deepspeed", f"strategy.stage={stage}", "world_size=3", f"checkpoint.load_from={where}"),
           MLP_TENSORS, where, "ddp", 2)


def test_a_parameter_no_step_graded_restores_and_moves_without_state(cell):
    """A branch forward never calls: no gradient, so no AdamW state in the checkpoint. DDP's own full round trip and
    FSDP2's sharded one restore it (torch 2.13's strict set_state_dict refused it: "Missing optimizer state"); FSDP2
    at N=3 starts from the first, DDP at N=3 from the second, holding no state for it either (the zero state the load
    makes is removed): every check, state included."""
    branch = ("logger=none", f"steps={STEPS}", *WINDOWS, "model=custom", "model._target_=corpus.unused_branch",
              "model.input_shape=[8]", "model.wrap=[torch.nn.Linear]")
    where = _source(cell, "ddp", "full", base=branch)
    assert "net.unused.weight" not in torch.load(where / "full.pt", weights_only=True)["optim"]["state"]
    moved = _moved(cell("strategy=fsdp2_full", "world_size=3", f"checkpoint.load_from={where}", base=branch), None,
                   where, "ddp", 2)
    assert moved["initialised"] == [] and moved["added"] == []
    where = _source(cell, "fsdp2_full", "sharded", base=branch)  # through DCP: a partial load, the same removal
    moved = _moved(cell("strategy=ddp", "world_size=3", f"checkpoint.load_from={where}", base=branch), None, where,
                   "fsdp2_full", 2)
    assert moved["initialised"] == [] and moved["added"] == []


def test_a_sweep_writes_each_source_once_and_moves_it_to_each_target(tmp_path):
    """``experiment=checkpoint_moves`` with one source and two targets: the source cell (DeepSpeed stage 3 at N=2 on
    the GPT, whose tied head is one parameter under two state-dict names: its second holds an empty local tensor
    there) runs once, before the first target, and writes its master under both names; zero2 and FSDP2 at N=3 start
    from it, every check PASS; the sweep report lays the moves out by the writer's and the target's labels; a later
    job of the same source reuses its checkpoint."""
    from conftest import compose_config
    from zeroexp.launch.sources import ensure_source
    from zeroexp.strategies import deepspeed as ds_adapter

    if not ds_adapter.deepspeed_available():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    source = "strategy=deepspeed strategy.stage=3 world_size=2"
    over = ["experiment=checkpoint_moves", f'checkpoint.source="{source}"', "world_size=3", "logger=none",
            f"steps={STEPS}", *WINDOWS, "model.n_layer=2", f"checkpoint.sources_dir={tmp_path / 'sources'}"]
    done = run_cli("--multirun", *over, "strategy=zero2,fsdp2_full", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("source 'strategy=deepspeed strategy.stage=3 world_size=2': writing") == 1
    assert done.stdout.count("': reusing") == 1
    (written,) = (tmp_path / "sources").glob("deepspeed_stage3_n2_*")
    meta = json.loads((written / "checkpoint" / META).read_text())
    assert (meta["strategy"], meta["strategy_label"], meta["world_size"], meta["kind"]) == (
        "deepspeed", "deepspeed-stage3", 2, "full")
    whole = torch.load(written / "checkpoint" / "full.pt", weights_only=True)["model"]
    assert torch.equal(whole["net.lm_head.weight"], whole["net.wte.weight"]) and whole["net.wte.weight"].numel() > 0
    for cell_dir in (tmp_path / "sweep").glob("*_resumed_n3_*"):
        summary = json.loads((cell_dir / "summary.json").read_text())
        moved = summary["checkpoint"]["moved"]
        assert moved["check"] == "PASS" and moved["max_abs_diff"] == 0.0 and moved["compared_tensors"] > 4 * 26
        assert moved["source"]["label"] == "deepspeed-stage3" and moved["source"]["step"] == STEPS
        assert summary["equivalence"]["check"] == "PASS", summary["equivalence"]
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert "| deepspeed-stage3 N=2 (full) | PASS | PASS |" in report, report
    assert "zero2 N=3" in report and "fsdp2_full N=3" in report
    said: list[str] = []
    cfg = compose_config([*over, "strategy=ddp"])
    assert ensure_source(cfg, over, say=said.append) == written / "checkpoint" and "reusing" in said[0]
    refused = [*over[:1], 'checkpoint.source="strategy=fsdp2_hybrid world_size=3"', *over[2:]]  # no shard group of 3
    with pytest.raises(InvalidCell, match="checkpoint.source") as e:  # the source cell's own refusal, the job's
        ensure_source(compose_config([*refused, "strategy=ddp"]), refused, say=said.append)
    assert "exit 2" in str(e.value) and "shard_size" in str(e.value)


def test_what_cannot_start_a_cell_is_refused_before_launch(cell, compose, tmp_path):
    where = shutil.copytree(_source(cell, "ddp", "full"), tmp_path / "ddp-full")
    for strategy in ("fsdp_full", "fsdp2_hybrid", "deepspeed"):
        assert validate(compose(f"strategy={strategy}", "world_size=4", f"checkpoint.load_from={where}",
                                *(["strategy.shard_size=2"] if strategy == "fsdp2_hybrid" else [])))
    refusals = {
        ("strategy=zro", f"checkpoint.load_from={_source(cell, 'ddp', 'sharded')}"):
            (InvalidCell, "the cell's strategy, zro, reads and writes full checkpoints"),
        ("strategy=deepspeed", f"checkpoint.load_from={_source(cell, 'ddp', 'sharded')}"):
            (InvalidCell, "the cell's strategy, deepspeed, reads and writes full checkpoints"),
        (f"checkpoint.load_from={_source(cell, 'zro', 'sharded')}",): (InvalidCell, "the checkpoint's strategy, zro"),
        ("model.width=32", f"checkpoint.load_from={where}"): (InvalidCell, "model.width=64 there, 32 here"),
        ("optimizer.lr=0.5", f"checkpoint.load_from={where}"): (InvalidCell, "optimizer.lr="),
        ("dry_run=true", f"checkpoint.load_from={where}"): (ConfigError, "a dry run holds no tensor values"),
        (f"checkpoint.load_from={tmp_path / 'nothing'}",): (ConfigError, "no meta.json"),
    }
    for overrides, (error, said) in refusals.items():
        with pytest.raises(error, match="checkpoint.load_from") as e:
            validate(compose(*overrides))
        assert said in str(e.value), (overrides, str(e.value))
    assert validate(compose("optimizer.impl=foreach", "model.wrap=[]", f"checkpoint.load_from={where}"))  # free keys
    meta = json.loads((where / META).read_text())
    (where / META).write_text(json.dumps({k: v for k, v in meta.items() if k != "cell"}))
    with pytest.raises(ConfigError, match="records no cell configuration"):
        validate(compose(f"checkpoint.load_from={where}"))


def test_a_source_that_cannot_be_written_or_read_is_refused_before_launch(compose):
    """``checkpoint.source``: a spelling it does not read stops a sweep (ConfigError); a kind the cell's or the
    source's strategy keeps in a layout of its own refuses the one job (InvalidCell); each names the key."""
    for spec, said in {"world_size=2": "names no strategy=", "strategy=ddp model.width=32": "'model.width=32'",
                       "strategy=nope": "strategy=nope is none of", "strategy=ddp world_size=0": "world_size=0",
                       "strategy=ddp checkpoint=none": "checkpoint=none", "strategy=ddp world": "'world'"}.items():
        with pytest.raises(ConfigError, match="checkpoint.source") as e:
            validate(compose(f'checkpoint.source="{spec}"'))
        assert not isinstance(e.value, InvalidCell) and said in str(e.value), (spec, str(e.value))
    for over, said in {("strategy=deepspeed", "strategy=ddp checkpoint=sharded"): "the cell's strategy, deepspeed",
                       ("strategy=ddp", "strategy=zro checkpoint=sharded"): "the checkpoint's strategy, zro"}.items():
        with pytest.raises(InvalidCell, match="checkpoint.source") as e:
            validate(compose(over[0], "world_size=2", f'checkpoint.source="{over[1]}"'))
        assert said in str(e.value), (over, str(e.value))
    with pytest.raises(ConfigError, match="checkpoint.source"):
        validate(compose('checkpoint.source="strategy=ddp"', "checkpoint.load_from=/nowhere"))
    assert validate(compose("strategy=fsdp2_full", "world_size=2", 'checkpoint.source="strategy=ddp world_size=3"',
                            "checkpoint.sources_dir=/nonexistent/sources")).load_from is None  # not written yet
    from zeroexp.cell.written import source_dir

    where = {over: source_dir(compose(*over)) for over in [  # one directory per checkpoint, whoever starts from it
        ('checkpoint.source="strategy=ddp"', "world_size=2"), ('checkpoint.source="strategy=ddp"', "world_size=3"),
        ('checkpoint.source="strategy=ddp world_size=2"', "world_size=3"),
        ('checkpoint.source="strategy=ddp world_size=2"', "world_size=4", "strategy=zro")]}
    assert len(set(where.values())) == 3 and list(where.values())[2].name.startswith("ddp_n2_")


def test_convert_moves_a_checkpoint_offline_and_a_cell_starts_from_it(cell, tmp_path):
    """``python -m zeroexp.checkpoint convert``: DDP's sharded checkpoint (N=2) to one full file, that to a sharded
    one recorded for FSDP2 at N=3, each read back bit-identical, and an FSDP2 cell at N=3 starts from the last."""
    src = shutil.copytree(_source(cell, "ddp", "sharded"), tmp_path / "src")
    convert = lambda *argv: run_cli("convert", *map(str, argv), app="zeroexp.cli.checkpoint")  # noqa: E731
    done = convert(src, tmp_path / "full")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["kind"], answer["strategy"], answer["world_size"], answer["tensors"]) == ("full", "ddp", 2,
                                                                                            MLP_TENSORS)
    assert answer["verified"] == {"compared_tensors": MLP_TENSORS, "bit_identical_tensors": MLP_TENSORS,
                                  "max_abs_diff": 0.0}
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["convert.json", "full.pt", META]
    done = convert(tmp_path / "full", tmp_path / "sharded", "strategy=fsdp2_full", "world_size=3")
    assert done.returncode == 0, done.stderr
    meta = json.loads((tmp_path / "sharded" / META).read_text())
    assert (meta["kind"], meta["strategy"], meta["world_size"], meta["step"]) == ("sharded", "fsdp2_full", 3, STEPS)
    assert meta["converted_from"]["kind"] == "full" and meta["cell"]["world_size"] == 3
    manifest = json.loads((tmp_path / "sharded" / "convert.json").read_text())
    assert manifest["tensor_count"] == len(manifest["tensors"]) == MLP_TENSORS
    assert manifest["bytes"] == sum(t["bytes"] for t in manifest["tensors"]) > 3 * 8 * 64 * 64 * 4
    assert not list(tmp_path.glob("*.partial"))
    _moved(cell("strategy=fsdp2_full", "world_size=3", f"checkpoint.load_from={tmp_path / 'sharded'}"), MLP_TENSORS,
           tmp_path / "sharded", "fsdp2_full", 3)
    refused = {("convert", src, tmp_path / "full"): "DST=",  # exists, not empty
               ("move", src, tmp_path / "x"): "command='move'",
               ("convert", src, tmp_path / "x", "model.width=32"): "model.width=",
               ("convert", src, tmp_path / "x", "checkpoint=sharded", "strategy=zro"): "strategy='zro'",
               ("convert", _source(cell, "zro", "sharded"), tmp_path / "x"): "a layout of its own",
               ("convert", tmp_path / "nothing", tmp_path / "x"): "SRC="}
    for argv, said in refused.items():
        done = run_cli(*map(str, argv), app="zeroexp.cli.checkpoint")
        assert done.returncode == 2 and said in done.stderr, (argv, done.stderr)
        assert not (tmp_path / "x").exists()


def test_the_moved_state_is_judged_tensor_by_tensor(tmp_path):
    """moved_state against a whole checkpoint's state: equal, a tensor changed, cast, lost, and the zero
    optimizer state torch's state-dict API creates for a parameter without any (not a difference)."""
    from zeroexp.probes.checkpoint import moved_reasons, moved_state

    w, b = torch.arange(6.0).reshape(2, 3), torch.ones(2)
    state = {"net.w": {"step": torch.tensor(3.0), "exp_avg": w / 7, "exp_avg_sq": w / 9}}
    whole = {"model": {"net.w": w, "net.b": b}, "optim": {"state": state, "param_groups": []}}

    def judged(model, optim):
        moved = moved_state(whole, model, {"state": optim})
        return moved, [r.code.value for r in moved_reasons(moved)]

    same, codes = judged({"net.w": w.clone(), "net.b": b.clone()}, {"net.w": dict(state["net.w"])})
    assert codes == [] and same["compared_tensors"] == same["bit_identical_tensors"] == 5
    changed = dict(state["net.w"], exp_avg=state["net.w"]["exp_avg"] + 1e-7)
    moved, codes = judged({"net.w": w, "net.b": b}, {"net.w": changed})
    assert codes == ["checkpoint.move_differs"] and moved["differ"][0]["tensor"] == "net.w:exp_avg"
    moved, codes = judged({"net.w": w.bfloat16(), "net.b": b}, {"net.w": state["net.w"]})
    assert codes == [] and [c["tensor"] for c in moved["cast"]] == ["net.w"] and moved["cast"][0]["to"] == "bfloat16"
    moved, codes = judged({"net.w": w}, {"net.w": state["net.w"]})
    assert codes == ["checkpoint.move_names_differ"] and moved["lost"] == ["net.b"]
    fresh = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    moved, codes = judged({"net.w": w, "net.b": b}, {"net.w": state["net.w"], "net.b": fresh})
    assert codes == [] and moved["initialised"] == ["net.b:exp_avg", "net.b:exp_avg_sq", "net.b:step"]
    moved, codes = judged({"net.w": w, "net.b": b}, {"net.w": state["net.w"], "net.b": dict(fresh, exp_avg=b)})
    assert codes == ["checkpoint.move_names_differ"] and "net.b:exp_avg" in moved["added"]


def test_a_full_checkpoint_holds_each_tensor_compact(tmp_path):
    """torch.save writes a tensor's whole storage: a view of a padded buffer (FSDP2's full state dict: a DTensor made
    whole out of its uneven all_gather) is written, and read back by a loader that keeps it, as compact; one tensor
    under two names stays one."""
    from zeroexp.strategies._checkpoint import compact

    padded = torch.arange(66 * 4, dtype=torch.float32).reshape(66, 4)
    view, tied = padded[:64], torch.ones(3)
    state = {"model": {"w": view, "a": tied, "b": tied}, "optim": {"state": {"w": {"exp_avg": view * 2}}}}
    small = compact(state)
    assert small["model"]["a"] is small["model"]["b"] is tied  # already compact, and one tensor
    assert torch.equal(small["model"]["w"], view) and small["model"]["w"].untyped_storage().nbytes() == 64 * 4 * 4
    torch.save(small, tmp_path / "small.pt")
    torch.save(state, tmp_path / "padded.pt")
    read = torch.load(tmp_path / "small.pt", weights_only=True)
    assert read["model"]["w"].untyped_storage().nbytes() == 64 * 4 * 4 and read["model"]["a"] is read["model"]["b"]
    assert (tmp_path / "padded.pt").stat().st_size - (tmp_path / "small.pt").stat().st_size >= 2 * 4 * 4


def test_the_report_lays_the_moves_out_as_a_matrix():
    """The sweep report's moves: the checkpoint's writer by row, the cell by column, each entry its verdict (the moved
    state's, then the resumed training's); no table without a moved cell."""
    import pandas as pd

    from zeroexp.report.moves import moves_table

    def row(target: str, n: int, source: str | None, moved: str = "PASS", equivalence: str = "PASS") -> dict:
        out = {"cell.strategy": target, "cell.world_size": n, "equivalence.check": equivalence}
        if source is not None:
            out.update({"checkpoint.moved.source.strategy": source, "checkpoint.moved.source.world_size": 2,
                        "checkpoint.moved.source.kind": "full", "checkpoint.moved.check": moved})
        return out

    labelled = {**row("deepspeed", 3, "deepspeed"), "checkpoint.moved.source.label": "deepspeed-stage3",
                "checkpoint.moved.target_label": "deepspeed-stage2"}  # a label: the strategy with its axes
    ok = pd.DataFrame([row("ddp", 3, "fsdp_full"), row("fsdp2_full", 3, "fsdp_full", equivalence="FAIL"),
                       row("ddp", 3, "zro", moved="FAIL"), labelled, row("zro", 2, None)])
    shown = moves_table(ok).display()
    assert list(shown.columns) == ["from (writer, N, kind)", "ddp N=3", "fsdp2_full N=3", "deepspeed-stage2 N=3"]
    assert shown.values.tolist() == [["fsdp_full N=2 (full)", "PASS", "equivalence FAIL", "-"],
                                     ["zro N=2 (full)", "moved FAIL", "-", "-"],
                                     ["deepspeed-stage3 N=2 (full)", "-", "-", "PASS"]]
    assert moves_table(ok.iloc[4:]) is None
