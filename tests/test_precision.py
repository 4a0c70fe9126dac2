"""precision (fp32 | bf16 | fp16) and offload (none | optimizer | full) as axes of every strategy, on 2 CPU ranks.

DDP and ZeroRedundancyOptimizer: autocast (fp32 state, low-precision matmuls); FSDP: ``MixedPrecision`` (fp32
shards, low-precision gathers and reduce_scatters); fp16 always with a dynamic loss scaler. zero1/zero2's own
mixed precision is tested in test_zero.py, DeepSpeed's in test_deepspeed.py.
"""

from __future__ import annotations

import pytest

from zeroexp.config.schemas import ConfigError, NotApplicableHere, validate
from zeroexp.probes.equivalence import THRESHOLDS

N2 = ("world_size=2",)


@pytest.mark.parametrize("strategy,precision", [("ddp", "bf16"), ("ddp", "fp16"), ("zro", "bf16"),
                                                ("fsdp_full", "bf16"), ("fsdp_grad_op", "fp16"),
                                                ("fsdp2_full", "fp16")])
def test_mixed_precision_cell_trains_with_fp32_state_and_its_threshold(cell, strategy, precision):
    res = cell(*N2, f"strategy={strategy}", f"precision={precision}")
    assert res.status == "ok", res.error
    s = res.summary
    st = s["state"]
    assert st["check"] == "PASS", st["reasons"]
    # Autocast and FSDP MixedPrecision keep the state at rest in fp32 (the fp32 parameters / shards are the master).
    assert {st["dtypes"][k] for k in ("param", "grad", "optim")} == {"float32"}
    if precision == "fp16":
        assert st["loss_scale"] is not None and st["loss_scale"] > 0
    else:
        assert st["loss_scale"] is None
    eq = s["equivalence"]
    assert eq["threshold"] == THRESHOLDS[precision] and eq["check"] == "PASS", eq
    co = s["collectives"]
    assert co["check"] == "PASS", co["reasons"]  # the expected payload is in the dtype that travels
    plan = s["plan"]  # the planner's rows cover the precision: bytes at rest and on the wire, per rank
    assert (plan["check"], plan["payload_check"]) == ("PASS", "PASS"), (plan["reasons"], plan.get("payload"))
    if strategy.startswith("fsdp"):  # FSDP gathers and reduce-scatters in the low precision: half the fp32 bytes
        low = "bfloat16" if precision == "bf16" else "float16"
        assert co["dtypes"]["all_gather"] == co["dtypes"]["reduce_scatter"] == low
        fp32 = cell(*N2, f"strategy={strategy}").summary["collectives"]["payload_bytes"]
        assert {op: co["payload_bytes"][op] * 2 for op in ("all_gather", "reduce_scatter")} == \
               {op: fp32[op] for op in ("all_gather", "reduce_scatter")}
        # fp16: the loss scaler's found_inf flag, all-reduced (fp32, 4 bytes) once by ShardedGradScaler and, for
        # FSDP2's DTensor gradients, once more by DTensor's inf check; no all_reduce without a scaler
        syncs = {"fp16": 2 if strategy.startswith("fsdp2") else 1}.get(precision, 0)
        assert co["counts"].get("all_reduce", 0) == syncs and co["payload_bytes"].get("all_reduce", 0) == 4 * syncs


def test_fsdp_offload_is_refused_on_a_cpu_only_machine(compose):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: FSDP CPU offload runs here")
    with pytest.raises(NotApplicableHere, match="nowhere to offload"):
        validate(compose(*N2, "strategy=fsdp_full", "offload=full"))
    with pytest.raises(ConfigError, match="strategy=fsdp_full does not implement it"):
        validate(compose(*N2, "strategy=fsdp_full", "offload=optimizer"))
    with pytest.raises(ConfigError, match="offload"):
        validate(compose(*N2, "strategy=ddp", "offload=full"))
    for strategy in ("fsdp2_full", "fsdp2_grad_op"):  # CPUOffloadPolicy pins host memory: no accelerator here
        with pytest.raises(NotApplicableHere, match="Cannot access accelerator device") as e:
            validate(compose(*N2, f"strategy={strategy}", "offload=full"))
        assert e.value.key == "offload"
    with pytest.raises(ConfigError, match="strategy=fsdp2_full does not implement it"):
        validate(compose(*N2, "strategy=fsdp2_full", "offload=optimizer"))
