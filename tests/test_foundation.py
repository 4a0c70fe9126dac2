"""The foundation: configs compose, bad input is refused up front, every strategy trains the same numbers,
sweeps run each distinct cell once, W&B writes one offline run per cell from rank 0 only."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import STEPS, WINDOWS, read_csv, run_cli
from zeroexp.cli.run import CONF_DIR
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.results.verdict import Code

LADDER = [("strategy=ddp",), ("strategy=zro",), ("strategy=fsdp_grad_op",),
          ("strategy=fsdp_full", "prefetch=pre"), ("strategy=fsdp_full", "prefetch=post"),
          ("strategy=fsdp_full", "prefetch=none")]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "strategy", "prefetch", "precision", "offload", "logger", "experiment"])
def test_every_option_composes_and_validates(compose, group):
    options = _options(group)
    assert options, group
    for option in options:
        overrides = [f"{group}={option}"]
        if group == "prefetch":
            overrides.append("strategy=fsdp_full")
        if group == "precision":  # with the first strategy whose row implements it (StateLayout.precisions)
            from zeroexp.formulas.rows import row_of
            from zeroexp.strategies import registered

            overrides.append(f"strategy={min(n for n in registered() if option in row_of(n).precisions)}")
        if group == "offload":  # with DeepSpeed ZeRO-3, which implements every offload (StrategyAdapter.offloads)
            overrides += ["strategy=deepspeed", "strategy.stage=3"]
        if group == "strategy" and option in ("fsdp_hybrid", "fsdp2_hybrid"):  # its required key
            overrides.append("strategy.shard_size=2")
        if (group, option) == ("model", "hf"):  # its architecture (a local config.json would do too)
            overrides += ["model.arch=llama", "model.num_hidden_layers=1", "model.hidden_size=32",
                          "model.intermediate_size=64", "model.num_attention_heads=2", "model.vocab_size=64"]
        if (group, option) == ("model", "custom"):  # its two required keys
            overrides += ["model._target_=torch.nn.Linear", "+model.in_features=4", "+model.out_features=4",
                          "model.input_shape=[4]"]
        cfg = compose(*overrides, base=("logger=none",))
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        try:
            validate(cfg)
        except ConfigError as e:  # an option of an optional extra that is not installed says how to get it; a model
            # preset larger than this host (llama3_70b's state at N=4) is refused by the resource check, naming N
            assert "is not installed; install it with: pip install" in str(e) or (
                group == "model" and e.key == "world_size" and "resources.check=false" in str(e)), (option, e)


@pytest.mark.parametrize("override, key", [
    ("world_size=0", "world_size"), ("world_size=-4", "world_size"), ("steps=0", "steps"),
    ("batch_size=0", "batch_size"), ("model.depth=0", "model.depth"), ("model.width=-3", "model.width"),
    ("model.loss=hinge", "model.loss"), ("model.input_shape=[]", "model.input_shape"),
    ("model._target_=torch.nn.NoSuchLayer", "model._target_"), ("device=tpu", "device"),
    ("logger.mode=loud", "logger.mode"), ("probes.profile_steps=0", "probes.profile_steps"),
])
def test_validation_names_the_key(compose, override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose(override))
    assert e.value.key == key and key in str(e.value)


def test_prefetch_on_a_strategy_without_it_is_refused_only_when_asked_for(compose):
    cfg = compose("strategy=ddp", "prefetch=post")
    validate(cfg)  # in a sweep the axis is ignored (and the cell de-duplicated)
    with pytest.raises(ConfigError, match="prefetch does not apply to strategy=ddp"):
        validate(cfg, explicit_overrides=("strategy", "prefetch"))


def _zeroexp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m zeroexp <args>`` in this process (conftest.run_cli), without this environment's W&B settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    return run_cli(*args, cwd=cwd, env=env)


@pytest.mark.parametrize("override, needle", [
    ("strategy=foo", "strategy"), ("world_size=-4", "world_size"), ("model.width=abc", "model.width"),
])
def test_cli_refuses_bad_overrides_before_any_rank(tmp_path, override, needle):
    proc = _zeroexp(override, "logger=none", f"hydra.run.dir={tmp_path}/cell", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert not (tmp_path / "cell").exists()  # nothing that looks like a result


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_strategy_trains_the_same_losses_as_ddp(cell, world_size):
    results = {o: cell(*o, f"world_size={world_size}") for o in LADDER}
    for o, r in results.items():
        assert r.status == "ok", (o, r.error)
        for name in ("manifest.json", "summary.json", "iterations.csv"):
            assert (r.cell_dir / name).exists(), (o, name)
    ref = read_csv(results[LADDER[0]], "iterations.csv").sort_values(["rank", "step"]).reset_index(drop=True)
    assert len(ref) == world_size * STEPS and ref.loss.gt(0).all()
    assert ref.groupby("rank").loss.apply(lambda s: s.iloc[-1] < s.iloc[0]).all()  # it trains
    for o, r in results.items():
        it = read_csv(r, "iterations.csv").sort_values(["rank", "step"]).reset_index(drop=True)
        assert (it[["rank", "step"]].values == ref[["rank", "step"]].values).all()
        rel = ((it.loss - ref.loss).abs() / ref.loss.abs()).max()
        assert rel <= 1e-5, (o, rel)
        assert r.summary["final_loss"] == pytest.approx(results[LADDER[0]].summary["final_loss"], rel=1e-5)


def test_manifest_and_summary_fields(cell):
    r = cell("strategy=ddp", "world_size=2")
    m = __import__("json").loads((r.cell_dir / "manifest.json").read_text())
    assert m["status"] == "ok" and m["error"] is None and m["world_size"] == 2
    assert m["backend"] == "gloo" and m["device_type"] == "cpu" and m["launcher"] == "local"
    assert {"python", "torch", "lightning", "hydra-core", "omegaconf", "wandb", "deepspeed"} <= set(m["versions"])
    assert m["cell"] == {"model": "mlp", "strategy": "ddp", "precision": "fp32", "offload": "none", "world_size": 2}
    assert m["config"]["strategy"]["bucket_cap_mb"] == 25.0  # resolved
    assert m["started_at"] <= m["ended_at"]
    s = r.summary
    assert s["status"] == "ok" and s["cell"] == m["cell"] and s["world_size"] == 2 and s["steps"] == STEPS
    assert m["schema_version"] == s["schema_version"] == 2  # docs/results.md, Schema versions


def test_multirun_runs_each_distinct_cell_once(ladder_sweep):
    """The session's ladder sweep (conftest.LADDER_SWEEP): 4 strategies x 3 prefetch = 12 jobs, 6 distinct cells
    (prefetch applies to fsdp_full only), logger=wandb."""
    sweep, proc = ladder_sweep
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = sorted(p.parent for p in sweep.glob("*/manifest.json"))  # sweep/wandb is the report's run
    assert len(cells) == 6, cells  # 12 jobs, 6 distinct cells: prefetch does not apply to ddp, zro, fsdp_grad_op
    assert proc.stdout.count("already ran in this sweep") == 12 - 6
    assert proc.stdout.strip().splitlines()[-1] == str(sweep)
    for c in cells:
        for name in ("manifest.json", "summary.json", "iterations.csv"):
            assert (c / name).exists(), (c, name)
        # W&B: one offline run per cell, written by rank 0 only, grouped by the sweep
        from zeroexp.results.wandb_offline import read_run

        runs = list((c / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, runs
        run = read_run(runs[0])
        assert run["run"]["name"] == c.name and run["run"]["group"] == sweep.name
        assert run["summary"]["status"] == "ok" and run["summary"]["world_size"] == 2
        assert len([h for h in run["history"] if "train/loss_rank0" in h]) == STEPS  # conftest.SWEEP_SMALL
    assert not list(sweep.parent.glob("wandb")) and not list(sweep.parent.glob("outputs"))  # nothing in its cwd


def test_any_module_through_target(cell, compose):
    """torch's own TransformerEncoderLayer, built from the model config's _target_ and its arguments."""
    base = ("logger=none", f"steps={STEPS}", *WINDOWS)
    with pytest.raises(ConfigError, match="width"):
        validate(compose("model=transformer_layer", "+model.width=64", base=()))
    ddp = cell("model=transformer_layer", "strategy=ddp", "world_size=2", base=base)
    # logger=csv: Lightning's CSV logger on rank 0, the one logger the training step hands its loss to
    fsdp = cell("model=transformer_layer", "strategy=fsdp_full", "prefetch=pre", "world_size=2",
                "strategy.wrap=[torch.nn.TransformerEncoderLayer]", base=("logger=csv", *base[1:]))
    assert ddp.status == "ok" and fsdp.status == "ok", (ddp.error, fsdp.error)
    a, b = read_csv(ddp, "iterations.csv"), read_csv(fsdp, "iterations.csv")
    assert ((a.loss - b.loss).abs() / a.loss.abs()).max() <= 1e-5
    logged = read_csv(fsdp, "csv/metrics.csv")
    assert logged.step.tolist() == list(range(STEPS))
    assert logged["train/loss_rank0"].tolist() == pytest.approx(b[b["rank"] == 0].loss.tolist(), rel=1e-6)
    assert not (ddp.cell_dir / "csv").exists()  # no logger, nothing logged


def test_model_custom_runs_a_module_from_the_command_line_alone(cell, compose):
    """model=custom holds only what every model needs: _target_ and input_shape are required, the factory's
    arguments come with +model.<arg>=..."""
    base = ("logger=none", f"steps={STEPS}", *WINDOWS)
    for overrides, key in ((("model=custom",), "model._target_"),
                           (("model=custom", "model._target_=torch.nn.Linear"), "model.input_shape")):
        with pytest.raises(ConfigError) as e:
            validate(compose(*overrides, base=base))
        assert e.value.key == key
    r = cell("model=custom", "model._target_=torch.nn.Linear", "+model.in_features=16", "+model.out_features=16",
             "model.input_shape=[16]", "world_size=2", base=base)
    assert r.status == "ok", r.error
    assert r.summary["cell"]["model"] == "custom" and r.summary["state"]["check"] == "PASS"


def test_a_model_found_good_is_not_built_again_and_a_bad_one_is_refused_every_time(compose, monkeypatch):
    """The model check (a meta build, one forward and the loss) runs once per model config in a process: a sweep's
    jobs over strategies share it; another model, or any refusal, is checked afresh."""
    from zeroexp.config import model_check

    base = ("logger=none",)
    built = []
    real = model_check._check_model_builds
    monkeypatch.setattr(model_check, "_check_model_builds", lambda cfg: built.append(cfg.model._target_) or real(cfg))
    from zeroexp.cell.memo import invocation_memo

    with invocation_memo(fresh=True):  # this test's own invocation: nothing checked yet
        linear = ("model=custom", "model._target_=torch.nn.Linear", "+model.in_features=16", "+model.out_features=16")
        for strategy in ("ddp", "zero2", "fsdp_full"):
            validate(compose(*linear, "model.input_shape=[16]", f"strategy={strategy}", "world_size=2", base=base))
        assert built == ["torch.nn.Linear"]
        validate(compose(*linear[:3], "+model.out_features=8", "model.input_shape=[16]", "world_size=2", base=base))
        assert len(built) == 2  # another model: built
        for _ in range(2):
            with pytest.raises(ConfigError) as e:
                validate(compose(*linear, "model.input_shape=[12]", "world_size=2", base=base))
            assert e.value.key == "model.input_shape"
        assert len(built) == 4


def test_every_registered_probe_has_its_dry_run_section_or_says_why_not(tmp_path, monkeypatch):
    """A dry run goes through one loop over the registered probes (zeroexp.rank.dryrun._finalize): each gives its
    section (``Probe.dry_report``) or its reason (``Probe.dry_run_absent``); a probe with neither stops the dry run
    rather than dropping its result."""
    from zeroexp.probes import Probe, ProbeReport, registry
    import zeroexp.rank.dryrun as dryrun

    for cls in registry():
        assert cls.dry_report.__func__ is not Probe.dry_report.__func__ or cls.dry_run_absent, cls.name

    class Silent(Probe):
        name = "silent"

    class Said(Probe):
        name = "said"

        @classmethod
        def dry_report(cls, results, cell, source):
            return ProbeReport({"check": "n/a", "seen": results})

    cfg = OmegaConf.create({"world_size": 2, "logger": {"name": "none"}})
    monkeypatch.setattr(dryrun, "write_measured", lambda cell, summary, tables, **kw: summary)
    info = {"cell": "c", "cell_id": "i"}
    monkeypatch.setattr(dryrun, "probes_for", lambda cfg: [Said])
    summary = dryrun._finalize(tmp_path, cfg, info, "derived", {"said": [{"x": 1}]}, 0, None)
    assert summary["said"] == {"check": "n/a", "seen": [{"x": 1}]} and summary["dry_run"]["absent"] == {}
    monkeypatch.setattr(dryrun, "probes_for", lambda cfg: [Said, Silent])
    with pytest.raises(RuntimeError, match="'silent' gave no dry-run section and no reason"):
        dryrun._finalize(tmp_path, cfg, info, "derived", {"said": [{"x": 1}]}, 0, None)


def test_schedule_is_assembled_from_the_probes():
    """Each probe declares its steps (``Probe.steps``); the schedule, its checks and a dry run's absent sections
    come from the probe registry, so a new probe with a window moves the timed steps by itself."""
    from zeroexp.rank.dryrun import ABSENT
    from zeroexp.probes import Probe, Steps, registry
    from zeroexp.cell.schedule import Schedule

    cfg = OmegaConf.create({"steps": 12, "warmup_steps": 3, "grad_accum": 1, "dry_run": False,
                            "probes": {"profile_steps": 2, "memory_steps": 1}})
    s = Schedule.from_cfg(cfg)
    assert (s.state_step, s.profiled, s.memory_tracked, s.timed) == (3, range(3, 5), range(5, 6), range(6, 12))
    assert s.problems() == []
    assert list(ABSENT) == ["iterations", "memory", "timing", "equivalence", "grad_norm"]

    class Traced(Probe):
        name = "traced"
        steps = Steps("traced_steps", key="probes.traced_steps")

    cfg.probes.traced_steps = 4
    s = Schedule.from_cfg(cfg, [*registry(), Traced])
    assert (s.traced_steps, s.timed) == (range(6, 10), range(10, 12))
    cfg.steps = 11  # too few steps is no problem: what does not fit is skipped, the rest keeps its steps
    s = Schedule.from_cfg(cfg, [*registry(), Traced])
    assert s.problems() == [] and (s.profiled, s.traced_steps, s.timed) == (range(3, 5), range(6, 10), range(0))
    assert s.skipped == {"timed": "too few steps: fewer than 2 timed steps left after warm-up and the other probes' "
                                  "steps (steps=11, warmup_steps=3; all probes fit in steps >= 12)"}
    s = Schedule.from_cfg(OmegaConf.create({**cfg, "steps": 2}))
    assert (s.state_step, s.profiled, s.memory_tracked, s.timed) == (None, range(0), range(0), range(0))
    assert sorted(s.skipped) == ["memory_tracked", "profiled", "state_step", "timed"]
    s = Schedule.from_cfg(OmegaConf.create({**cfg, "steps": 5}))  # warm-up, then the profiled window only
    assert (s.state_step, s.profiled, sorted(s.skipped)) == (3, range(3, 5), ["memory_tracked", "timed"])


def test_a_short_run_runs_and_says_what_it_skipped(tmp_path):
    """steps=2: every probe that needs a step after warm-up reads n/a with the reason; the digest says so."""
    proc = run_cli("steps=2", "logger=none", "world_size=2", "model.width=32", f"hydra.run.dir={tmp_path}/cell",
                   cwd=tmp_path)  # python -m zeroexp, in this process
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "cell" / "summary.json").read_text())
    assert sorted(summary["skipped"]) == ["collectives", "memory", "state", "timing"]
    for name in summary["skipped"]:
        assert summary[name]["check"] == "n/a" and summary[name]["reason_codes"] == [Code.TOO_FEW_STEPS], name
        assert summary[name]["reason"] == summary[name]["reasons"][0], name
    assert summary["equivalence"]["check"] == "PASS"
    assert proc.stdout.count("not measured: too few") == 4  # the digest line of each skipped probe


def test_a_cell_says_what_it_will_hold_before_its_ranks_start(compose):
    """Before launch the command line prints the model's parameters (trainable ones where some are frozen) and the
    planned state of its largest rank, from the planner's row: here a LoRA GPT under zero2 at N=2."""
    import re

    import torch

    from zeroexp.config.resources import estimate, prelaunch_line
    from zeroexp.models import build_model

    cfg = compose("model=lora_gpt", "strategy=zero2", "world_size=2", base=("logger=none",))
    cell = validate(cfg)
    with torch.device("meta"):
        net = build_model(cfg.model)
    numel = sum(p.numel() for p in net.parameters())
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    line = prelaunch_line(cfg, cell.shape)
    assert line.startswith(f"lora_gpt: {numel:,} parameters ({trainable:,} trainable); planned per rank: ")
    assert "the planner's zero2 row" in line and "2 ranks need" in line
    mib = float(re.search(r"planned per rank: ([0-9.]+) MiB", line).group(1))
    assert abs(mib - estimate(cfg, cell.shape).state_bytes / 2**20) <= 0.05
    assert "activations" in line and "equivalence reference on rank 0" in line


