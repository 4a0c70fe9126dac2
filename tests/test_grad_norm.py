"""Every rank's total gradient norm of every step against the reference's (zeroexp.probes.grad_norm): the norm each
strategy takes on its own layout and group, hybrid meshes with clipping; the judgement on every rank, a norm reduced
over a group twice too large named. Cells without clipping, DeepSpeed's engine norm, frozen parameters and the
hybrids without clipping are asserted where their cells run (test_axes, test_hybrid, test_divergence,
test_ds_stage0)."""

from __future__ import annotations

import pytest

from conftest import PROBED, STEPS
from zeroexp.probes.divergence import relative_bound
from zeroexp.probes.grad_norm import judge_norms

N, S, CLIP = 4, 2, 1e-4  # CLIP: below the mlp's gradient norms, every step clipped


def _results(norms_by_rank: list[dict[int, float]], reference: list[float], floors: list[float]) -> list[dict]:
    out = [{"norms": {str(k): v for k, v in n.items()}, "source": "strategy", "why_none": None, "reference": {}}
           for n in norms_by_rank]
    out[0]["reference"] = {"numel": 2, "norms": reference, "floor_norms": floors, "dtype": "float32"}
    return out


def test_every_rank_and_step_is_judged_within_the_floor():
    ref = [1.0, 0.5, 0.25]
    floors = [1.0, 0.5 * (1 + 1e-6), 0.25]  # the floor of step 1: 1e-6 relative, its bound 1e-5
    ok = judge_norms(_results([{s: r for s, r in enumerate(ref)}] * 3, ref, floors))
    assert (ok["check"], ok["compared"], ok["ranks"], ok["steps"]) == ("PASS", 9, [0, 1, 2], [0, 1, 2])
    assert relative_bound(1e-6, "float32") == pytest.approx(1e-5)
    inside = _results([{1: 0.5 * (1 + 9e-6)}], ref, floors)  # within 10 x the floor of its step
    assert judge_norms(inside)["check"] == "PASS"
    wrong = [{s: r for s, r in enumerate(ref)}, {0: 1.0, 1: 0.5 * 2 ** 0.5, 2: 0.25}]  # rank 1, step 1: sqrt(2) off
    bad = judge_norms(_results(wrong, ref, floors))
    assert (bad["check"], bad["reason_codes"], bad["failed"]) == ("FAIL", ["grad_norm.differs"], 1)
    assert (bad["first_failed"]["rank"], bad["first_failed"]["step"]) == (1, 1)
    assert bad["squares_counted"] == pytest.approx(2.0)


def test_a_rank_without_a_norm_or_a_nan_norm_fails_unless_the_loss_scaler_skipped_the_step():
    ref, floors = [1.0, 0.5], [1.0, 0.5]
    lost = judge_norms(_results([{0: 1.0, 1: 0.5}, {0: 1.0}], ref, floors))  # rank 1 has no norm at step 1
    assert (lost["check"], lost["reason_codes"]) == ("FAIL", ["grad_norm.missing"])
    nan = judge_norms(_results([{0: 1.0, 1: float("nan")}] * 2, ref, floors))
    assert (nan["check"], nan["reason_codes"], nan["failed"]) == ("FAIL", ["grad_norm.differs"], 2)
    scaled = _results([{0: 1.0, 1: float("inf")}] * 2, ref, floors)
    scaled[0]["reference"]["loss_scaling"] = True  # fp16: the scaler skips a step whose norm overflowed
    skipped = judge_norms(scaled)
    assert (skipped["check"], skipped["skipped_nonfinite"], skipped["steps"]) == ("PASS", 2, [0])


def test_no_norm_taken_is_na_with_its_reason():
    out = judge_norms([{"norms": {}, "source": None, "why_none": "reduced inside its step", "reference": {}}] * 2)
    assert (out["check"], out["reason_codes"], out["reasons"]) == ("n/a", ["grad_norm.not_taken"],
                                                                  ["reduced inside its step"])


@pytest.mark.parametrize("strategy", ["fsdp_hybrid", "fsdp2_hybrid"])
def test_a_hybrid_mesh_that_clips_takes_the_reference_norm_on_every_rank(cell, strategy):
    """HSDP 2 x 2: FSDP1's clip_grad_norm_ all-reduces over the root's shard group, FSDP2's full_tensor() over the
    mesh's shard dimension; replicas hold equal gradients, so neither counts a square twice."""
    r = cell(f"strategy={strategy}", f"world_size={N}", f"strategy.shard_size={S}", f"strategy.clip_grad_norm={CLIP}")
    assert r.status == "ok", r.error
    g = r.summary["grad_norm"]
    assert (g["check"], g["source"], g["ranks"]) == ("PASS", "strategy", list(range(N))), g
    # every step but the memory-tracked one (PROBED - 1), where the strategy keeps no norm: it would count there
    assert g["steps"] == [s for s in range(STEPS) if s != PROBED - 1] and g["compared"] == N * (STEPS - 1)
    assert r.summary["equivalence"]["check"] == "PASS"
    # the plan's reduction of the norm (the collectives model with clipping less without): one all_reduce over the
    # shard group, the only call there, as the collectives probe measured it
    planned = r.summary["plan"]["grad_norm"]["collectives"]
    assert set(planned) == {"all_reduce"} and set(planned["all_reduce"]["groups"]) == {"shard"}
    assert planned["all_reduce"]["groups"]["shard"] == r.summary["collectives"]["groups"]["all_reduce"]["shard"]
