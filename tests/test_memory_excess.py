"""Memory above the plan, explained (zeroexp.plan.check.memory_excess): a plan.memory FAIL made on purpose (a copy of
a module's input kept alive by a hook; an upcast copy) is broken down at the peak to the module and the op that
allocated it, on our mlp under DDP and on a Hugging Face Llama under FSDP2 at N=3."""

from __future__ import annotations

import pytest

from conftest import HF_LLAMA, STEPS, WINDOWS, PROBED
from zeroexp.launch.runner import run_cell
from zeroexp.plan.check.memory_excess import explain_excess
from zeroexp.rank.faults import ENV as FAULT_ENV

MEMORY_STEP = PROBED - 1  # the memory-tracked step of conftest's windows


def test_the_residual_is_the_groups_made_least_often_up_to_the_excess():
    record = {"predicted_by_category": {"activations": 6000, "gradients": 100},
              "measured_by_category": {"activations": 8048, "gradients": 100}}
    born = {"by_module": {}, "groups": [
        {"category": "activations", "op": "aten::mm", "module": "0", "count": 3, "bytes": 6000},
        {"category": "activations", "op": "aten::clone", "module": "2", "count": 1, "bytes": 2048},
        {"category": "gradients", "op": "aten::mm", "module": "1 (backward)", "count": 1, "bytes": 100}]}
    told = explain_excess(record, born)
    assert told["excess_by_category"] == {"activations": 2048}
    assert [(g["op"], g["module"], g["cause"]) for g in told["residual"]] == [("aten::clone", "2", "copy")]
    assert explain_excess(record, None) is None  # no storages recorded (CUDA): nothing to break down


@pytest.mark.parametrize("kind, overrides, module, op, grew, cause", [
    ("hold", ("strategy=ddp", "world_size=2"), "0", "aten::clone", 8 * 64 * 4, "copy"),  # the batch into Linear 0
    # the embeddings into the first RMSNorm, as float64: 64 KiB, beyond the band and one late-freed unit (12.9 KB)
    ("upcast", ("strategy=fsdp2_full", "world_size=3", *(o for o in HF_LLAMA if not o.startswith("model.seq_len")),
                "batch_size=16", "model.seq_len=16"),
     "model.layers.0.input_layernorm", "aten::_to_copy", 16 * 16 * 32 * 8, "upcast"),
], ids=["mlp-ddp-hold", "llama-fsdp2-n3-upcast"])
def test_a_plan_memory_fail_made_on_purpose_is_explained_to_the_module_and_op(compose, tmp_path, monkeypatch, kind,
                                                                             overrides, module, op, grew, cause):
    monkeypatch.setenv(FAULT_ENV, f"0:{MEMORY_STEP}:{kind}")
    hf = any(o.startswith("model=") for o in overrides)
    cfg = compose(*overrides, base=("logger=none", f"steps={STEPS}", *WINDOWS)) if hf else compose(*overrides)
    r = run_cell(cfg, tmp_path / kind)
    assert r.status == "ok", r.error
    memory = r.summary["plan"]["memory"]
    assert memory["check"] == "FAIL" and memory["reason_codes"][0] == "memory.phase_differs", memory["reasons"]
    rank0 = memory["ranks"][0]
    assert rank0["check"] == "FAIL" and all(x["check"] == "PASS" for x in memory["ranks"][1:])  # every rank judged
    # the phases it FAILed (forward; or, where one late-freed unit's allowance covers the forward, the optimizer's
    # start, before the hook lets the copy go): each explained down to the copy, its module and its op
    failed = [ph for ph in ("forward", "backward", "optimizer") if rank0[ph]["check"] == "FAIL"]
    assert failed and all("explained" in rank0[ph] for ph in failed), rank0
    for ph in failed:
        first = rank0[ph]["explained"]["residual"][0]
        assert (first["module"], first["op"], first["count"], first["bytes"], first["cause"]) == (module, op, 1, grew,
                                                                                                cause), rank0[ph]
        assert rank0[ph]["explained"]["excess_by_category"]["activations"] >= grew
    from zeroexp.report.compare import read_cell  # python -m zeroexp.explain CELL shows the highest peak's makers
    from zeroexp.report.explain_cell import explain_cell

    peak = explain_cell(read_cell(r.cell_dir))["memory_at_peak"]
    m = r.summary["memory"]
    assert peak == {"rank": m["max_rank"], "phase": m["peak_phase_of_max_rank"],
                    **m["born_at_peak_by_rank"][m["max_rank"]][m["peak_phase_of_max_rank"]]}
