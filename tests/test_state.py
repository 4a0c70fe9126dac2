"""The state probe: rank-local parameter, gradient and optimizer bytes against the ZeRO table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from conftest import read_csv
from zeroexp.cell.resolved import Cell
from zeroexp.cell.policy import CellPolicy
from zeroexp.plan.check.expect import Expectation
from zeroexp.formulas import padded_numel
from zeroexp.launch.local import free_port
from zeroexp.models import LinearStack
from zeroexp.probes.state import StateProbe, count_state
from zeroexp.strategies import get_adapter_class
from zeroexp.results.verdict import Code

WIDTH, DEPTH = 64, 8  # conftest BASE: model.width=64, the mlp's default depth
P = WIDTH * WIDTH * DEPTH * 4  # logical fp32 parameter bytes
#: Aggregate factors param / grad / optim of fp32 AdamW (ZeRO section 5.1; FSDP reshards at the boundary).
TABLE = {"ddp": lambda n: (n, n, 2 * n), "zro": lambda n: (n, n, 2),
         "fsdp_grad_op": lambda n: (1, 1, 2), "fsdp_full": lambda n: (1, 1, 2)}
# The override tuples of tests/test_foundation.py, so both modules share the session's cached runs.
CELLS = [("strategy=ddp",), ("strategy=zro",), ("strategy=fsdp_grad_op",),
         ("strategy=fsdp_full", "prefetch=pre"), ("strategy=fsdp_full", "prefetch=post"),
         ("strategy=fsdp_full", "prefetch=none")]


# Every prefetch at N=2; at N=4 one prefetch suffices (prefetch changes issue order, not what is held).
GRID = [(o, 2) for o in CELLS] + [(o, 4) for o in CELLS[:4]]


@pytest.mark.parametrize("overrides, world_size", GRID,
                         ids=lambda v: "-".join(x.split("=")[1] for x in v) if isinstance(v, tuple) else f"n{v}")
def test_factors_match_the_zero_table(cell, overrides, world_size):
    r = cell(*overrides, f"world_size={world_size}")
    assert r.status == "ok", r.error
    s, strategy, n = r.summary["state"], overrides[0].split("=")[1], world_size
    want = dict(zip(("param", "grad", "optim"), TABLE[strategy](n)))
    assert s["check"] == "PASS" and s["reasons"] == [] and s["reason_codes"] == [], s["reasons"]
    assert {k: s["expected"][k] for k in want} == want
    assert s["logical_param_bytes"] == P
    # Adam keeps one 4-byte step scalar per parameter it updates: 8 per rank, or 8 in all under zro owners.
    scalars = 8 * 4 * (1 if strategy == "zro" else n)
    assert s["optim_scalar_bytes"] == scalars and s["factors"]["optim_scalar"] == pytest.approx(scalars / P)
    for kind, factor in want.items():
        assert s["factors"][kind] == pytest.approx(factor, abs=1e-3)
    assert s["factors"]["optim"] + s["factors"]["optim_scalar"] - want["optim"] == pytest.approx(scalars / P)
    # The reference figures, scaled down: the largest rank holds P or P/N of params and grads, 2P or 2P/N of moments.
    replicated = strategy in ("ddp", "zro")
    assert s["max_rank_bytes"]["param"] == s["max_rank_bytes"]["grad"] == (P if replicated else P // n)
    assert s["max_rank_bytes"]["optim"] == (2 * P if strategy == "ddp" else 2 * P // n)
    assert s["padding_bytes"] == 0 and s["physical_param_bytes"] == want["param"] * P
    assert s["owner_imbalance"] == pytest.approx(1.0)  # 8 equal Linear weights over 2 or 4 owners
    assert s["semantics"]

    frame = read_csv(r, "rank_state.csv")
    assert list(frame.columns) == ["rank", "kind", "logical_bytes", "physical_bytes", "host_bytes", "dtype", "device",
                                   "numel"]
    for kind, factor in want.items():
        rows = frame[frame.kind == kind]
        assert sorted(rows["rank"]) == list(range(n))
        assert rows.logical_bytes.sum() == factor * P and (rows.numel * 4 == rows.logical_bytes).all()
        assert set(rows.dtype) == {"float32"} and set(rows.device) == {"cpu"}


def test_grad_op_semantics_says_param_factor_differs_from_zero2(cell):
    s = cell("strategy=fsdp_grad_op", "world_size=2").summary["state"]
    assert s["factors"]["param"] == 1.0 and "ZeRO-2" in s["semantics"] and "factor is 1" in s["semantics"]


PAD_N, PAD_WIDTH = 3, 10  # each unit holds one 10 x 10 weight: 100 elements, padded to 102 over 3 ranks


def _assert_padded(s: dict, frame, optim_padded: bool) -> None:
    """Physical exceeds logical by exactly FSDP's padding (computed here from the formula); factors exact."""
    p = PAD_WIDTH * PAD_WIDTH * DEPTH * 4
    padding = DEPTH * (padded_numel(PAD_WIDTH * PAD_WIDTH, PAD_N) - PAD_WIDTH * PAD_WIDTH) * 4
    assert padding > 0 and s["logical_param_bytes"] == p
    assert s["check"] == "PASS", s["reasons"]
    assert s["factors"]["param"] == s["factors"]["grad"] == 1.0 and s["factors"]["optim"] == 2.0
    assert s["padding_bytes"] == s["physical_param_bytes"] - p == padding
    assert s["padding_bytes_by_kind"]["grad"] == padding
    assert s["padding_bytes_by_kind"]["optim"] == (2 * padding if optim_padded else 0)
    params = frame[frame.kind == "param"]
    shard = DEPTH * padded_numel(PAD_WIDTH * PAD_WIDTH, PAD_N) // PAD_N * 4
    assert (params.physical_bytes == shard).all()  # every rank's shards are padded to the same size
    assert params.logical_bytes.sum() == p


