"""The planner's strategy knobs (:class:`~zeroexp.formulas.PlanKnobs`) from a plan or recommend config's flat keys,
each validated as a cell's strategy key is (``zeroexp.cell.strategy``), naming the plan's key."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from zeroexp.cell.strategy import check_ds_overlap_comm, check_ds_stage3_limits
from zeroexp.errors import ConfigError
from zeroexp.formulas import LAYOUTS

__all__ = ["fsdp2_knobs", "ds_knobs"]


def fsdp2_knobs(cfg: DictConfig, world_sizes: list[int]) -> dict[str, Any]:
    """The FSDP2 rows' knobs (PlanKnobs), validated as a cell's: ``reshard_after_forward`` true, null or an int k
    dividing every world size (an int equal to world_size is true, as FSDP2 takes it), ``reshard_policy``
    (torchtitan's, with ``reshard_after_forward`` true; with ``strategy=``, as that strategy accepts it),
    ``forward_prefetch``, ``backward_prefetch``, ``reduce_dtype``."""
    from zeroexp.cell.resolved import post_forward_ranks
    from zeroexp.cell.strategy import check_fsdp2_prefetch, check_fsdp2_reshard, check_reshard_policy

    check_fsdp2_reshard(cfg.reshard_after_forward, world_sizes, key="reshard_after_forward")
    policy, row = cfg.get("reshard_policy"), LAYOUTS.get(str(cfg.strategy.layout)) if cfg.get("strategy") else None
    check_reshard_policy(policy, str(cfg.strategy.name) if row else "fsdp2_full",
                         reshards=row.reshard_after_forward if row else True,
                         reshard_after_forward=cfg.reshard_after_forward, prefix="")
    check_fsdp2_prefetch(cfg.forward_prefetch, cfg.backward_prefetch, prefix="")
    if cfg.reduce_dtype not in (None, "float32", cfg.precision.param_dtype):
        raise ConfigError("reduce_dtype", cfg.reduce_dtype, "null, float32 or precision.param_dtype",
                          why="as a cell's strategy.reduce_dtype: no reduction below the compute dtype")
    return {"root_kept_after_forward": cfg.reshard_after_forward is None or policy in ("default", "never"),
            "reshard_policy": str(policy or ""),
            "post_forward_ranks": post_forward_ranks(cfg.reshard_after_forward),
            "forward_prefetch": int(cfg.forward_prefetch), "backward_prefetch": int(cfg.backward_prefetch or 0),
            "reduce_dtype": str(cfg.reduce_dtype or "")}


def ds_knobs(cfg: DictConfig) -> dict[str, Any]:
    """The deepspeed_stage3 row's coordinator limits and the stage 2-3 rows' ``overlap_comm`` (PlanKnobs), validated as
    a cell's."""
    check_ds_stage3_limits(cfg, None, prefix="")
    strategy = cfg.get("strategy")  # strategy=deepspeed: its stage refuses it as a cell's does
    stage = int(strategy.stage) if strategy is not None and strategy.get("stage") is not None else None
    check_ds_overlap_comm(cfg.overlap_comm, stage, key="overlap_comm")
    return {"ds_prefetch_bucket": cfg.stage3_prefetch_bucket_size, "ds_max_live": cfg.stage3_max_live_parameters,
            "ds_persistence": cfg.stage3_param_persistence_threshold, "ds_max_reuse": cfg.stage3_max_reuse_distance,
            "overlap_comm": bool(cfg.overlap_comm)}
