"""Strategy-owned configuration: each strategy's schema beside its adapter, no top-level key of one
strategy, cell ids unchanged, and a ``strategy.<key>`` of a sweep applying only to the strategies that have it."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from conftest import compose_config, run_cli
from zeroexp.cell.identity import cell_id, cell_identity, cell_name
from zeroexp.cli.run import CONF_DIR, register
from zeroexp.config.schemas import ConfigError, strategy_extras, validate, without_strategy_extras
from zeroexp.strategies import registered

ROOT = Path(__file__).resolve().parent.parent
BASE = ("logger=none", "model.width=64", "steps=10", "warmup_steps=3")  # conftest's BASE

#: Pinned cell names (and so cell ids), as commit 124fb84 computed them when the bucket cap and the DeepSpeed stage
#: were top-level keys: moving a key into a strategy's schema must not change them, since resume=true and reports over
#: existing sweeps depend on them. "BASE" stands for conftest's BASE overrides.
PINNED = [
    ("strategy=ddp", "ddp_mlp_fp32_n4_1535041b"),
    ("BASE strategy=ddp world_size=2", "ddp_mlp_fp32_n2_1146f049"),
    ("strategy=ddp precision=bf16", "ddp_mlp_bf16_n4_23ab5470"),
    ("strategy=ddp prefetch=post", "ddp_mlp_fp32_n4_1535041b"),
    ("strategy=ddp dry_run=true world_size=64", "ddp_mlp_fp32_n64_dry_dd65580a"),
    ("strategy=zro", "zro_mlp_fp32_n4_41d78d0f"),
    ("BASE strategy=zro world_size=2", "zro_mlp_fp32_n2_c10e266d"),
    ("strategy=zro precision=bf16", "zro_mlp_bf16_n4_53ffd8fe"),
    ("strategy=zero1", "zero1_mlp_fp32_n4_d804f2af"),
    ("BASE strategy=zero1 world_size=2", "zero1_mlp_fp32_n2_2e00d8b9"),
    ("strategy=zero1 precision=bf16", "zero1_mlp_bf16_n4_4942bfab"),
    ("strategy=zero2", "zero2_mlp_fp32_n4_17d44813"),
    ("BASE strategy=zero2 world_size=2", "zero2_mlp_fp32_n2_22b5107a"),
    ("strategy=zero2 precision=bf16", "zero2_mlp_bf16_n4_5b313c4b"),
    ("strategy=deepspeed", "deepspeed-stage2_mlp_fp32_n4_31cf07c8"),
    ("BASE strategy=deepspeed world_size=2", "deepspeed-stage2_mlp_fp32_n2_63794c5d"),
    ("strategy=deepspeed precision=bf16", "deepspeed-stage2_mlp_bf16_n4_6b5bbafe"),
    ("strategy=deepspeed prefetch=post", "deepspeed-stage2_mlp_fp32_n4_31cf07c8"),
    ("strategy=deepspeed checkpoint=full", "deepspeed-stage2_mlp_fp32_ckpt-full_n4_2e6de638"),
    ("strategy=fsdp_grad_op", "fsdp_grad_op_mlp_fp32_n4_956c8e49"),
    ("BASE strategy=fsdp_grad_op world_size=2", "fsdp_grad_op_mlp_fp32_n2_2c083a49"),
    ("strategy=fsdp_grad_op precision=bf16", "fsdp_grad_op_mlp_bf16_n4_a887d416"),
    ("strategy=fsdp_full", "fsdp_full-pre_mlp_fp32_n4_bd08a63e"),
    ("BASE strategy=fsdp_full world_size=2", "fsdp_full-pre_mlp_fp32_n2_69f5a251"),
    ("strategy=fsdp_full precision=bf16", "fsdp_full-pre_mlp_bf16_n4_6417cd50"),
    ("strategy=fsdp_full prefetch=post", "fsdp_full-post_mlp_fp32_n4_8a06ae4c"),
    ("strategy=fsdp_full checkpoint=full", "fsdp_full-pre_mlp_fp32_ckpt-full_n4_f2adebf0"),
    ("strategy=fsdp2_grad_op", "fsdp2_grad_op_mlp_fp32_n4_0b356910"),
    ("BASE strategy=fsdp2_grad_op world_size=2", "fsdp2_grad_op_mlp_fp32_n2_f1599a26"),
    ("strategy=fsdp2_grad_op precision=bf16", "fsdp2_grad_op_mlp_bf16_n4_61a2cbf8"),
    ("strategy=fsdp2_full", "fsdp2_full_mlp_fp32_n4_e020ec50"),
    ("BASE strategy=fsdp2_full world_size=2", "fsdp2_full_mlp_fp32_n2_a5e8a815"),
    ("strategy=fsdp2_full precision=bf16", "fsdp2_full_mlp_bf16_n4_0c925bfc"),
    ("strategy=fsdp2_full dry_run=true world_size=64", "fsdp2_full_mlp_fp32_n64_dry_927a8265"),
    ("BASE strategy=ddp world_size=2 strategy.bucket_cap_mb=0.0625", "ddp_mlp_fp32_n2_47e45f7b"),
    ("BASE strategy=ddp world_size=2 strategy.bucket_cap_mb=0.03", "ddp_mlp_fp32_n2_13a98daa"),
    ("strategy=ddp strategy.bucket_cap_mb=64", "ddp_mlp_fp32_n4_f5f0d684"),
    ("BASE strategy=zro world_size=2 strategy.bucket_cap_mb=0.0625", "zro_mlp_fp32_n2_92097906"),
    ("BASE strategy=zro world_size=2 strategy.bucket_cap_mb=0.03", "zro_mlp_fp32_n2_d7d36266"),
    ("strategy=zro strategy.bucket_cap_mb=64", "zro_mlp_fp32_n4_dbf9f6a4"),
    ("BASE strategy=zero1 world_size=2 strategy.bucket_cap_mb=0.0625", "zero1_mlp_fp32_n2_2caef905"),
    ("BASE strategy=zero1 world_size=2 strategy.bucket_cap_mb=0.03", "zero1_mlp_fp32_n2_dfa7ea98"),
    ("strategy=zero1 strategy.bucket_cap_mb=64", "zero1_mlp_fp32_n4_f1c07cc7"),
    ("BASE strategy=zero2 world_size=2 strategy.bucket_cap_mb=0.0625", "zero2_mlp_fp32_n2_588a3875"),
    ("BASE strategy=zero2 world_size=2 strategy.bucket_cap_mb=0.03", "zero2_mlp_fp32_n2_25ad6866"),
    ("strategy=zero2 strategy.bucket_cap_mb=64", "zero2_mlp_fp32_n4_4bd9e428"),
    ("BASE strategy=deepspeed world_size=2 strategy.bucket_cap_mb=0.0625", "deepspeed-stage2_mlp_fp32_n2_97a2e5ec"),
    ("BASE strategy=deepspeed world_size=2 strategy.bucket_cap_mb=0.03", "deepspeed-stage2_mlp_fp32_n2_2a9ea540"),
    ("strategy=deepspeed strategy.bucket_cap_mb=64", "deepspeed-stage2_mlp_fp32_n4_815b565b"),
    ("strategy=deepspeed strategy.stage=0", "deepspeed-stage0_mlp_fp32_n4_594543e8"),
    ("strategy=deepspeed strategy.stage=0 offload=full precision=bf16",
     "deepspeed-stage0_mlp_bf16_off-full_n4_3a8e8fcd"),
    ("BASE world_size=2 strategy=deepspeed strategy.stage=0 model.depth=5 strategy.bucket_cap_mb=0.03",
     "deepspeed-stage0_mlp_fp32_n2_5c46b56c"),
    ("strategy=deepspeed strategy.stage=1", "deepspeed-stage1_mlp_fp32_n4_92539f94"),
    ("strategy=deepspeed strategy.stage=1 offload=full precision=bf16",
     "deepspeed-stage1_mlp_bf16_off-full_n4_b24dca51"),
    ("BASE world_size=2 strategy=deepspeed strategy.stage=1 model.depth=5 strategy.bucket_cap_mb=0.03",
     "deepspeed-stage1_mlp_fp32_n2_e2a71348"),
    ("strategy=deepspeed strategy.stage=2", "deepspeed-stage2_mlp_fp32_n4_31cf07c8"),
    ("strategy=deepspeed strategy.stage=2 offload=full precision=bf16",
     "deepspeed-stage2_mlp_bf16_off-full_n4_0aa30611"),
    ("BASE world_size=2 strategy=deepspeed strategy.stage=2 model.depth=5 strategy.bucket_cap_mb=0.03",
     "deepspeed-stage2_mlp_fp32_n2_71f3bb14"),
    ("strategy=deepspeed strategy.stage=3", "deepspeed-stage3_mlp_fp32_n4_a86d197b"),
    ("strategy=deepspeed strategy.stage=3 offload=full precision=bf16",
     "deepspeed-stage3_mlp_bf16_off-full_n4_ffc09d16"),
    ("BASE world_size=2 strategy=deepspeed strategy.stage=3 model.depth=5 strategy.bucket_cap_mb=0.03",
     "deepspeed-stage3_mlp_fp32_n2_7e10375a"),
    ("strategy=zero1 strategy.reduce=allreduce", "zero1_mlp_fp32_n4_d8df90b4"),
    ("strategy=zero1 strategy.clip_grad_norm=1.0 precision=bf16", "zero1_mlp_bf16_n4_9d6850c7"),
    ("strategy=zero2 strategy.reduce=allreduce", "zero2_mlp_fp32_n4_58646974"),
    ("strategy=zero2 strategy.clip_grad_norm=1.0 precision=bf16", "zero2_mlp_bf16_n4_f9fd1e1c"),
    ("strategy=fsdp_full strategy.wrap=[]", "fsdp_full-pre_mlp_fp32_n4_412bccc3"),
    ("strategy=fsdp_grad_op strategy.wrap=[]", "fsdp_grad_op_mlp_fp32_n4_08939ae1"),
    ("strategy=fsdp2_full strategy.wrap=[]", "fsdp2_full_mlp_fp32_n4_237a2937"),
    ("strategy=fsdp_full prefetch=none offload=full", "fsdp_full-none_mlp_fp32_off-full_n4_4cc606b0"),
    ("experiment=zero_ladder strategy=ddp prefetch=pre", "ddp_seed_ch31_fp32_n4_438e6c77"),
    ("experiment=zero_ladder strategy=ddp prefetch=post", "ddp_seed_ch31_fp32_n4_438e6c77"),
    ("experiment=zero_ladder strategy=ddp prefetch=none", "ddp_seed_ch31_fp32_n4_438e6c77"),
    ("experiment=zero_ladder strategy=zro prefetch=pre", "zro_seed_ch31_fp32_n4_34f231b6"),
    ("experiment=zero_ladder strategy=zro prefetch=post", "zro_seed_ch31_fp32_n4_34f231b6"),
    ("experiment=zero_ladder strategy=zro prefetch=none", "zro_seed_ch31_fp32_n4_34f231b6"),
    ("experiment=zero_ladder strategy=fsdp_grad_op prefetch=pre", "fsdp_grad_op_seed_ch31_fp32_n4_b772bb49"),
    ("experiment=zero_ladder strategy=fsdp_grad_op prefetch=post", "fsdp_grad_op_seed_ch31_fp32_n4_b772bb49"),
    ("experiment=zero_ladder strategy=fsdp_grad_op prefetch=none", "fsdp_grad_op_seed_ch31_fp32_n4_b772bb49"),
    ("experiment=zero_ladder strategy=fsdp_full prefetch=pre", "fsdp_full-pre_seed_ch31_fp32_n4_97a0cd73"),
    ("experiment=zero_ladder strategy=fsdp_full prefetch=post", "fsdp_full-post_seed_ch31_fp32_n4_c5e2fa0c"),
    ("experiment=zero_ladder strategy=fsdp_full prefetch=none", "fsdp_full-none_seed_ch31_fp32_n4_107553c1"),
    ("experiment=zero_ladder strategy=zero1 prefetch=pre", "zero1_seed_ch31_fp32_n4_a2201e69"),
    ("experiment=zero_ladder strategy=zero2 prefetch=pre", "zero2_seed_ch31_fp32_n4_68500c6a"),
    ("experiment=zero_ladder strategy=deepspeed prefetch=pre", "deepspeed-stage2_seed_ch31_fp32_n4_d799c99e"),
    ("experiment=zero_ladder", "ddp_seed_ch31_fp32_n4_438e6c77"),
    ("experiment=ds_vs_fsdp strategy=deepspeed strategy.stage=2", "deepspeed-stage2_mlp_fp32_n4_913a04bc"),
    ("experiment=ds_vs_fsdp strategy=deepspeed strategy.stage=3", "deepspeed-stage3_mlp_fp32_n4_094fe40c"),
    ("experiment=ds_vs_fsdp strategy=fsdp_grad_op", "fsdp_grad_op_mlp_fp32_n4_8107349c"),
    ("experiment=ds_vs_fsdp strategy=fsdp_grad_op", "fsdp_grad_op_mlp_fp32_n4_8107349c"),
    ("experiment=ds_vs_fsdp strategy=fsdp_full", "fsdp_full-pre_mlp_fp32_n4_7ed0659d"),
    ("experiment=ds_vs_fsdp strategy=fsdp_full", "fsdp_full-pre_mlp_fp32_n4_7ed0659d"),
    ("experiment=ds_vs_fsdp", "ddp_mlp_fp32_n4_4addd763"),
    ("experiment=dry_run_7b strategy=fsdp_full world_size=64", "fsdp_full-pre_linear_7b5_fp32_n64_dry_e4c4791b"),
    ("experiment=dry_run_7b strategy=fsdp_full world_size=256", "fsdp_full-pre_linear_7b5_fp32_n256_dry_56a7785a"),
    ("experiment=dry_run_7b strategy=fsdp_full world_size=1024", "fsdp_full-pre_linear_7b5_fp32_n1024_dry_656f14b6"),
    ("experiment=dry_run_7b strategy=fsdp2_full world_size=64", "fsdp2_full_linear_7b5_fp32_n64_dry_b75c3695"),
    ("experiment=dry_run_7b strategy=fsdp2_full world_size=256", "fsdp2_full_linear_7b5_fp32_n256_dry_80337642"),
    ("experiment=dry_run_7b strategy=fsdp2_full world_size=1024", "fsdp2_full_linear_7b5_fp32_n1024_dry_81f4c9ef"),
    ("experiment=dry_run_7b strategy=fsdp_grad_op world_size=64", "fsdp_grad_op_linear_7b5_fp32_n64_dry_ce68cc3a"),
    ("experiment=dry_run_7b strategy=fsdp_grad_op world_size=256", "fsdp_grad_op_linear_7b5_fp32_n256_dry_ada42648"),
    ("experiment=dry_run_7b strategy=fsdp_grad_op world_size=1024",
     "fsdp_grad_op_linear_7b5_fp32_n1024_dry_79375961"),
]


def _compose(overrides: list[str]):
    return compose_config(overrides)  # Hydra's compose, each defaults list merged once (conftest)


# Overrides of every kind the suite composes: group choices, presets, values of a group's keys, adds, deletes,
# dicts, lists, a sweep, hydra's own keys; and bad ones of each (refused with Hydra's own error).
COMPOSER_GRID = [
    [], list(BASE), [*BASE, "strategy=zro", "world_size=2"], ["experiment=zero_ladder", "strategy=zero1"],
    ["strategy=zero1", "experiment=zero_ladder", "strategy.bucket_cap_mb=3"], ["+extra=1", "strategy=deepspeed",
    "strategy.stage=3"], ["model=gpt", "model.n_layer=2", "precision=bf16"], ["strategy=fsdp_full", "prefetch=post",
    "offload=optimizer", "activation_checkpointing=full", "init=meta", "checkpoint=sharded", "grad_accum=2"],
    ["model={width: 3}"], ["model.input_shape=[4,4]"], ["+experiment=zero_ladder"], ["~experiment"],
    ["strategy=zro", "strategy=fsdp2_full", "world_size=3", "world_size=5"],
    ["model.widht=3"], ["strategy=nope"], ["~model.depth"], ["strategy.stage=x"], ["steps=ten"],
    ["world_size=2,4"], ["hydra.run.dir=/tmp/x"], ["hydra/launcher=basic"],
]


def test_the_suites_compose_is_hydras():
    """conftest's ``compose_config`` merges each defaults list once and applies the other overrides with Hydra's own
    function: the same config, or the same error, as Hydra's ``compose`` for overrides of every kind."""
    def outcome(fn, overrides):
        try:
            cfg = fn(overrides)
            return OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg)
        except Exception as e:  # noqa: BLE001 - the error is the outcome compared
            return type(e).__name__, str(e)

    def hydras(overrides):
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides)

    register()
    for overrides in COMPOSER_GRID:
        assert outcome(compose_config, overrides) == outcome(hydras, overrides), overrides
    merged = compose_config([*BASE, "strategy=zro", "world_size=2"])
    merged.world_size = 7  # a copy each time: a test that changes its config changes nobody else's
    assert compose_config([*BASE, "strategy=zro", "world_size=2"]).world_size == 2


