"""Full and sharded checkpoints (zeroexp/probes/checkpoint.py): round trips for ddp, zro, fsdp_full, fsdp2_full and
DeepSpeed ZeRO stages 0-3 at N=2 continue bit-identically; a full save gathers to rank 0, a sharded one does not; a
damaged checkpoint is refused.

Eight cells at N=2 (the mlp of 8 x Linear(64, 64), P = 128 KiB), their checkpoints kept for the refusal tests, and
eight DeepSpeed cells (stage x kind, fp32) when DeepSpeed is installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import STEPS, read_csv
from zeroexp.config.schemas import ConfigError, validate
from zeroexp.probes.checkpoint import META, CheckpointError, verify_checkpoint

P = 8 * 64 * 64 * 4  # logical parameter bytes of the test mlp
#: What a checkpoint of it holds: fp32 parameters, AdamW's two moments, one 4-byte step per parameter.
STATE_OPTIM = 2 * P + 8 * 4
STATE = P + STATE_OPTIM


def _planned_exactly(result, ranks: list[int] | None) -> None:
    """plan.checkpoint PASS: the tensors' bytes of the files (all ranks: the mlp's whole state; each rank's where the
    layout fixes it, ``ranks``) equal the plan's, which equal ``ranks`` here (None: DCP picks, only the total)."""
    part = result.summary["plan"]["checkpoint"]
    assert part["check"] == "PASS", part
    assert part["predicted_bytes"] == part["measured_bytes"] == sum(part["measured_rank_bytes"])
    assert part["predicted_rank_bytes"] == ranks
    if ranks is not None:
        assert part["measured_rank_bytes"] == ranks
STRATEGIES = ("ddp", "zro", "fsdp_full")
#: Strategies whose checkpoints are the base adapter's default (torch's state-dict API) alone, besides DDP's.
DEFAULT_TRIO = ("fsdp2_full",)


