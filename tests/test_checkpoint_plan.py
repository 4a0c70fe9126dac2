"""What a checkpoint writes, planned (zeroexp.formulas.checkpoint) and read from files (zeroexp.probes.payload): the
state's parts on shapes with frozen parameters, buffers, a tied weight and a parameter no step grades; the files of
torch.save and torch.distributed.checkpoint read to their tensors' bytes; the planner's rows for a 70B-class model at
N=64. The cells' check (plan.checkpoint) is asserted where the cells run: tests/test_checkpoint.py,
tests/test_checkpoint_moves.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroexp.formulas import LAYOUTS, ModelShape, derive_groups
from zeroexp.formulas.checkpoint import state_payload, written_bytes
from zeroexp.formulas.device import cuda
from zeroexp.formulas.shapes import PlanKnobs
from zeroexp.plan import Precision, plan
from zeroexp.plan.core import checkpoint_peak_records
from zeroexp.plan.shape import shape_of
from zeroexp.probes.payload import file_payload, files_payload


class _Tied(nn.Module):
    """A tied embedding and head, a frozen layer, a buffer, one the state dict leaves out and a layer forward never
    calls."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8, bias=False).requires_grad_(False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(8, 8, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("table", torch.ones(8), persistent=False)  # held, never saved (Llama's inv_freq)

    def forward(self, x):
        return self.head(self.frozen(self.emb(x)) * self.scale[0])


def _groups(row: str, shape: ModelShape, n: int, itemsize: int = 4):
    return LAYOUTS[row], derive_groups(row, LAYOUTS[row], shape, n, itemsize)


def test_the_state_a_checkpoint_holds_by_part():
    """fp32 masters of the trained parameters (the tied one once), the frozen one as held, the buffer, AdamW's two
    moments and a step per parameter a step grades (the unused one has none); a tied parameter's second name once
    more where the writer stores each name (DCP; FSDP's full state dicts), not where one tensor is written."""
    from dataclasses import replace

    shape = replace(shape_of(_Tied(), [nn.Linear]), unused=(2,))  # parameters: emb, frozen, unused (as a trace says)
    assert shape.aliases == ((0, 1),) and shape.unsaved_buffers == (1,)
    layout, groups = _groups("ddp", shape, 2)
    state = state_payload(layout, groups, 4, shape)
    assert state.record() == {"params": 4 * (128 + 64), "frozen": 4 * 64, "buffers": 16, "moments": 8 * 128,
                              "steps": 4, "total": 4 * (128 + 64) + 4 * 64 + 16 + 8 * 128 + 4}
    assert written_bytes(layout, groups, 4, "full", shape)["ranks"] == [state.total, 0]  # one tensor, both names
    assert written_bytes(layout, groups, 4, "sharded", shape)["total"] == state.total + 4 * 128  # DCP: each name
    layout, groups = _groups("fsdp2_full", shape, 3)
    full = written_bytes(layout, groups, 4, "full", shape)
    assert full["aliases"] == 4 * 128 and full["ranks"] == [full["total"], 0, 0]
    zro = written_bytes(*_groups("zro", shape, 2), 4, "sharded", shape)  # rank 0: the module; each: its owned state
    module = 4 * (128 + 64) + 4 * 64 + 16
    assert sum(zro["ranks"]) == zro["total"] == module + 8 * 128 + 4 and zro["ranks"][0] >= module