def _overrides(spec: str) -> list[str]:
    words = spec.split()
    return [*BASE, *words[1:]] if words[0] == "BASE" else words


@pytest.mark.parametrize("spec, name", PINNED, ids=[s for s, _ in PINNED])
def test_cell_names_and_ids_stay_pinned(spec, name):
    assert cell_name(_compose(_overrides(spec))) == name


@pytest.mark.parametrize("strategy, extra", [
    ("fsdp_full", "strategy.stage=3"), ("fsdp_grad_op", "strategy.bucket_cap_mb=64"),
    ("ddp", "strategy.reduce=allreduce"),
    ("fsdp2_full", "strategy.sharding=FULL_SHARD"), ("zero1", "strategy.parameters_as_bucket_view=true"),
])
def test_a_key_the_strategy_lacks_makes_no_new_cell(strategy, extra):
    plain, with_extra = _compose([f"strategy={strategy}"]), _compose([f"strategy={strategy}", extra])
    key = extra.split("=")[0].split(".")[1]
    assert strategy_extras(with_extra) == (key,) and strategy_extras(plain) == ()
    assert cell_name(with_extra) == cell_name(plain)
    stripped = without_strategy_extras(with_extra)
    assert key not in stripped.strategy and key in with_extra.strategy  # a copy; the cell runs without it
    assert OmegaConf.to_container(stripped.strategy) == OmegaConf.to_container(plain.strategy)


