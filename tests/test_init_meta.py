"""init=meta: the model built on the meta device, each rank materialising its part with the full
build's values (zeroexp/models/init.py, zeroexp/strategies/_meta_init.py), its init peak measured and modelled
(zeroexp/formulas/init.py)."""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from zeroexp.cell.policy import CellPolicy
from zeroexp.errors import ConfigError
from zeroexp.formulas import LAYOUTS
from zeroexp.formulas.init import init_peak_bytes
from zeroexp.models import LinearStack, build_model, import_class, wrap_paths
from zeroexp.models.gpt import GPT
from zeroexp.models.init import replay_init
from conftest import STEPS, WINDOWS

W, DEPTH, N = 64, 4, 2
MLP = ("model=mlp", f"model.width={W}", f"model.depth={DEPTH}")
GPT_ = ("model=gpt",)  # 4 blocks of 64, a tied 256-token head
BASE = ("logger=none", f"steps={STEPS}", *WINDOWS)
KIND = {"fsdp_full": "fsdp1", "fsdp2_full": "fsdp2", "ddp": "replica"}  # each a family's init model


def _replayed(factory, seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        meta = factory()
    out: dict[str, torch.Tensor] = {}
    replay_init(meta, seed, lambda name, value: out.__setitem__(name, value.clone()))
    return out


@pytest.mark.parametrize("factory", [lambda: LinearStack(W, DEPTH), lambda: GPT(256, 32, 4, 4, 64),
                                     lambda: GPT(100, 16, 3, 2, 32, bias=False, tie_weights=False)],
                         ids=["mlp", "gpt", "gpt-untied-nobias"])
def test_replay_gives_the_full_build_values_bit_for_bit(factory):
    torch.manual_seed(7)
    full = dict(factory().named_parameters())
    before = torch.get_rng_state()
    replayed = _replayed(factory, 7)
    assert torch.equal(torch.get_rng_state(), before)  # the global RNG is left as it was
    assert sorted(replayed) == sorted(full)  # every parameter, a tied one once
    for name, p in full.items():
        assert torch.equal(replayed[name], p.detach()), name
    other = _replayed(factory, 8)
    assert not all(torch.equal(other[n], full[n].detach()) for n in full)  # the seed matters


def test_bad_init_is_refused_before_any_rank(compose):
    from zeroexp.config.schemas import validate

    for overrides, why in ((("strategy=deepspeed", "strategy.stage=3"), "does not materialise"),
                           (("strategy=fsdp_full", "model=transformer_layer"), "replayable_init"),
                           (("strategy=fsdp_full", "dry_run=true"), "dry run")):
        cfg = compose(*overrides, "world_size=2", "init=meta", base=BASE)
        with pytest.raises(ConfigError) as e:
            validate(cfg)
        assert e.value.key == "init" and why in str(e.value), str(e.value)
    with pytest.raises(Exception, match="init"):
        compose("init=lazy")  # not an option of conf/init/


def test_cell_identity_gains_init_only_when_meta(compose):
    from zeroexp.cell.identity import cell_identity, cell_name

    full, meta = (compose("strategy=fsdp_full", "world_size=2"),
                  compose("strategy=fsdp_full", "world_size=2", "init=meta"))
    assert "init" not in cell_identity(full) and "init-" not in cell_name(full)  # ids of every earlier cell kept
    assert cell_identity(meta)["init"] == "meta" and "_init-meta_" in cell_name(meta)


def _shape(cfg):
    from zeroexp.plan.shape import shape_of

    with torch.device("meta"):
        net = build_model(cfg.model)
    return shape_of(net, [import_class(p) for p in wrap_paths(cfg)])


def test_planner_init_peak_and_fits_with_init_meta():
    from hydra import compose as hydra_compose, initialize_config_dir

    from zeroexp.cli.run import CONF_DIR
    from zeroexp.cli.plan import register, run

    register()
    base = [*MLP, f"world_size={N}", "strategies=[ddp,fsdp_full,fsdp2_full,deepspeed_stage3]"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full, meta, counted = (hydra_compose(config_name="plan", overrides=o) for o in (
            [*base, "device_memory=100000"], [*base, "device_memory=100000", "init=meta"],
            ["params=1e6", "init=meta", "strategies=[fsdp_full]"]))
    p = 4 * W * W * DEPTH  # 65536 B of fp32 weights; one Linear (a unit and an init step) is 16384 B
    f = {r["strategy"]: r for r in run(full)[0]}
    m = {r["strategy"]: r for r in run(meta)[0]}
    # init=full: the whole model; FSDP1 also flattens its first unit (16384) and clones the shard (8192) beside it.
    assert f["ddp"]["init_peak_bytes"] == p and f["fsdp_full"]["init_peak_bytes"] == p + 16384 + 8192
    assert f["fsdp2_full"]["init_peak_bytes"] == 4 * N + p + 8192  # FSDP2's device mesh holds 4 N bytes
    assert f["deepspeed_stage3"]["init_peak_bytes"] == p
    # init=meta: FSDP1's last unit: 3 shards + the unit materialised + its FlatParameter + its shard = 65536;
    # FSDP2: 4 shards + one Linear replayed; a replica: the model + one Linear replayed.
    assert m["fsdp_full"]["init_peak_bytes"] == 3 * 8192 + 16384 + 16384 + 8192
    assert m["fsdp2_full"]["init_peak_bytes"] == 4 * N + 4 * 8192 + 16384 and m["ddp"]["init_peak_bytes"] == p + 16384
    assert m["deepspeed_stage3"]["init_peak_bytes"] is None and "not modelled" in m["deepspeed_stage3"]["init_note"]
    for name in ("ddp", "fsdp_full", "fsdp2_full"):  # init=meta: fits also needs the init peak to fit
        assert f[name]["fits"] is not None
        assert m[name]["fits"] == (f[name]["fits"] and m[name]["init_peak_bytes"] <= 100000), name
    (row,), _ = run(counted)
    assert row["init_peak_bytes"] is None and "give model=" in row["init_note"]


def _init_rank(rank: int, port: int, cases: list, out: str, n: int) -> None:
    """One rank: each case built and wrapped with init=full, then init=meta, under MemTracker; the full parameters
    after wrapping (gathered) and each build-and-wrap's peak."""
    from torch.distributed._tools import MemTracker

    from zeroexp._lib.memtrack import totals
    from zeroexp.models.module import CellModule
    from zeroexp.strategies import get_adapter_class

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.set_num_threads(1)
    rows = []
    for case in cases:
        cfg = OmegaConf.create(case)
        values, peaks = {}, {}
        for init in ("full", "meta"):
            adapter = get_adapter_class(cfg.strategy.name)(CellPolicy.of(cfg))
            mt = MemTracker()
            mt.__enter__()
            torch.manual_seed(int(cfg.seed))  # as the worker's seed_everything
            with torch.device("meta") if init == "meta" else nullcontext():
                net = build_model(cfg.model)
            model = adapter.wrap_cell(CellModule(net, cfg.model.loss, adapter.make_optimizer, adapter.clip_gradients),
                                      torch.device("cpu"))
            peaks[init] = totals(mt.get_tracker_snapshot("peak"), "cpu")[0]
            mt.__exit__(None, None, None)
            with adapter.full_parameters(model) as full:
                values[init] = {k: v.clone() for k, v in full.items()}
            del model, net
        equal = sorted(values["full"]) == sorted(values["meta"]) and all(
            torch.equal(values["full"][k], values["meta"][k]) for k in values["full"])
        rows.append({"equal": equal, "params": len(values["full"]), "peaks": peaks})
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("n", [N, 3])  # 3: a 64-wide Linear (4096 elements) does not divide: FSDP's padding
def test_meta_init_equals_full_and_its_peak_is_the_models(compose, tmp_path, n):
    from zeroexp.launch.local import free_port

    cases, cfgs = [], []
    for strategy in KIND:
        for model in (MLP, GPT_):
            cfg = compose(f"strategy={strategy}", f"world_size={n}", *model, base=BASE)
            cfgs.append(cfg)
            d = OmegaConf.to_container(cfg, resolve=True)
            d.pop("hydra", None)
            cases.append(d)
    # fork, as zeroexp's forkserver does: a forked rank ends with os._exit, never in the interpreter's teardown
    mp.start_processes(_init_rank, args=(free_port(), cases, str(tmp_path), n), nprocs=n, start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for i, cfg in enumerate(cfgs):
        label = f"{cfg.strategy.name} {cfg.model.name} N={n}"
        kind, shape = KIND[cfg.strategy.name], _shape(cfg)
        predicted = {init: init_peak_bytes(shape, LAYOUTS[cfg.strategy.layout], init, n) for init in ("full", "meta")}
        rows = [r[i] for r in ranks]
        assert all(row["equal"] and row["params"] == len(list(build_model(cfg.model).parameters())) for row in rows)
        measured = {init: max(row["peaks"][init] for row in rows) for init in ("full", "meta")}  # the largest rank
        if kind == "replica":  # the whole model either way; DDP's broadcast of the states is not in the model
            assert measured["meta"] >= predicted["meta"] and measured["full"] >= predicted["full"], label
            continue
        # Below init=full's by what the model predicts, each to the byte (FSDP1 at N=3: the last rank, whose short
        # chunk is cloned, then padded).
        assert measured["full"] - measured["meta"] == predicted["full"] - predicted["meta"] > 0, label
        assert measured == predicted, label


@pytest.mark.parametrize("overrides", [("strategy=fsdp_full", *GPT_), ("strategy=fsdp2_full", *MLP)],
                         ids=["fsdp_full-gpt", "fsdp2_full-mlp"])
def test_meta_cells_pass_every_check(cell, compose, overrides):
    r = cell(*overrides, f"world_size={N}", "init=meta", base=BASE)
    assert r.status == "ok", r.error
    s = r.summary
    assert s["cell"]["init"] == "meta"
    for section in ("state", "collectives", "equivalence", "plan"):
        assert s[section]["check"] == "PASS", (section, s[section].get("reasons"))
    cfg = compose(*overrides, f"world_size={N}", "init=meta", base=BASE)
    predicted = init_peak_bytes(_shape(cfg), LAYOUTS[cfg.strategy.layout], "meta", N)
    mem = s["memory"]
    assert mem["init"] == "meta" and mem["init_peak_bytes_max"] == max(mem["init_peak_bytes"])
    assert mem["init_peak_bytes_max"] == predicted  # measured in the cell: the build, Lightning's setup, the wrap