def test_padding_when_numel_does_not_divide_by_world_size(cell):
    r = cell("strategy=fsdp_full", "prefetch=pre", f"world_size={PAD_N}", f"model.width={PAD_WIDTH}")
    assert r.status == "ok", r.error
    # use_orig_params (the default): AdamW steps each parameter's view of the shard, its moments unpadded
    _assert_padded(r.summary["state"], read_csv(r, "rank_state.csv"), optim_padded=False)


def _orig_params_rank(rank: int, port: int, cfg_dict: dict, out: str) -> None:
    """One rank of an FSDP1 run without Lightning or the other probes: step once, count."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PAD_N)
    torch.set_num_threads(1)
    cfg = OmegaConf.create(cfg_dict)
    adapter = get_adapter_class(cfg.strategy.name)(CellPolicy.of(cfg))
    torch.manual_seed(0)
    model = adapter.wrap(LinearStack(PAD_WIDTH, DEPTH), torch.device("cpu"))
    optimizer = adapter.make_optimizer(model.parameters())
    model(torch.randn(4, PAD_WIDTH)).pow(2).mean().backward()
    optimizer.step()
    result = {"rows": count_state(adapter.state_tensors(model, optimizer)), "step": 0,
              "logical_param_bytes": PAD_WIDTH * PAD_WIDTH * DEPTH * 4,
              "expected": Expectation(Cell.of(cfg), adapter.groups).state_factors(), "semantics": adapter.semantics}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears gloo down while a peer is still in a collective (SIGABRT in CI once)
    dist.destroy_process_group()


def test_flat_parameters_pad_the_moments_too(compose, tmp_path):
    # Run directly (not as a cell: one step, no probe but the state's): use_orig_params=false, AdamW steps each
    # padded FlatParameter shard, so the moments carry the padding too.
    cfg = compose("strategy=fsdp_grad_op", f"world_size={PAD_N}", f"model.width={PAD_WIDTH}",
                  "strategy.use_orig_params=false")
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict.pop("hydra", None)
    # fork, as zeroexp's forkserver does: no fresh interpreter re-importing torch per rank, and a forked rank ends
    # with os._exit, never in the interpreter teardown where a spawned gloo rank sometimes aborts
    mp.start_processes(_orig_params_rank, args=(free_port(), cfg_dict, str(tmp_path)), nprocs=PAD_N,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(PAD_N)]
    report = StateProbe.aggregate(results, Cell.of(cfg))
    _assert_padded(report.section, report.tables["rank_state.csv"], optim_padded=True)  # moments padded too


def _rank_result(cfg, adapter, model, optimizer, world_size):
    return {"rows": count_state(adapter.state_tensors(model, optimizer)), "step": 3,
            "logical_param_bytes": 4 * sum(q.numel() for q in model.parameters()),
            "expected": Expectation(Cell.of(cfg), adapter.groups).state_factors(), "semantics": adapter.semantics}


def _stepped_adamw(params):
    params = list(params)
    opt = torch.optim.AdamW(params)
    for q in params:
        q.grad = torch.ones_like(q)
    opt.step()
    return opt


def test_check_fails_on_an_unsharded_optimizer_under_a_zero1_claim(compose):
    cfg = compose("strategy=zro", "world_size=2")
    adapter = get_adapter_class("zro")(CellPolicy.of(cfg))
    model = LinearStack(16, 4)
    p = 4 * sum(q.numel() for q in model.parameters())
    # Plain AdamW on both ranks: every rank holds every moment, while zro claims ZeRO-1 (optim factor 2).
    full = _rank_result(cfg, adapter, model, _stepped_adamw(model.parameters()), 2)
    report = StateProbe.aggregate([full, full], Cell.of(cfg))
    s = report.section
    assert s["check"] == "FAIL" and s["factors"]["optim"] == 4.0
    assert s["reason_codes"] == [Code.STATE_FACTOR_DIFFERS] and s["reasons"][0].startswith("optim:")
    assert f"({4 * p} B summed over 2 ranks / P = {p} B)" in s["reasons"][0]  # the numbers it names
    # The same tensors owned half by each rank, as ZeroRedundancyOptimizer would: PASS.
    layers = list(model)
    owned = [_rank_result(cfg, adapter, model, _stepped_adamw(q for m in part for q in m.parameters()), 2)
             for part in (layers[:2], layers[2:])]
    s = StateProbe.aggregate(owned, Cell.of(cfg)).section
    assert s["check"] == "PASS" and s["factors"]["optim"] == 2.0 and s["owner_imbalance"] == 1.0
    assert len(report.tables["rank_state.csv"]) == 2 * 4  # param, grad, optim, optim_scalar per rank


def test_count_state_counts_each_storage_and_each_element_once():
    flat = torch.zeros(10)  # a padded shard holding 8 logical elements, and two views into it
    bucket = torch.zeros(6)  # a gradient bucket seen only through its views
    rows = {r["kind"]: r for r in count_state([
        ("param", flat, 8), ("param", flat[:4], 4), ("param", flat[4:8], 4), ("param", flat, 8),
        ("grad", bucket[:3], 3), ("grad", bucket[3:], 3), ("optim", flat[:2], 2),
    ])}
    assert (rows["param"]["logical_bytes"], rows["param"]["physical_bytes"]) == (32, 40)
    assert (rows["grad"]["logical_bytes"], rows["grad"]["physical_bytes"]) == (24, 24)
    assert (rows["optim"]["logical_bytes"], rows["optim"]["physical_bytes"]) == (0, 0)  # inside the counted shard
    assert rows["param"]["dtype"] == "float32" and rows["param"]["device"] == "cpu" and rows["grad"]["numel"] == 6


def test_views_per_rank_counts_each_rank_s_nonempty_views():
    """``views_per_rank`` (counted at each span's first and last chunk) equals its definition: per rank, the spans
    whose ``view_numels`` in that rank's chunk is above 0, over odd chunk sizes, empty spans and hybrid shards."""
    import random
    from types import SimpleNamespace

    from zeroexp.formulas.orig_params import view_numels, views_per_rank
    from zeroexp.formulas.shapes import Shard

    rnd = random.Random(0)
    for _ in range(500):
        over = rnd.randint(1, 12)
        shards = []
        for _ in range(rnd.randint(0, 4)):
            numel = rnd.randint(0, 60)
            cuts = sorted(rnd.randint(0, numel) for _ in range(rnd.randint(0, 6)))
            shards.append(Shard(tuple(zip(cuts[::2], cuts[1::2])) + ((5, 5),) * (rnd.random() < .2), numel))
        groups = SimpleNamespace(trained_shards=shards, shard_over=over, world_size=over * rnd.randint(1, 3))
        per = [sum(k > 0 for sh in shards for k in view_numels(sh, over, i)) for i in range(over)]
        assert views_per_rank(groups) == [per[r % over] for r in range(groups.world_size)]


def test_a_scalar_parameters_moments_are_optimizer_state_not_scalars():
    """Adam's ``step`` is a scalar of the optimizer; a 0-dim parameter's moments are element-wise state like any
    other's (they were counted as scalars beside the steps, and plan.state FAILed on a model with a learnable scale)."""
    import torch

    from zeroexp.strategies.base import optimizer_state_tensors

    scale, weight = torch.nn.Parameter(torch.tensor(1.5)), torch.nn.Parameter(torch.ones(3, 4))
    opt = torch.optim.AdamW([scale, weight])
    (scale * weight).sum().backward()
    opt.step()
    kinds = [(t.kind, t.tensor.dim()) for t in optimizer_state_tensors(opt)]
    assert sorted(kinds) == sorted([("optim_scalar", 0)] * 2 + [("optim", 0)] * 2 + [("optim", 2)] * 2)
