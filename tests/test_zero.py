"""zeroexp's own ZeRO-1 / ZeRO-2: DDP's numbers, the ZeRO table's bytes, one reduce_scatter and one
all_gather per bucket per step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

import conftest
from conftest import read_csv
from zeroexp.cell.policy import CellPolicy
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.formulas import bus_bytes, padded_numel, sharded_zero_rank_bytes
from zeroexp.launch.local import free_port
from zeroexp.models import LinearStack, make_batch
from zeroexp.strategies import get_adapter_class

# --- numerics: DDP and the sharded optimizer side by side in one process group, a grid per world size -------
CLIP = 1e-3  # far below the gradient norms of these models: every step is clipped (asserted below)
#: 7x7x3 = 147 elements in buckets of two layers (98) and one (49): padded at N = 2 (one bucket), 3 and 4.
ODD = {"width": 7, "depth": 3, "overrides": ("model.width=7", "model.depth=3", "strategy.bucket_cap_mb=0.0004")}
EVEN = {"width": 16, "depth": 4, "overrides": ("model.width=16", "model.depth=4")}
GRID = {  # case -> (strategy, model, extra overrides)
    "zero1": ("zero1", EVEN, ()),
    "zero2-odd": ("zero2", ODD, ()),
    "zero1-allreduce-odd": ("zero1", ODD, ("strategy.reduce=allreduce",)),
    "zero2-clip": ("zero2", EVEN, (f"strategy.clip_grad_norm={CLIP}",)),
    "zero1-clip-odd": ("zero1", ODD, (f"strategy.clip_grad_norm={CLIP}",)),
}
STEPS = 6


def _train(cfg, rank: int, sharded: bool) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Train ``cfg``'s mlp for STEPS steps as DDP (+ clip_grad_norm_) or through the zero adapter.

    Every rank: the per-step rank-local losses, the final parameters as forward sees them (and, for the
    sharded optimizer, the all-gathered fp32 master under ``master.``), DDP's pre-clip norms.
    """
    torch.manual_seed(0)
    net = LinearStack(int(cfg.model.width), int(cfg.model.depth))
    clip = cfg.strategy.clip_grad_norm
    if sharded:
        adapter = get_adapter_class(cfg.strategy.name)(CellPolicy.of(cfg))
        model = adapter.wrap(net, torch.device("cpu"))
        opt = adapter.make_optimizer(model.parameters())
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        x = make_batch({"input_shape": [int(cfg.model.width)]}, 4, 0, step, rank)

        def closure() -> torch.Tensor:  # Lightning's order: forward, zero_grad, backward
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            return loss

        if sharded:
            loss = opt.step(closure)
        else:
            loss = closure()
            if clip is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float(clip))))
            opt.step()
        losses.append(float(loss))
    if sharded:  # the last step's parameter all_gather is in flight until the next forward or this wait
        opt.wait_for_parameters()
    params = {n: p.detach().clone() for n, p in (net.named_parameters())}
    if sharded:
        with adapter.full_parameters(model) as full:
            params.update({f"master.{n}": t.clone() for n, t in full.items()})
    return losses, params, norms