def test_layout_is_set_for_every_strategy_and_is_not_identity():
    expected = {"ddp": "ddp", "zro": "zro", "zero1": "zero1", "zero2": "zero2", "fsdp_grad_op": "fsdp_grad_op",
                "fsdp_full": "fsdp_full", "fsdp2_grad_op": "fsdp2_grad_op", "fsdp2_full": "fsdp2_full",
                "deepspeed": "deepspeed_stage2", "fsdp_hybrid": "fsdp_HYBRID_SHARD", "fsdp2_hybrid": "fsdp2_hybrid"}
    assert set(expected) == set(registered())
    for name, layout in expected.items():
        cfg = _compose([f"strategy={name}"])
        assert cfg.strategy.layout == layout
        assert "layout" not in cell_identity(cfg)["strategy"]
        assert cell_id(_compose([f"strategy={name}", "strategy.layout=other"])) == cell_id(cfg)
    assert _compose(["strategy=deepspeed", "strategy.stage=3"]).strategy.layout == "deepspeed_stage3"
    zero2 = _compose(["strategy=fsdp_hybrid", "strategy.sharding=_HYBRID_SHARD_ZERO2"])
    assert zero2.strategy.layout == "fsdp__HYBRID_SHARD_ZERO2"


def test_every_strategy_has_its_schema_in_the_torch_free_table():
    import sys

    from zeroexp.cell.strategy import SCHEMAS, StrategyConfig, schema_keys

    assert set(SCHEMAS) == set(registered()) == {p.stem for p in (Path(CONF_DIR) / "strategy").glob("*.yaml")}
    for name, adapter in registered().items():
        assert adapter.schema is SCHEMAS[name], name
        assert adapter.schema is not StrategyConfig and issubclass(adapter.schema, StrategyConfig), name
        assert {"name", "layout"} <= set(schema_keys(adapter.schema))
        # every key of the strategy's YAML is one of its schema's
        assert set(_compose([f"strategy={name}"]).strategy) == set(schema_keys(adapter.schema)), name
    bucketed = {n for n, a in registered().items() if "bucket_cap_mb" in schema_keys(a.schema)}
    assert bucketed == {"ddp", "zro", "zero1", "zero2", "deepspeed"}
    for name in bucketed:
        assert _compose([f"strategy={name}"]).strategy.bucket_cap_mb == 25.0
        assert _compose([f"strategy={name}", "experiment=zero_ladder"]).strategy.bucket_cap_mb == 64.0
    # composing and naming a cell needs no adapter: neither torch nor Lightning is imported
    probe = ("import sys; from zeroexp.cli.run import register, CONF_DIR;"
             "from hydra import compose, initialize_config_dir;"
             "from zeroexp.cell.identity import cell_name; register();"
             "initialize_config_dir(config_dir=CONF_DIR, version_base='1.3').__enter__();"
             "[cell_name(compose('config', [f'strategy={s}', 'strategy.shard_size=2'])) for s in "
             f"{sorted(SCHEMAS)!r}];"
             "print(sorted(m for m in ('torch', 'lightning', 'pandas', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_top_level_key_of_one_strategy():
    old_cap, old_stage = "ddp_" + "bucket_cap_mb", "ds_" + "stage"  # the keys before the move
    cfg = _compose([])
    assert old_cap not in cfg and old_stage not in cfg
    with pytest.raises(Exception, match=old_cap):
        _compose([f"{old_cap}=64"])


def test_single_run_refuses_a_key_its_strategy_lacks_only_when_asked_for():
    cfg = _compose(["strategy=ddp", "strategy.reduce=allreduce"])
    validate(cfg)  # set in a sweep for other strategies: it does not apply here
    with pytest.raises(ConfigError) as e:
        validate(cfg, explicit_overrides=("strategy", "strategy.reduce"))
    assert e.value.key == "strategy.reduce" and "strategy=ddp has no key 'reduce'" in str(e.value)
    assert "zero1, zero2" in str(e.value) and "bucket_cap_mb" in str(e.value)
    with pytest.raises(ConfigError, match="strategy.reduse"):  # a key no strategy has: a typo, wherever it came from
        validate(_compose(["strategy=zero1", "strategy.reduse=allreduce"]))


def _sweep(overrides: list[str]):
    """The jobs and their composed configs of ``--multirun <overrides>`` (zeroexp.cli.sweep.sweep_jobs)."""
    from zeroexp.cli.sweep import sweep_jobs

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        main = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
        jobs = sweep_jobs(main)
    return jobs, [compose_config(job) for job in jobs]


class _Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str) -> None:
        self.lines.append(text)