def test_the_resource_check_counts_activations_and_the_equivalence_reference(compose, monkeypatch):
    """Before launch the check counts what the ranks will hold beside their model state: each rank's traced
    activations at its micro-batch and precision, and the unsharded reference rank 0 trains for the equivalence
    check (zeroexp.formulas.reference); it refuses, naming world_size, a cell whose total exceeds the available
    memory less the one headroom (zeroexp.plan.core.usable_bytes), and lets it through with resources.headroom=0
    where the total fits the whole; a headroom outside [0, 1) is refused naming resources.headroom."""
    from zeroexp.config import resources
    from zeroexp.errors import ConfigError
    from zeroexp.formulas.peak.checkpointing import NONE
    from zeroexp.formulas.reference import reference_host_bytes
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.row_peak import activation_bytes

    cfg = compose("model=lora_gpt", "strategy=zero2", "world_size=3", "precision=bf16", base=("logger=none",))
    cell = validate(cfg)
    e = resources.estimate(cfg, cell.shape)
    wrap = [import_class(p) for p in wrap_paths(cfg)]
    ref_acts = activation_bytes(cfg.model, int(cfg.batch_size), wrap, "float32", NONE)
    shape = cell.shape
    trainable = sum(shape.numels[i] for i in range(len(shape.params)) if shape.train(i))
    assert trainable < shape.numel  # LoRA: the reference's moments and gradients are the adapters' alone
    assert e.activation_bytes == activation_bytes(cfg.model, int(cfg.batch_size), wrap, "bfloat16", NONE) > 0
    assert e.activation_bytes < ref_acts  # bf16's forward saves less than the fp32 reference's
    assert e.reference_bytes == reference_host_bytes(shape.numel, trainable, ref_acts, 3) > 3 * ref_acts
    assert e.total_bytes == 3 * (e.state_bytes + e.activation_bytes + resources.RANK_OVERHEAD_BYTES) \
        + e.reference_bytes + resources.SHARED_BYTES
    state_alone = resources.estimate(cfg, cell.shape, activations=False).total_bytes
    assert state_alone == e.total_bytes - 3 * e.activation_bytes - e.reference_bytes
    # usable (less 10 %) between the state alone and the whole: refused for the activations and the reference
    monkeypatch.setattr(resources, "mem_available", lambda: int((state_alone + e.total_bytes) / 2 / 0.9))
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert refused.value.key == "world_size" and "equivalence reference" in str(refused.value)
    monkeypatch.setattr(resources, "mem_available", lambda: e.total_bytes)  # fits the whole, not less 10 %
    with pytest.raises(ConfigError):
        validate(cfg)
    validate(compose("model=lora_gpt", "strategy=zero2", "world_size=3", "precision=bf16", "resources.headroom=0",
                     base=("logger=none",)))
    with pytest.raises(ConfigError) as bad:
        validate(compose("model=lora_gpt", "resources.headroom=1", base=("logger=none",)))
    assert bad.value.key == "resources.headroom"
