"""Checkpoints of the hybrid cells: fsdp_hybrid (FSDP1 HYBRID_SHARD on a device mesh) and
fsdp2_hybrid (FSDP2 on a (replicate, shard) mesh) save full and sharded checkpoints and continue bit-identically at
N=4, shard_size=2, as tests/test_checkpoint.py's FSDP cells do. Measured: a full save gathers 3P (parameters and
both Adam moments) within rank 0's shard group and only rank 0 writes; a sharded save (torch.distributed.checkpoint of
DTensors) writes each shard the two replicas hold alike once, so the ranks together write 3P (plus DCP's per-item
framing), not the 2 x 3P of one copy per replica. FSDP1's SHARDED_STATE_DICT (through get_state_dict) still
all-gathers each FlatParameter and its moments (3P) to cut the original parameters into DTensors, as fsdp_full's does,
and with use_orig_params (FSDP1's default) first each unit's optimizer state info as pickled objects
(``_optim_utils._allgather_state_info``: all_gather_object; measured 404,716 B of all_gather at N=4 for the full save,
3P + 11,500 B, about 1.4 KB a unit); FSDP2 gathers no tensor.
"""

from __future__ import annotations

import pytest

from zeroexp.probes.checkpoint import verify_checkpoint
from conftest import read_csv

P = 8 * 64 * 64 * 4  # conftest.BASE's mlp: 8 Linear(64, 64), fp32
N, S = 4, 2
#: Beyond FSDP1's tensors: its state info, gathered as pickled objects per unit (use_orig_params), under 2 KB a unit
INFO = 8 * 2048


def _cell(cell, strategy: str, kind: str):
    result = cell(f"strategy={strategy}", f"world_size={N}", f"strategy.shard_size={S}", f"checkpoint={kind}",
                  "checkpoint.keep=true")
    assert result.status == "ok", result.error
    return result


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("strategy", ["fsdp_hybrid", "fsdp2_hybrid"])
def test_hybrid_round_trip_continues_bit_identically(cell, strategy, kind):
    result = _cell(cell, strategy, kind)
    ck = result.summary["checkpoint"]
    assert ck["check"] == "PASS", ck["reasons"]
    assert ck["restored_bit_identical"] and ck["continuation_bit_identical"]
    assert ck["continuation_max_abs_diff"] == 0.0 and ck["compared_tensors"] == 8
    assert all(result.summary[k]["check"] == "PASS" for k in ("state", "collectives", "equivalence"))
    written, save = ck["save"]["rank_bytes_written"], ck["save"]["collectives"]
    if kind == "full":  # everything gathered to rank 0, one file: parameters and both moments, 3P, in the shard group
        assert written[1:] == [0] * (N - 1) and ck["files"] == 1 and written[0] > 3 * P
        assert 3 * P <= save["payload_bytes"]["all_gather"] < 3 * P + (INFO if strategy == "fsdp_hybrid" else 1)
    else:  # every rank writes; a shard both replicas hold is written once: 3P in all, not one copy per replica
        assert all(w > 0 for w in written) and 3 * P < sum(written) < 2 * 3 * P
        gathered = save["payload_bytes"].get("all_gather", 0) - (3 * P if strategy == "fsdp_hybrid" else 0)
        # beyond the tensors FSDP1 unshards, its state info and DCP's planning metadata only
        assert 0 <= gathered < (INFO if strategy == "fsdp_hybrid" else P // 100)
    meta = verify_checkpoint(f"{result.cell_dir}/checkpoint", kind=kind, strategy=strategy, world_size=N)
    assert meta["world_size"] == N and sum(f["bytes"] for f in meta["files"]) == ck["save"]["bytes_written"]
    assert sorted(read_csv(result, "checkpoint.csv").phase.unique()) == ["load", "save"]