def test_the_files_tensor_bytes_are_read_from_the_files(tmp_path):
    """torch.save: the storages (a tensor under two names once; not the pickled structure); a DCP checkpoint written
    by one process: each item's tensor bytes, none of .metadata's."""
    import torch.distributed.checkpoint as dcp

    w, b = torch.zeros(64, 4), torch.ones(3, dtype=torch.bfloat16)
    torch.save({"w": w, "again": w, "b": b, "lr": 0.1}, tmp_path / "full.pt")
    assert file_payload(tmp_path / "full.pt") == 64 * 4 * 4 + 3 * 2 < (tmp_path / "full.pt").stat().st_size
    with pytest.warns(UserWarning):  # "assuming the intent is to save in a single process"
        dcp.save({"w": w, "b": b, "step": 7}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    names = [p.name for p in (tmp_path / "dcp").iterdir()]
    assert files_payload(tmp_path / "dcp", names) == 64 * 4 * 4 + 3 * 2
    assert file_payload(tmp_path / "dcp" / ".metadata") == 0


def test_the_planner_gives_a_70b_class_checkpoint_at_64_ranks():
    """A GPT of 80 blocks of width 8192 (tied head; 64.7B parameters as the planner counts them from its shape) at
    N=64: a full checkpoint is its whole fp32 state on rank 0 (12 bytes a parameter and a step per tensor), FSDP's a
    tied head more; sharded, DCP's ranks share it (1/64 each on average), ZeroRedundancyOptimizer's rank 0 writes the
    whole module besides its owned state; DeepSpeed stage 3 each rank its padded partitions."""
    from zeroexp.models.gpt import GPT, Block

    with torch.device("meta"):
        net = GPT(vocab_size=32000, seq_len=2048, n_layer=80, n_head=64, n_embd=8192, bias=True, tie_weights=True)
    shape = shape_of(net, [Block])
    records, _ = plan(shape, [64], Precision("bf16", "bfloat16"),
                      strategies=["ddp", "zro", "fsdp_full", "fsdp2_full", "deepspeed_stage3"])
    ck = {r["strategy"]: r["checkpoint"] for r in records}
    psi, tensors = shape.numel, len(shape.params)
    state = 12 * psi + 4 * tensors
    assert {s: c["state_bytes"] for s, c in ck.items()} == dict.fromkeys(ck, state)
    head = 4 * 32000 * 8192
    assert ck["ddp"]["full"]["rank0_bytes"] == state and ck["fsdp2_full"]["full"]["rank0_bytes"] == state + head
    assert ck["fsdp_full"]["sharded"]["written_bytes"] == state + head
    assert ck["fsdp_full"]["sharded"]["mean_rank_bytes"] == (state + head) // 64
    assert ck["zro"]["sharded"]["largest_rank_bytes"] > 4 * psi  # the module whole, and its share
    ds = ck["deepspeed_stage3"]["sharded"]
    # fp32 partitions and moments, padded to 64 ranks, and one step per flat partition (not per tensor)
    assert ds["layout"] == "deepspeed" and 12 * psi <= ds["written_bytes"] <= state + 12 * 64 * tensors
    # save and load on H100s (foreach AdamW, 512-B blocks): a full save holds the file on rank 0's host; a full load
    # reads it on every rank's host, and FSDP2's device holds its 1/64 of the parameters and the moments twice; a
    # sharded load the zero step alone (gradients, both moments, foreach temporaries: 4 bytes each of the 1/64)
    checkpoint_peak_records(records, shape, Precision("bf16", "bfloat16"), PlanKnobs(), cuda(9.0))
    full, sharded = ck["fsdp2_full"]["full"]["peaks"], ck["fsdp2_full"]["sharded"]["peaks"]
    assert ck["ddp"]["full"]["peaks"]["save"]["host_rank0_bytes"] == state
    assert full["save"]["host_rank0_bytes"] == full["load"]["host_largest_rank_bytes"] == state + head
    assert full["save"]["lower_bound"] and full["save"]["largest_rank_bytes"] == 4 * 4 * 8192 * 8192  # an MLP weight
    assert 5 * 4 * psi / 64 < full["load"]["largest_rank_bytes"] < 5 * 4 * psi / 64 * 1.01
    assert 4 * 4 * psi / 64 <= sharded["load"]["largest_rank_bytes"] < 4 * 4 * psi / 64 * 1.01
    # ZeroRedundancyOptimizer consolidates on rank 0 through its device: every other owner's moments and steps there
    zro = ck["zro"]["full"]["peaks"]["save"]
    assert zro["lower_bound"] and 7.8 * psi < zro["rank0_bytes"] < 8 * psi


def test_the_plan_table_shows_what_a_checkpoint_writes():
    """``python -m zeroexp.plan`` prints the checkpoint table beside the JSON rows' ``checkpoint`` (GiB)."""
    import json

    from conftest import run_cli

    args = ("model=gpt", "world_size=4", "strategies=[ddp,zero2,fsdp2_full]", "units=GB")
    table = run_cli(*args, app="zeroexp.cli.plan")
    rows = {r["strategy"]: r["checkpoint"] for r in json.loads(run_cli(*args, "format=json",
                                                                          app="zeroexp.cli.plan").stdout)}
    assert table.returncode == 0 and "What a checkpoint writes, in GB" in table.stdout
    shown = table.stdout.split("What a checkpoint writes")[1].splitlines()
    line = next(x for x in shown if x.strip("│ ").startswith("fsdp2_full"))
    cells = [c.strip() for c in line.strip("│").split("│")]
    assert cells[:2] == ["fsdp2_full", "4"] and cells[6] != "-"
    assert float(cells[3]) == pytest.approx(rows["fsdp2_full"]["full"]["rank0_bytes"] / 1e9, abs=0.0011)
    peaks = table.stdout.split("What a checkpoint's save and load hold")[1].splitlines()
    line = next(x for x in peaks if x.strip("│ ").startswith("fsdp2_full") and "sharded" in x)
    cells = [c.strip() for c in line.strip("│").split("│")]
    load = rows["fsdp2_full"]["sharded"]["peaks"]["load"]
    assert cells[3] == ">= 0" and float(cells[5].removeprefix(">= ")) == pytest.approx(load["largest_rank_bytes"] / 1e9,
                                                                                          abs=0.0011)
    zero2 = next(x for x in shown if x.strip("│ ").startswith("zero2"))  # DCP's items: each tensor once
    assert rows["zero2"]["sharded"]["layout"] == "dcp" and zero2.strip("│").split("│")[4].strip() != "-"


def test_every_ranks_local_elements_at_once_equal_each_ranks():
    """``local_numels_by_rank`` (what the checkpoint peaks read for every rank of a 64-rank row at once) equals
    ``local_numels`` rank by rank: FSDP2's padded rows (a parameter shorter than N: the last ranks hold none), FSDP1's
    units of several spans with padding between and after them, parameters of no elements (a zero-length span: none
    anywhere)."""
    from zeroexp.formulas.layout import local_numels, local_numels_by_rank
    from zeroexp.formulas.shapes import Shard

    cases = [((Shard(((0, 10),), 12), Shard(((0, 2),), 3), Shard(((0, 64),), 66)), 3),
             ((Shard(((0, 5), (6, 17), (20, 23)), 24), Shard(((0, 7),), 8)), 4),
             ((Shard(((0, 1),), 8),), 8),
             ((Shard(((0, 4), (4, 4), (4, 9)), 12), Shard(((0, 0),), 3)), 3)]  # parameters of no elements
    for shards, n in cases:
        assert local_numels_by_rank(shards, n) == tuple(local_numels(shards, n, r) for r in range(n)), (shards, n)