def test_presets_set_strategy_keys_where_they_exist():
    from zeroexp.cli.sweep import check_strategy_keys

    jobs, cfgs = _sweep(["experiment=ds_vs_fsdp"])
    assert len(jobs) == 6 and len({cell_name(c) for c in cfgs}) == 4  # stage 2, 3 of deepspeed; each FSDP once
    assert sorted(int(c.strategy.stage) for c in cfgs if c.strategy.name == "deepspeed") == [2, 3]
    console = _Console()
    check_strategy_keys(jobs, cfgs, console)
    assert len(console.lines) == 1 and "strategy.stage" in console.lines[0] and "fsdp_full-pre" in console.lines[0]
    jobs, cfgs = _sweep(["experiment=zero_ladder"])
    assert len({cell_name(c) for c in cfgs}) == 6
    for c in cfgs:
        assert c.strategy.bucket_cap_mb == 64  # the cap of ddp and zro; no key (not applied) for fsdp_*
        assert ("bucket_cap_mb" in strategy_extras(c)) == c.strategy.name.startswith("fsdp")


def _zeroexp(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m zeroexp <args>`` in this process (conftest.run_cli), without this environment's W&B settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    return run_cli(*args, cwd=cwd, env=env)


@pytest.mark.parametrize("args, key", [
    (("--multirun", "strategy=zero1,zero2", "strategy.reduse=x"), "strategy.reduse"),  # a typo
    (("--multirun", "strategy=zero1,zero2", "strategy.stage=2,3"), "strategy.stage"),  # no swept strategy has it
    (("strategy=ddp", "strategy.reduce=allreduce"), "strategy.reduce"),  # a single run
])
def test_cli_refuses_a_key_no_strategy_of_the_run_has(tmp_path, args, key):
    proc = _zeroexp(*args, "logger=none", "world_size=2", f"hydra.run.dir={tmp_path}/cell",
                    f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert key in out
    assert not (tmp_path / "cell").exists() and not list(tmp_path.glob("sweep/*/manifest.json"))


def test_strategies_and_models_import_no_config():
    """Strategies raise zeroexp.errors (a leaf); models own MODEL_RESERVED_KEYS (no config <-> models circle)."""
    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    pkg = ROOT / "zeroexp"
    for path in [*(pkg / "strategies").glob("*.py"), *(pkg / "models").glob("*.py")]:
        assert not {m for m in imported(path) if m == "zeroexp.config" or m.startswith("zeroexp.config.")}, path
    assert not {m for m in imported(pkg / "errors.py") if m.startswith("zeroexp")}
    from zeroexp import errors, models
    from zeroexp.config import schemas as config

    assert config.ConfigError is errors.ConfigError and config.NotApplicableHere is errors.NotApplicableHere
    assert config.MODEL_RESERVED_KEYS is models.MODEL_RESERVED_KEYS


def test_no_config_sets_hydra_mode():
    """zeroexp.cli.hydra_app skips Hydra's mode probe (a whole compose) on this ground: no YAML under conf/ sets
    ``hydra.mode``, so the probe would answer None and Hydra take the mode from ``--multirun``."""
    yamls = sorted(Path(CONF_DIR).rglob("*.yaml"))
    assert len(yamls) > 20
    for path in yamls:
        node = OmegaConf.load(path)
        hydra_node = node.get("hydra") if isinstance(node, dict) or OmegaConf.is_dict(node) else None
        assert not (hydra_node and "mode" in hydra_node), f"{path} sets hydra.mode"


def test_a_command_composes_its_config_once_unless_it_names_hydra_mode(monkeypatch, tmp_path):
    """One compose per command (Hydra's mode probe skipped); ``hydra.mode=MULTIRUN`` on the command line still
    makes a sweep (the probe runs for it), as ``--multirun`` does."""
    from hydra._internal.hydra import Hydra

    modes, original = [], Hydra.compose_config

    def spy(self, *args, **kwargs):
        modes.append(kwargs.get("run_mode"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", spy)
    bad = ("model.width=-3", "logger=none")
    for argv, composes, sweep in [(bad, 1, False), (("--multirun", *bad, f"hydra.sweep.dir={tmp_path / 'a'}"), 1, True),
                                  (("hydra.mode=MULTIRUN", *bad, f"hydra.sweep.dir={tmp_path / 'b'}"), 2, True)]:
        modes.clear()
        proc = run_cli(*argv)
        assert proc.returncode == 2 and "model.width=-3" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert len(modes) == composes, (argv, modes)
        assert ("sweep job #0" in proc.stdout + proc.stderr) == sweep, proc.stdout + proc.stderr


def test_a_sweep_composes_each_job_once(monkeypatch, tmp_path):
    """zeroexp's check of every job, Hydra's ``validate_batch_is_legal`` and Hydra's launch each composed every job
    of a ``--multirun`` (3 composes a job); now each job is composed once (zeroexp.cli.hydra_app), and each use gets its
    own copy: the cells launched get the config Hydra composes for their overrides (4 jobs, 2 distinct cells, 2
    skipped as repeats; the cells themselves are not run here). A ``glob(...)`` sweep passes the check too."""
    from types import SimpleNamespace

    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    import zeroexp.launch.runner

    calls, original = [], ConfigLoaderImpl.load_configuration

    def spy(self, config_name, overrides, run_mode, *args, **kwargs):
        calls.append(tuple(overrides))
        return original(self, config_name, overrides, run_mode, *args, **kwargs)

    launched = []

    def run_cell(cfg, cell_dir, **kwargs):
        launched.append(OmegaConf.to_yaml(cfg))
        return SimpleNamespace(status="ok", cell_dir=Path(cell_dir), summary=None, error=None)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", spy)
    monkeypatch.setattr(zeroexp.launch.runner, "run_cell", run_cell)
    values = ("logger=none", "model.width=16", "world_size=2")
    proc = _zeroexp("--multirun", "strategy=ddp,zro", "prefetch=pre,post", *values,
                    f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("already ran in this sweep") == 2, proc.stdout
    assert len(calls) == len(set(calls)) == 1 + 4, calls  # the sweep's own config, then each job once
    assert launched == [OmegaConf.to_yaml(compose_config([f"strategy={s}", "prefetch=pre", *values]))
                        for s in ("ddp", "zro")]

    launched.clear()  # a glob() sweep: the check lists the group's options with Hydra's loader, as the sweeper does
    proc = _zeroexp("--multirun", "strategy=glob(zero*)", *values, f"hydra.sweep.dir={tmp_path / 'glob'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert launched == [OmegaConf.to_yaml(compose_config([f"strategy={s}", *values])) for s in ("zero1", "zero2")]
    # the check ran (Hydra turns a callback's exception into a warning)
    assert "cell 1 of 2:" in proc.stdout, proc.stdout


@pytest.mark.parametrize("app, override, key, near", [
    ("plan", "+world_sizes=8", "world_sizes", "world_size"),
    ("recommend", "+world_sizes=8", "world_sizes", "world_size"),
    ("recommend", "+recommend.topk=3", "recommend.topk", "recommend.top_k"),
    ("recommend", "+allocator.expandable=true", "allocator.expandable", "allocator.expandable_segments"),
    ("calibrate", "+calibrate.max_byte=8", "calibrate.max_byte", "calibrate.max_bytes"),
    ("config", "+world_sizes=8", "world_sizes", "world_size"),
])
def test_every_app_refuses_a_key_nothing_reads_naming_its_nearest(app, override, key, near):
    """Hydra's own advice for a misspelt key is to append it (``+world_sizes=8``), which the planner then ignored:
    every app refuses it before any work, naming the key and its nearest keys."""
    from zeroexp.errors import ConfigError

    if app == "calibrate":
        from zeroexp.cli.calibrate import register, validate as check
        register()
    elif app == "plan":
        from zeroexp.cli.plan import register, run as check
        register()
    elif app == "recommend":
        from zeroexp.cli.recommend import register, run as check
        register()
    else:
        from zeroexp.config.schemas import validate as check
    cfg = compose_config([override, *(["model=gpt2_small"] if app != "calibrate" else [])], config_name=app)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert e.value.key == key and near in e.value.why
