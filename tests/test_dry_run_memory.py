"""A traced dry run simulates the memory probe's phases (FakeTensorMode + MemTracker over fake storages) and shows
them beside the peak model's prediction (``simulated``, never the prediction)."""

from __future__ import annotations

import pytest

from zeroexp.formulas.peak.phases import PHASES
from zeroexp.results.verdict import Code

DRY = "dry_run=true"


@pytest.mark.parametrize("overrides", [("strategy=fsdp_full", "prefetch=pre"), ("strategy=fsdp_full", "prefetch=none"),
                                       ("strategy=fsdp_grad_op",), ("strategy=fsdp2_full",)],
                         ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_simulated_phases_beside_the_prediction_at_n8(cell, overrides):
    r = cell(*overrides, "world_size=8", DRY)
    assert r.status == "ok", r.error
    mem, plan = r.summary["memory"], r.summary["plan"]["memory"]
    assert mem["simulated"] is True and mem["source"].startswith("simulated")
    assert plan["check"] == "n/a" and plan["reason_codes"][0] == Code.MEMORY_SIMULATED
    # the fake process group makes no backend buffer: the model without gloo's copies is the simulation, exactly
    assert plan["simulated_check"] == "PASS", plan["reasons"]
    for ph in PHASES:
        rec = plan["phases"][ph]
        assert "measured_bytes" not in rec and "check" not in rec
        # exact but for 4-B scalars: up to two in forward; one in backward and the step, which Lightning's loop
        # keeps beyond the bare step the peak model traces (a real run's measured phases show the same 4 B)
        assert 0 <= rec["simulated_bytes"] - rec["predicted_bytes"] <= (8 if ph == "forward" else 4), (ph, rec)
        assert rec["simulated_check"] == "PASS"


def test_a_derived_dry_run_simulates_nothing(cell):
    r = cell("strategy=ddp", "world_size=8", DRY)
    assert r.status == "ok", r.error
    assert "memory" not in r.summary and "memory" in r.summary["dry_run"]["absent"]
    plan = r.summary["plan"]["memory"]
    assert plan["check"] == "n/a" and "simulated_check" not in plan and plan["phases"]["forward"]["predicted_bytes"]