def _cell(cell, strategy: str, kind: str):
    result = cell(f"strategy={strategy}", f"checkpoint={kind}", "world_size=2", "checkpoint.keep=true")
    assert result.status == "ok", result.error
    return result


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("strategy", STRATEGIES + DEFAULT_TRIO)
def test_round_trip_continues_bit_identically(cell, strategy, kind):
    result = _cell(cell, strategy, kind)
    ck = result.summary["checkpoint"]
    assert ck["check"] == "PASS", ck["reasons"]
    assert ck["restored_bit_identical"] and ck["continuation_bit_identical"]
    assert ck["continuation_max_abs_diff"] == 0.0 and ck["compared_tensors"] == 8
    assert ck["kind"] == kind and ck["kept"] and ck["directory"] == "checkpoint"
    manifest = json.loads((Path(result.cell_dir) / "manifest.json").read_text())
    assert result.summary["cell"]["checkpoint"] == kind and f"_ckpt-{kind}_" in manifest["cell_name"]
    written = ck["save"]["rank_bytes_written"]
    assert sum(written) == ck["save"]["bytes_written"] > 3 * P  # parameters and both Adam moments
    if kind == "full":  # everything on rank 0, one file
        assert written[1] == 0 and ck["files"] == 1
    else:  # nothing gathered: every rank writes its part
        assert all(w > 0 for w in written)
    meta = json.loads((Path(result.cell_dir) / "checkpoint" / META).read_text())
    assert meta["world_size"] == 2 and meta["strategy"] == strategy
    assert sum(f["bytes"] for f in meta["files"]) == ck["save"]["bytes_written"]
    _planned_exactly(result, {"full": [STATE, 0], "sharded": {"zro": [P + STATE_OPTIM // 2, STATE_OPTIM // 2]}
                              .get(strategy)}[kind])
    frame = read_csv(result, "checkpoint.csv")
    assert sorted(frame.phase.unique()) == ["load", "save"] and len(frame) == 4


def test_what_each_save_sends_and_holds(cell):
    """Collectives and rank 0's peak above its starting bytes, per strategy (CPU, MemTracker)."""
    saves = {(s, k): _cell(cell, s, k).summary["checkpoint"]["save"] for s in STRATEGIES for k in ("full", "sharded")}
    # DDP: rank 0 already holds everything: the full save neither communicates nor allocates.
    assert (saves["ddp", "full"]["collectives"]["counts"] == {}
            and saves["ddp", "full"]["rank0_peak_over_start_bytes"] == 0)
    # ZeroRedundancyOptimizer: consolidating broadcasts the other owner's state (size, then bytes) to rank 0;
    # sharded: each owner writes its own, no collective, no allocation.
    assert saves["zro", "full"]["collectives"]["counts"] == {"broadcast": 2}
    assert (saves["zro", "sharded"]["collectives"]["counts"] == {}
            and saves["zro", "sharded"]["rank0_peak_over_start_bytes"] == 0)
    # FSDP FULL_STATE_DICT: every unit's parameters and Adam moments all-gathered (3P of payload).
    assert saves["fsdp_full", "full"]["collectives"]["payload_bytes"]["all_gather"] >= 3 * P
    for strategy in ("zro", "fsdp_full"):  # the full save's rank 0 peak is above the sharded save's
        full, sharded = saves[strategy, "full"], saves[strategy, "sharded"]
        assert full["rank0_peak_over_start_bytes"] > sharded["rank0_peak_over_start_bytes"], strategy
        assert full["rank0_peak_bytes"] > sharded["rank0_peak_bytes"], strategy
    # FSDP full with rank0_only: rank 0 keeps the gathered state (>= P of parameters + 2P of moments), rank 1 does
    # not. Slack of one unit (P / 8): a tensor counted at the start that gloo's thread frees late lowers peak - start.
    over = saves["fsdp_full", "full"]["peak_over_start_bytes"]
    assert over[0] >= 3 * P - P // 8 and over[1] < 3 * P - P // 8, over
    # FSDP2 through get_state_dict(full_state_dict, cpu_offload): every DTensor (parameters, both moments) made whole
    # by all_gather; rank 0 keeps the gathered state, rank 1 only a unit's transient.
    fsdp2 = _cell(cell, "fsdp2_full", "full").summary["checkpoint"]["save"]
    assert fsdp2["collectives"]["payload_bytes"]["all_gather"] >= 3 * P
    assert fsdp2["peak_over_start_bytes"][0] >= 3 * P - P // 8 > fsdp2["peak_over_start_bytes"][1]


def _copy(cell, tmp_path: Path, strategy: str, kind: str) -> Path:
    src = Path(_cell(cell, strategy, kind).cell_dir) / "checkpoint"
    return Path(shutil.copytree(src, tmp_path / f"{strategy}-{kind}"))


def test_damaged_or_mismatched_checkpoints_are_refused(cell, tmp_path):
    sharded = _copy(cell, tmp_path, "fsdp_full", "sharded")
    assert verify_checkpoint(sharded, kind="sharded", strategy="fsdp_full", world_size=2)["step"] == STEPS
    with pytest.raises(CheckpointError, match="written by 2 ranks.*not world_size=4"):
        verify_checkpoint(sharded, kind="sharded", strategy="fsdp_full", world_size=4)
    with pytest.raises(CheckpointError, match="a sharded checkpoint; a full one"):
        verify_checkpoint(sharded, kind="full")
    with pytest.raises(CheckpointError, match="strategy=fsdp_full.*not into strategy=ddp"):
        verify_checkpoint(sharded, strategy="ddp")
    shard = sharded / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"__1_0.distcp: \d+ bytes, meta.json says \d+: the file is truncated"):
        verify_checkpoint(sharded)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(CheckpointError, match="SHA-256 differs"):
        verify_checkpoint(sharded)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(sharded)

    full = _copy(cell, tmp_path, "zro", "full")
    assert verify_checkpoint(full, kind="full", strategy="zro", world_size=4)  # a full checkpoint is N-independent
    (full / META).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable.*corrupted"):
        verify_checkpoint(full)
    (full / META).unlink()
    with pytest.raises(CheckpointError, match="no meta.json"):
        verify_checkpoint(full)


def test_checkpoint_kind_the_strategy_lacks_is_refused(compose, monkeypatch):
    """Every strategy implements both kinds; one that did not (its adapter's ``checkpoint_kinds``) is refused, by
    name."""
    from zeroexp.strategies.zero import Zero1Adapter

    monkeypatch.setattr(Zero1Adapter, "checkpoint_kinds", frozenset({"full"}))
    with pytest.raises(ConfigError, match="invalid config: checkpoint='sharded'.*strategy=zero1 does not implement it"):
        validate(compose("strategy=zero1", "checkpoint=sharded"))


def test_report_has_a_checkpoint_table(cell, tmp_path):
    import shutil

    from zeroexp.results.cells import order_cells
    from zeroexp.report.tables import build_tables
    from zeroexp.results.files import load_sweep

    for result in (_cell(cell, "fsdp_full", "full"), _cell(cell, "ddp", "full")):  # the two cells as one sweep
        shutil.copytree(result.cell_dir, tmp_path / Path(result.cell_dir).name)
    tables = {t.key: t for t in build_tables(order_cells(load_sweep(tmp_path)))}
    shown = tables["checkpoint"].display()
    rows = {(cell_label.split(" ")[0], kind): row for (cell_label, kind), (_, row)
            in zip(zip(shown["cell"], shown["kind"]), shown.iterrows())}
    assert (rows["fsdp_full-pre", "full"]["check"] == "PASS"
            and "AG" in rows["fsdp_full-pre", "full"]["save collectives"])
    assert rows["ddp", "full"]["save collectives"] == "none"


def test_save_and_load_peaks_as_planned(cell):
    """plan.checkpoint's peaks, the mlp at N=2 (P: its fp32 parameters; AdamW single-tensor on the CPU holds 3 x 4096
    elements of temporaries; a 4-byte step per parameter): a DDP full save copies nothing on the CPU, its full load
    reads the whole file beside the zero step (gradients, both moments, steps, temporaries); FSDP2's full save keeps
    every gathered tensor on rank 0 (parameters and both moments, no padding at N=2) and its full load the file, the
    rank's half of the parameters and the zero step's moments beside those made from the file; a sharded load the
    zero step alone (a lower bound: DCP's planning objects are not sized)."""
    temps, steps = 3 * 4096 * 4, 8 * 4
    want = {("ddp", "full"): ([0, 0], [STATE + 3 * P + steps + temps] * 2),
            ("ddp", "sharded"): ([0, 0], [3 * P + steps + temps] * 2),
            ("fsdp2_full", "full"): ([3 * P, 64 * 64 * 4], [STATE + P // 2 + 2 * P + steps] * 2),
            ("fsdp2_full", "sharded"): ([0, 0], [3 * P // 2 + steps + temps // 2] * 2)}
    for (strategy, kind), (save, load) in want.items():
        part = _cell(cell, strategy, kind).summary["plan"]["checkpoint"]
        peaks = part["peaks"]
        assert part["check"] == peaks["check"] == "PASS", (strategy, kind, peaks)
        assert (peaks["save"]["rank_bytes"], peaks["load"]["rank_bytes"]) == (save, load), (strategy, kind)
        assert peaks["load"]["measured_rank_bytes"] == load  # the zero step's peak above DCP's objects here
    assert peaks["load"]["exact"] == [False, False] and peaks["load"]["unsized"]
    from zeroexp.report.tables import _peaks_said  # the digest's words: a lower bound said as one

    assert f"load {load[0]:,} B above its start (planned >= {load[0]:,} B)" in _peaks_said(peaks)
    # FSDP1's full load: the file and the moments of the rank's half; its save at least the state on rank 0
    fsdp = _cell(cell, "fsdp_full", "full").summary["plan"]["checkpoint"]["peaks"]
    assert fsdp["check"] == "PASS" and fsdp["load"]["rank_bytes"] == fsdp["load"]["measured_rank_bytes"] == [
        STATE + P] * 2
    assert fsdp["save"]["exact"] == [False, False] and fsdp["save"]["rank_bytes"][0] == STATE
    # ZeroRedundancyOptimizer's sharded save copies nothing; its load the larger of the module's file and the
    # rank's optimizer file (4 of the 8 weights each: their moments and steps)
    zro = _cell(cell, "zro", "sharded").summary["plan"]["checkpoint"]["peaks"]
    assert zro["check"] == "PASS" and zro["save"]["measured_rank_bytes"] == [0, 0]
    assert zro["load"]["rank_bytes"] == zro["load"]["measured_rank_bytes"] == [max(P, STATE_OPTIM // 2)] * 2


@pytest.mark.parametrize("strategy, kind", [("ddp", "full"), ("zro", "sharded")])
def test_a_ddp_round_trip_at_three_ranks_continues_bit_identically(cell, strategy, kind):
    """At N=3 gloo's ring sums an element in a rank order that depends on its offset in DDP's bucket, and a freshly
    wrapped DDP buckets in parameter order until its first backward (then rebuilds in gradient-ready order): the
    adapter's ``settle_restored`` gives the restored model the trained one's layout before the compared step."""
    result = cell(f"strategy={strategy}", f"checkpoint={kind}", "world_size=3")
    assert result.status == "ok", result.error
    ck = result.summary["checkpoint"]
    assert ck["check"] == "PASS", ck["reasons"]
    assert ck["restored_bit_identical"] and ck["continuation_bit_identical"]


@pytest.mark.parametrize("kind", ["none", "full", "sharded"])
def test_every_checkpoint_option_composes_and_validates(compose, kind):
    cfg = compose(f"checkpoint={kind}", "strategy=fsdp_grad_op")
    validate(cfg)
    assert cfg.checkpoint.name == kind and cfg.checkpoint.keep is False and cfg.checkpoint.dir is None


def _ds_cell(cell, stage: int, kind: str):
    """The DeepSpeed cell at ZeRO ``stage`` with a kept ``kind`` checkpoint (N=2, fp32); skipped without DeepSpeed."""
    from zeroexp.strategies import deepspeed as ds_adapter

    if not ds_adapter.deepspeed_available():
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    result = cell("strategy=deepspeed", f"strategy.stage={stage}", f"checkpoint={kind}", "world_size=2",
                  "checkpoint.keep=true")
    assert result.status == "ok", result.error
    return result


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_round_trip_continues_bit_identically(cell, stage, kind):
    """DeepSpeed ZeRO 0-3 at N=2: full (consolidated fp32 master + Adam state on rank 0) and sharded (DeepSpeed's own
    engine.save_checkpoint) restore into a fresh engine and continue bit-identically (engine.backward/engine.step)."""
    from zeroexp.strategies.deepspeed import DS_FULL_FILE, DS_TAG

    result = _ds_cell(cell, stage, kind)
    ck = result.summary["checkpoint"]
    assert ck["check"] == "PASS", ck["reasons"]
    assert ck["restored_bit_identical"] and ck["continuation_bit_identical"]
    assert ck["continuation_max_abs_diff"] == 0.0 and ck["compared_tensors"] == 8
    written = ck["save"]["rank_bytes_written"]
    assert sum(written) == ck["save"]["bytes_written"] > 3 * P  # fp32 master and both Adam moments
    directory = Path(result.cell_dir) / "checkpoint"
    counts = ck["save"]["collectives"]["counts"]
    if kind == "full":  # one file on rank 0
        assert written[1] == 0 and ck["files"] == 1 and (directory / DS_FULL_FILE).is_file()
        if stage == 3:  # the partitions all-gathered
            assert counts.get("all_gather", 0) + counts.get("all_gather_into_tensor", 0) > 0
        elif stage in (1, 2):  # each rank's fragment all-reduced into a full buffer: master and 2 moments, 3P
            assert counts == {"all_reduce": 3 * 8} and ck["save"]["collectives"]["payload_bytes"]["all_reduce"] == 3 * P
        else:  # stage 0: everything is replicated, rank 0 reads its own copy
            assert counts == {}
    elif stage == 0:  # nothing partitioned: rank 0 alone writes the module and the torch optimizer's state_dict
        assert written[1] == 0 and not list(directory.rglob("zero_pp_rank_*"))
        assert (directory / DS_TAG / "mp_rank_00_model_states.pt").stat().st_size > 3 * P
    else:  # every rank writes its fp32 master and Adam partitions (3P / N), no gather
        assert all(w > 0 for w in written) and "all_gather" not in counts
        for rank in range(2):
            (optim,) = directory.rglob(f"zero_pp_rank_{rank}_*optim_states.pt")
            assert optim.stat().st_size > 3 * P // 2
    meta = json.loads((directory / META).read_text())
    assert meta["strategy"] == "deepspeed" and meta["world_size"] == 2
    # DeepSpeed's own files: stage 0 all on rank 0; 1-2 rank 0 the module (P) and each rank its fp32 partition, both
    # moments and one step (3P/2 + 4); 3 each rank its partitions (the module's parameters are empty there)
    own = 3 * P // 2 + 4
    _planned_exactly(result, [STATE, 0] if kind == "full" or stage == 0 else
                     [P + own, own] if stage < 3 else [own, own])
    assert {f["name"] for f in meta["files"]} == {f.relative_to(directory).as_posix() for f in directory.rglob("*")
                                                  if f.is_file() and f.name != META}  # every file DeepSpeed wrote


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_full_save_peaks_above_sharded(cell, stage):
    """Rank 0 holds the whole fp32 state during a full save (>= 3P: master and both moments; stage 3 all-gathers 3P),
    the sharded save (DeepSpeed's save_checkpoint) serializes what the rank already holds."""
    saves = {k: _ds_cell(cell, stage, k).summary["checkpoint"]["save"] for k in ("full", "sharded")}
    if stage == 3:
        assert saves["full"]["collectives"]["payload_bytes"]["all_gather"] == 3 * P
    assert "all_gather" not in saves["sharded"]["collectives"]["counts"]
    assert saves["full"]["rank0_peak_over_start_bytes"] >= 3 * P > saves["sharded"]["rank0_peak_over_start_bytes"]