def _grid_rank(rank: int, world_size: int, port: int, cases: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    result = {}
    for case, cfg_dict in cases.items():
        cfg = OmegaConf.create(cfg_dict)
        ddp_losses, ddp_params, norms = _train(cfg, rank, sharded=False)
        losses, params, _ = _train(cfg, rank, sharded=True)
        result[case] = {
            "loss_err": max(abs(a - b) for a, b in zip(losses, ddp_losses)),
            "param_err": max(float((params[n] - p).abs().max()) for n, p in ddp_params.items()),
            "master_err": max(float((params[f"master.{n}"] - p).abs().max()) for n, p in ddp_params.items()),
            "min_norm": min(norms) if norms else None,
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while a peer is still in a collective (SIGABRT in CI once)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_losses_and_parameters_equal_ddp(compose, tmp_path, world_size):
    cases = {}
    for case, (strategy, model, extra) in GRID.items():
        cfg = compose(f"strategy={strategy}", f"world_size={world_size}", *model["overrides"], *extra)
        cases[case] = OmegaConf.to_container(cfg, resolve=True)
        cases[case].pop("hydra", None)
    # fork: the ranks need no fresh interpreter (CPU, gloo), and a spawn re-imports torch per rank
    mp.start_processes(_grid_rank, args=(world_size, free_port(), cases, str(tmp_path)), nprocs=world_size,
                       start_method="fork")
    for rank in range(world_size):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, r in result.items():
            assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5 and r["master_err"] <= 1e-5, (case, rank, r)
            if "clip" in case:
                assert r["min_norm"] > 10 * CLIP, (case, r)  # clipping changed every step


# --- cells: state, collectives and equivalence probes --------------------------------------------------
N, WIDTH, DEPTH = 4, 64, 8  # conftest BASE: model.width=64, the mlp's default depth
P = WIDTH * WIDTH * DEPTH * 4  # 128 KiB of fp32 parameters
TWO_BUCKETS = "strategy.bucket_cap_mb=0.0625"  # 64 KiB: four 16 KiB layers per bucket, as in test_collectives
CELLS = {
    "zero1": ("strategy=zero1", f"world_size={N}", TWO_BUCKETS),
    "zero2": ("strategy=zero2", f"world_size={N}", TWO_BUCKETS),
    "zero1-allreduce-padded": ("strategy=zero1", "world_size=3", "model.width=10", "strategy.reduce=allreduce"),
    "zero2-clip": ("strategy=zero2", "world_size=2", "strategy.clip_grad_norm=5e-5"),  # below every norm
    "zero1-bf16": ("strategy=zero1", "world_size=2", "precision=bf16"),
    "zero2-bf16": ("strategy=zero2", "world_size=2", "precision=bf16"),
    "zero2-fp16": ("strategy=zero2", "world_size=2", "precision=fp16"),
}


def _ok(cell, name):
    r = cell(*CELLS[name])
    assert r.status == "ok", r.error
    return r


@pytest.mark.parametrize("name, grad", [("zero1", N), ("zero2", 1)])
def test_fp32_state_collectives_and_ddp_losses(cell, name, grad):
    r = _ok(cell, name)
    s = r.summary["state"]
    assert s["check"] == "PASS", s["reasons"]
    assert s["expected"] == {"param": N, "grad": grad, "optim": 2, "master": 1}
    assert {k: s["factors"][k] for k in s["expected"]} == s["expected"] and s["padding_bytes"] == 0
    frame = read_csv(r, "rank_state.csv")
    master = frame[frame.kind == "master"]
    assert list(master.logical_bytes) == [P // N] * N and set(master.dtype) == {"float32"}
    c = r.summary["collectives"]
    assert c["check"] == "PASS", c["reasons"]
    assert c["counts"] == {"reduce_scatter": 2, "all_gather": 2}  # one of each per bucket
    assert c["payload_bytes"] == {"reduce_scatter": P, "all_gather": P}
    ddp = cell("strategy=ddp", f"world_size={N}", TWO_BUCKETS).summary["collectives"]
    assert sum(c["bus_bytes"].values()) == sum(ddp["bus_bytes"].values()) == bus_bytes("all_reduce", P, N)
    eq = r.summary["equivalence"]
    assert eq["check"] == "PASS" and eq["max_abs_err"] <= 1e-5, eq
    ddp_run = cell("strategy=ddp", f"world_size={N}", TWO_BUCKETS)
    losses = read_csv(r, "iterations.csv").merge(read_csv(ddp_run, "iterations.csv"), on=["rank", "step"])
    assert len(losses) == N * conftest.STEPS  # every rank, every step
    assert (losses.loss_x - losses.loss_y).abs().max() <= 1e-5


def test_zero2_keeps_a_gradient_shard_between_steps(cell):
    zero1, zero2 = (read_csv(_ok(cell, n), "memory.csv") for n in ("zero1", "zero2"))
    # Lightning's zero_grad does not bring the full gradient back: at the boundary zero2 holds P/N of it.
    assert (zero1.steady_bytes - zero2.steady_bytes == P - P // N).all()


def test_allreduce_variant_and_padding(cell):
    r = _ok(cell, "zero1-allreduce-padded")
    numel, n = 10 * 10 * DEPTH, 3  # 800 elements, padded to 801 over 3 ranks
    padded = padded_numel(numel, n) * 4
    c = r.summary["collectives"]
    assert c["check"] == "PASS", c["reasons"]
    assert c["counts"] == {"all_reduce": 1, "all_gather": 1} and c["payload_bytes"] == {"all_reduce": padded,
                                                                                         "all_gather": padded}
    s = r.summary["state"]
    assert s["check"] == "PASS", s["reasons"]
    assert s["padding_bytes"] == n * (padded - numel * 4)  # every rank holds the whole padded bucket
    assert s["padding_bytes_by_kind"]["master"] == padded - numel * 4  # only the last shard is padded
    assert r.summary["equivalence"]["check"] == "PASS", r.summary["equivalence"]


def test_clipping_adds_one_scalar_all_reduce_and_matches_clipped_reference(cell):
    r = _ok(cell, "zero2-clip")
    c = r.summary["collectives"]
    assert c["check"] == "PASS", c["reasons"]
    assert c["counts"] == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1}
    assert c["payload_bytes"]["all_reduce"] == 4
    eq = r.summary["equivalence"]  # the reference clips with torch.nn.utils.clip_grad_norm_
    assert eq["check"] == "PASS" and eq["max_abs_err"] <= 1e-5, eq
    unclipped = cell("strategy=zero2", "world_size=2").summary["iterations"]["global_loss"]
    assert r.summary["iterations"]["global_loss"][-1] != unclipped[-1]  # clipping did change the training


@pytest.mark.parametrize("name, stage", [("zero1-bf16", 1), ("zero2-bf16", 2)])
def test_bf16_master_fp32_compute_bf16_and_the_paper_formula(cell, name, stage):
    r, n = _ok(cell, name), 2
    s = r.summary["state"]
    assert s["check"] == "PASS", s["reasons"]
    assert s["expected"] == {"param": n / 2, "grad": n / 2 if stage == 1 else 0.5, "optim": 2, "master": 1}
    frame = read_csv(r, "rank_state.csv")
    dtypes = {k: set(frame[frame.kind == k].dtype) for k in ("param", "grad", "master", "optim")}
    assert dtypes == {"param": {"bfloat16"}, "grad": {"bfloat16"}, "master": {"float32"}, "optim": {"float32"}}
    numel = WIDTH * WIDTH * DEPTH
    per_rank = frame[frame.kind.isin(["param", "grad", "master", "optim"])].groupby("rank").logical_bytes.sum()
    assert (per_rank == sharded_zero_rank_bytes(stage, numel, n)).all()  # 2P'+2P'+12P'/N, 2P'+14P'/N
    c = r.summary["collectives"]
    assert c["check"] == "PASS" and c["dtypes"] == {"reduce_scatter": "bfloat16", "all_gather": "bfloat16"}
    assert c["payload_bytes"] == {"reduce_scatter": P // 2, "all_gather": P // 2}
    assert r.summary["equivalence"]["check"] == "PASS", r.summary["equivalence"]


def test_fp16_loss_scaling(cell):
    r = _ok(cell, "zero2-fp16")
    assert r.summary["state"]["check"] == "PASS", r.summary["state"]["reasons"]
    c = r.summary["collectives"]  # the overflow check is the squared-norm all_reduce
    assert c["check"] == "PASS" and c["dtypes"]["all_reduce"] == "float32" and c["dtypes"]["all_gather"] == "float16"
    assert r.summary["equivalence"]["check"] == "PASS", r.summary["equivalence"]


def test_config_refusals_name_the_key(compose):
    with pytest.raises(ConfigError) as e:
        validate(compose("strategy=zero1", "offload=optimizer"))
    assert e.value.key == "offload" and "strategies that do: deepspeed" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(compose("strategy=zero1", "strategy.reduce=broadcast"))
    assert e.value.key == "strategy.reduce"
    with pytest.raises(ConfigError) as e:
        validate(compose("strategy=zero2", "strategy.clip_grad_norm=0"))
    assert e.value.key == "strategy.clip_grad_norm"
    validate(compose("strategy=zero2", "precision=fp16", "warmup_steps=0"))


def _overlap_rank(rank: int, world_size: int, init: str, out: str) -> None:
    """One rank: two steps of ShardedAdamW over two buckets; record when each bucket's parameter all_gather is waited
    on relative to the modules' forwards."""
    from zeroexp.strategies.sharding import ShardedAdamW, flatten_into_buckets

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LinearStack(16, 4)
    buckets = flatten_into_buckets(list(model.parameters()), world_size, rank, 2 * 16 * 16 * 4, torch.float32)
    opt = ShardedAdamW(buckets, stage=2)
    opt.overlap_parameter_gather(model)
    events: list[str] = []
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(f"forward {i}"))

    class Spy:  # the real async work, and when it is waited on
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(f"wait {self.name}")
            return self.work.wait()

    x = torch.randn(4, 16)
    for step in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        pending = [b.gather is not None for b in buckets]
        for k, b in enumerate(buckets):
            b.gather = Spy(b.gather, f"bucket {k}") if b.gather is not None else None
        events.append(f"step {step} done, pending {pending}")
    model(x)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"events": events, "left": [b.gather for b in buckets]}))
    dist.barrier()
    dist.destroy_process_group()


def test_parameter_all_gather_overlaps_the_next_forward(tmp_path):
    """The updated parameters' all_gather is in flight when the step returns and is waited on by the pre-hook of the
    first module that reads the bucket, right before it computes (structure, never timing)."""
    mp.start_processes(_overlap_rank, args=(2, f"file://{tmp_path}/store", str(tmp_path)), nprocs=2,
                       start_method="fork")  # as the grid above: no torch re-import, no interpreter teardown
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the hooks registered by overlap_parameter_gather run before the spies' (registered later)
        assert res["events"][-6:] == ["wait bucket 0", "forward 0", "forward 1", "wait bucket 1", "forward 2",
                                      "forward 3"]
        assert "step 0 done, pending [True, True]" in res["events"] and res["left"] == [None, None]
