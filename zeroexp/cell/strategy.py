"""Every strategy's config schema (``strategy.*``), by strategy name: :data:`SCHEMAS`.

Torch-free on purpose: composing a cell (``python -m zeroexp --help``, a refused override) registers these with Hydra
and needs none of the adapters (zeroexp.strategies.<family>), whose imports bring torch, Lightning and DeepSpeed.
Each adapter names its schema (``StrategyAdapter.schema``, its entry here); its conf/strategy/<name>.yaml extends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, List, Optional

from omegaconf import MISSING

from zeroexp.errors import ConfigError, NotApplicableHere

__all__ = ["SCHEMAS", "BUCKET_CAP_MB", "StrategyConfig", "schema_keys", "identity_keys", "identity_when_set",
           "check_fsdp2_prefetch", "check_fsdp2_dtype",
           "DS_STAGE3_KEYS", "check_ds_stage3_limits", "RESHARD_POLICIES", "check_reshard_policy"]


#: The bucket cap every bucketed strategy defaults to (``strategy.bucket_cap_mb``, MiB): DDP's own default
#: (torch.nn.parallel.DistributedDataParallel, ``bucket_cap_mb=25``), kept for ZeroRedundancyOptimizer's DDP, zeroexp's
#: ZeRO buckets and DeepSpeed's reduce / all-gather buckets so that their cells compare bucket for bucket.
BUCKET_CAP_MB = 25.0


@dataclass
class StrategyConfig:
    """What every strategy's config (``strategy.*``) holds; each adapter's ``schema`` extends it with its own keys.

    A field whose metadata says ``identity: False`` is derived from the others and not part of the cell's identity
    (zeroexp.cell.identity): adding such a field leaves every cell id as it was; ``identity: "when_set"`` enters it only
    when not at its default (so a knob added to every strategy leaves the ids of the cells that do not set it as
    they were).
    """

    #: The optional cell axes that apply to the strategy and name its cells (not a key): a top-level config group
    #: (``{"prefetch"}``: ``prefetch=post``) or one of the schema's own keys (``{"stage"}``: ``strategy.stage``).
    axes: ClassVar[frozenset[str]] = frozenset()

    name: str = MISSING
    #: The expectation-model row the strategy follows (set in its conf/strategy/*.yaml; deepspeed's follows its stage).
    layout: str = field(default=MISSING, metadata={"identity": False})
    #: Global-norm gradient clipping, the max norm (null: none): :meth:`StrategyAdapter.clip_gradients`.
    clip_grad_norm: Optional[float] = field(default=None, metadata={"identity": "when_set"})


def schema_keys(schema: type) -> tuple[str, ...]:
    """The keys of a strategy schema (``strategy.<key>``), in definition order."""
    return tuple(f.name for f in fields(schema))


def identity_keys(schema: type) -> tuple[str, ...]:
    """The keys of a strategy schema that are part of a cell's identity (all but derived ones such as ``layout``)."""
    return tuple(f.name for f in fields(schema) if f.metadata.get("identity", True))


def identity_when_set(schema: type) -> dict[str, Any]:
    """The keys of a strategy schema that enter a cell's identity only when set to other than their default
    (``clip_grad_norm``, ``sync_each_microbatch``), with that default."""
    return {f.name: f.default for f in fields(schema) if f.metadata.get("identity", True) == "when_set"}


@dataclass
class DDPConfig(StrategyConfig):
    """``strategy=ddp`` (conf/strategy/ddp.yaml)."""

    # Set explicitly, DDP also uses it as the first bucket's cap (otherwise 1 MiB), so buckets are even.
    bucket_cap_mb: float = BUCKET_CAP_MB
    gradient_as_bucket_view: bool = False
    #: DDP's ``find_unused_parameters``; null: set when one meta-device step of the model leaves a trainable
    #: parameter without a gradient (zeroexp.models.unused_parameters), as DDP requires then.
    find_unused_parameters: Optional[bool] = field(default=None, metadata={"identity": "when_set"})


@dataclass
class ZROConfig(DDPConfig):
    """``strategy=zro`` (conf/strategy/zro.yaml): DDP's keys and ZeroRedundancyOptimizer's."""

    # False: one broadcast per parameter after the step (the reference experiment's fingerprint).
    parameters_as_bucket_view: bool = False


@dataclass
class FSDPConfig(StrategyConfig):
    """``strategy=fsdp_grad_op`` (FSDP1; also the keys of every FSDP1 strategy)."""

    sharding: str = MISSING  # FULL_SHARD | SHARD_GRAD_OP
    # Module classes wrapped as their own FSDP unit (import paths); the root unit holds the rest.
    # null: the model's own unit (model.wrap: Linear for mlp, Block for gpt); [] wraps the model as one unit.
    wrap: Optional[List[str]] = None
    # True as the seed's runs and Lightning's FSDPStrategy (lightning/fabric/strategies/fsdp.py) set it: the optimizer
    # steps the original parameters' views; frozen and trainable parameters may share a unit; torch.compile needs it
    use_orig_params: bool = True
    limit_all_gathers: bool = True
    forward_prefetch: bool = False
    #: grad_accum > 1: reduce-scatter every micro-batch (sharded gradients accumulate) instead of ``no_sync``
    #: (unsharded gradients held until the K-th); in the cell's identity only when true.
    sync_each_microbatch: bool = field(default=False, metadata={"identity": "when_set"})


@dataclass
class FSDPFullConfig(FSDPConfig):
    """``strategy=fsdp_full`` (FSDP1 FULL_SHARD): FSDP1's keys; ``prefetch`` (backward prefetch) names its cells."""

    axes: ClassVar[frozenset[str]] = frozenset({"prefetch"})


@dataclass
class FSDPHybridConfig(FSDPConfig):
    """``strategy=fsdp_hybrid``: ``sharding`` HYBRID_SHARD or _HYBRID_SHARD_ZERO2, ``shard_size`` ranks per group."""

    axes: ClassVar[frozenset[str]] = frozenset({"prefetch", "sharding", "shard_size"})  # fsdp_hybrid-pre-shard_size2-..

    shard_size: int = MISSING


@dataclass
class FSDP2Config(StrategyConfig):
    """``strategy=fsdp2_full`` / ``fsdp2_grad_op``; ``reshard_after_forward`` is fixed by the strategy."""

    # Module classes given their own fully_shard unit (import paths), as for FSDP1; the root takes the rest.
    wrap: Optional[List[str]] = None
    #: grad_accum > 1: reduce-scatter every micro-batch instead of ``set_requires_gradient_sync(False)``
    #: (unsharded gradients held until the K-th); in the cell's identity only when true.
    sync_each_microbatch: bool = field(default=False, metadata={"identity": "when_set"})
    #: Explicit forward prefetch: each wrapped unit's pre-forward issues the all-gathers of the next this many units
    #: (``set_modules_to_forward_prefetch``); 0: none, FSDP2's default. In the cell's identity only when set.
    forward_prefetch: int = field(default=0, metadata={"identity": "when_set"})
    #: Explicit backward prefetch: each wrapped unit's pre-backward issues the all-gathers of the previous this many
    #: units (``set_modules_to_backward_prefetch``); null: FSDP2's implicit one unit. In the identity only when set.
    backward_prefetch: Optional[int] = field(default=None, metadata={"identity": "when_set"})
    #: ``MixedPrecisionPolicy(reduce_dtype=)``: the dtype gradients are reduce-scattered in (float32, bfloat16,
    #: float16); null: the compute dtype (precision.param_dtype), FSDP2's default. In the identity only when set.
    reduce_dtype: Optional[str] = field(default=None, metadata={"identity": "when_set"})
    #: ``MixedPrecisionPolicy(output_dtype=)`` of the root: the dtype the model's forward outputs are cast to (the
    #: loss computed in it); null: none. In the identity only when set.
    output_dtype: Optional[str] = field(default=None, metadata={"identity": "when_set"})
    #: torchtitan's ``reshard_after_forward`` policy per unit (:data:`RESHARD_POLICIES`); null: the strategy's own
    #: ``reshard_after_forward`` on every unit and the root. In the identity only when set.
    reshard_policy: Optional[str] = field(default=None, metadata={"identity": "when_set"})


#: torchtitan's reshard policies (torchtitan/distributed, ``apply_fsdp``'s ``reshard_after_forward_policy``), as each
#: ``fully_shard`` call gets its ``reshard_after_forward``: ``always`` True for every unit and the root; ``default``
#: True for every unit but the last (the last transformer block, which backward needs first: kept), the root None
#: (FSDP2's default: the root kept unsharded from its forward to its backward); ``never`` False for all.
RESHARD_POLICIES = ("always", "default", "never")


def check_reshard_policy(policy: Any, strategy: str, reshards: bool = True, reshard_after_forward: Any = True,
                         prefix: str = "strategy.") -> None:
    """Refuse a ``reshard_policy`` (a cell's ``strategy.reshard_policy``, the planner's ``reshard_policy`` with
    ``prefix`` "") that is not null or one of :data:`RESHARD_POLICIES`, one beside a ``reshard_after_forward`` other
    than its default (true: the policy sets it per unit), and under a ``strategy`` that never ``reshards`` after
    forward (``fsdp2_grad_op``) any but ``never`` (what it does)."""
    key = f"{prefix}reshard_policy"
    if policy is None:
        return
    if policy not in RESHARD_POLICIES:
        raise ConfigError(key, policy, "null (the strategy's reshard_after_forward on every unit), "
                          + ", ".join(RESHARD_POLICIES) + " (torchtitan's reshard_after_forward policies)")
    if reshard_after_forward is not True:
        shown = "null" if reshard_after_forward is None else str(reshard_after_forward).lower()
        raise ConfigError(key, policy, f"null with {prefix}reshard_after_forward={shown}, or "
                          f"{prefix}reshard_after_forward=true (its default) with a policy",
                          why=f"both {key} and {prefix}reshard_after_forward set: the policy sets "
                              "reshard_after_forward for each unit itself")
    if not reshards and policy != "never":
        raise ConfigError(key, policy, f"null or never under strategy={strategy}",
                          why=f"{strategy} keeps every unit unsharded from forward to backward (never); a policy "
                              "that reshards is strategy=fsdp2_full's")


def check_fsdp2_prefetch(forward: Any, backward: Any, prefix: str = "strategy.") -> None:
    """Refuse FSDP2's explicit prefetch out of range (a cell's ``strategy.forward_prefetch`` / ``backward_prefetch``,
    the planner's keys of the same names, ``prefix`` ""): forward an integer >= 0, backward null or one >= 1."""
    if isinstance(forward, bool) or not isinstance(forward, int) or forward < 0:
        raise ConfigError(f"{prefix}forward_prefetch", forward, "an integer >= 0: the wrapped units each unit's "
                          "pre-forward all-gathers ahead (0: none, FSDP2's default)")
    if backward is not None and (isinstance(backward, bool) or not isinstance(backward, int) or backward < 1):
        raise ConfigError(f"{prefix}backward_prefetch", backward, "null (FSDP2's implicit prefetch of one unit) or "
                          "an integer >= 1: the wrapped units each unit's pre-backward all-gathers ahead",
                          why="an empty list leaves FSDP2's implicit prefetch on" if backward == 0 else "")


#: DeepSpeed stage 3's coordinator limits (``strategy.<key>``; the planner's keys of the same names).
DS_STAGE3_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold",
                  "stage3_max_reuse_distance")


def check_ds_stage3_limits(values: Any, stage: int | None, prefix: str = "strategy.") -> None:
    """Refuse DeepSpeed's stage-3 limits (``values``: a mapping holding :data:`DS_STAGE3_KEYS`) that are not null or an
    integer >= 0 (DeepSpeed's own bound: runtime/zero/config.py, ``ge=0``), or set under ``stage`` 0-2 (None: the
    planner, whose stage-3 row alone reads them)."""
    for key in DS_STAGE3_KEYS:
        v = values.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{prefix}{key}", v, "null (the default) or an integer >= 0 (parameter elements)")
        if stage is not None and stage != 3:
            raise ConfigError(f"{prefix}{key}", v, "null below stage 3, or strategy.stage=3",
                              why=f"stage 3's parameter coordinator alone reads it (strategy.stage={stage})")


#: Why ``overlap_comm`` is refused at stage 1 (DeepSpeed 0.19, stage_1_and_2.py): its gradient hooks then reduce at
#: the accumulation boundary (``reduce_ready_partitions_and_remove_grads``: stage 2's path, buckets in backward order)
#: where stage 1 otherwise reduces after backward in parameter order; zeroexp's stage-1 model follows the latter.
DS_OVERLAP_STAGE1 = ("DeepSpeed then reduces stage 1's gradients in its backward hooks, in backward order (stage 2's "
                     "path, stage_1_and_2.py reduce_ready_partitions_and_remove_grads), which zeroexp's stage-1 model "
                     "does not follow; stage 2 and 3 with overlap_comm are modelled")


def check_ds_overlap_comm(value: Any, stage: int | None, key: str = "strategy.overlap_comm") -> None:
    """Refuse DeepSpeed's ``overlap_comm`` (``key``) that is not a bool, or true below stage 2 (stage 0: the engine's
    all-reduce after backward has no side stream, ``overlap_comm`` is the ZeRO optimizer's; stage 1:
    :data:`DS_OVERLAP_STAGE1`). ``stage`` None: the planner, whose stage 2-3 rows alone read it."""
    if not isinstance(value, bool):
        raise ConfigError(key, value, "true or false (DeepSpeed's zero_optimization.overlap_comm)")
    if value and stage is not None and stage < 2:
        why = (DS_OVERLAP_STAGE1 if stage == 1 else
               "stage 0's engine all-reduces after backward (buffered_allreduce_fallback): overlap_comm is the ZeRO "
               "optimizer's, stages 1-3")
        raise ConfigError(key, value, "false below stage 2, or strategy.stage=2 or 3", why=why)


def check_ds_cell(strategy: Any, world_size: int, row: Any) -> None:
    """A DeepSpeed cell's own keys (:func:`check_ds_stage3_limits`, :func:`check_ds_overlap_comm`) and its ranks:
    fewer than its row's ``min_world_size`` (2 at stage 3) are refused as not applicable here, for the reason its
    family gives (``Family.below_min_world``)."""
    check_ds_stage3_limits(strategy, strategy.stage)
    check_ds_overlap_comm(strategy.overlap_comm, int(strategy.stage))
    if world_size < row.min_world_size:
        raise NotApplicableHere("world_size", world_size, f"an integer >= {row.min_world_size} at strategy.stage="
                                f"{strategy.stage}, or strategy.stage=0, 1 or 2",
                                why=f"{row.family.below_min_world(row)}; stages 0-2 run one rank (ZeRO-Offload's "
                                    "single device: strategy.stage=2 offload=optimizer); a sweep skips this job")


def check_fsdp2_reshard(value: Any, world_sizes: list[int], key: str = "strategy.reshard_after_forward") -> None:
    """Refuse an ``fsdp2_full`` ``reshard_after_forward`` (a cell's ``key``, the planner's ``reshard_after_forward``
    over its world sizes) that is none of true, null or an int k dividing each world size with 1 < k: the ranks each
    unit is resharded to after forward (k = world_size: FSDP2 takes it as true)."""
    an_int = isinstance(value, int) and not isinstance(value, bool)
    if value is None or value is True or an_int and all(1 < value <= n and n % value == 0 for n in world_sizes):
        return
    sizes = ", ".join(map(str, world_sizes))
    accepted = (f"true, null (FSDP2's default: the root kept unsharded from forward to backward), an int k > 1 "
                f"dividing world_size={sizes} (each unit resharded to k ranks after forward; world_size: true)")
    if value is False or an_int and value == 1:
        why = ("False keeps every unit unsharded from forward to backward: that is fsdp2_grad_op"
               + ("" if value is False else "; FSDP2 takes the int 1 as False (_get_post_forward_mesh_info)"))
    else:
        why = f"an int is the ranks a unit is resharded to after forward: a divisor of world_size={sizes}"
    raise ConfigError(key, value, accepted, why=why)


#: The dtypes FSDP2's MixedPrecisionPolicy may reduce in or cast outputs to (gloo reduces each).
FSDP2_DTYPES = ("float32", "bfloat16", "float16")


def check_fsdp2_dtype(key: str, value: Any) -> None:
    """Refuse a ``reduce_dtype`` / ``output_dtype`` (``key``, its full name) that is no float dtype FSDP2 casts to."""
    if value is not None and value not in FSDP2_DTYPES:
        raise ConfigError(key, value, f"null, {', '.join(FSDP2_DTYPES)}")


@dataclass
class FSDP2FullConfig(FSDP2Config):
    """``strategy=fsdp2_full``: ``reshard_after_forward`` true (every unit, the root included, resharded after its
    forward: all-gathered again in backward), null (FSDP2's own default: the root kept unsharded from its forward
    to its backward, the other units resharded) or an int k dividing world_size, the ranks a unit is resharded to
    after forward (ZeRO++'s hpZ in FSDP2: each rank keeps 1/k of the unit until backward all-gathers it from those k
    ranks; world_size itself FSDP2 takes as true). False (and 1, which FSDP2 takes as false) is
    ``strategy=fsdp2_grad_op``; any other value is refused before launch (:func:`check_fsdp2_reshard`)."""

    reshard_after_forward: Any = field(default=True, metadata={"identity": "when_set"})


@dataclass
class FSDP2HybridConfig(FSDP2Config):
    """``strategy=fsdp2_hybrid``: ``shard_size`` ranks per shard group (required, divides world_size)."""

    axes: ClassVar[frozenset[str]] = frozenset({"shard_size"})  # the cell's name: fsdp2_hybrid-shard_size2_...

    shard_size: int = MISSING


@dataclass
class ZeroConfig(StrategyConfig):
    """``strategy=zero1`` / ``zero2``: zeroexp's own ZeRO-1 / ZeRO-2 (``zeroexp.strategies.sharding``)."""

    # Flat buckets, in compute-dtype bytes of parameters: one reduce_scatter and one all_gather each per step.
    bucket_cap_mb: float = BUCKET_CAP_MB
    reduce: str = "reduce_scatter"  # reduce_scatter | allreduce (the naive ZeRO: all_reduce, keep the shard)
    # Global-norm clipping inside ShardedAdamW.step; redeclared without ``when_set``: zero1/zero2 had the key in their
    # identity before every strategy did, so their cell ids stay as they were.
    clip_grad_norm: Optional[float] = None


@dataclass
class DeepSpeedConfig(StrategyConfig):
    """``strategy=deepspeed``: DeepSpeed ZeRO through ``deepspeed.initialize``; an optional extra."""

    axes: ClassVar[frozenset[str]] = frozenset({"stage"})  # strategy.stage names the cell: deepspeed-stage2_...

    stage: int = 2  # ZeRO stage 0 | 1 | 2 | 3 (a cell axis)
    bucket_cap_mb: float = BUCKET_CAP_MB  # reduce_bucket_size and allgather_bucket_size, in MiB of fp32 elements
    #: ZeRO++ hpZ (``zero_hpz_partition_size``): refused when above 1 (DeepSpeedAdapter.validate says why), so it
    #: never changes a cell: not in its identity.
    hpz_size: Optional[int] = field(default=None, metadata={"identity": False})
    #: Stage 3's coordinator limits, in parameter elements (null: DeepSpeed's default, except the persistence threshold:
    #: zeroexp's 0, every parameter partitioned; zeroexp.formulas.deepspeed.ds_stage3_limits resolves them); stage 3
    #: only (set under stages 0-2: refused). In the cell's identity only when set.
    stage3_prefetch_bucket_size: Optional[int] = field(default=None, metadata={"identity": "when_set"})
    stage3_max_live_parameters: Optional[int] = field(default=None, metadata={"identity": "when_set"})
    stage3_param_persistence_threshold: Optional[int] = field(default=None, metadata={"identity": "when_set"})
    stage3_max_reuse_distance: Optional[int] = field(default=None, metadata={"identity": "when_set"})
    #: DeepSpeed's ``overlap_comm``: the gradient reductions on a side stream, overlapping backward, stage 2 with a
    #: second ipg buffer (stage_1_and_2.py ``setup_buckets``: "double buffers"). zeroexp's default off (DeepSpeed
    #: 0.19's own: on at stage 3 alone, runtime/zero/config.py ``overlap_comm_valid``). Stages 2-3
    #: (:func:`check_ds_overlap_comm`).
    overlap_comm: bool = field(default=False, metadata={"identity": "when_set"})


#: The schema of every registered strategy (``strategy=<name>``): an adapter's ``schema`` is its entry here
#: (tests/test_config_keys.py holds them together).
SCHEMAS: dict[str, type[StrategyConfig]] = {
    "ddp": DDPConfig, "zro": ZROConfig, "fsdp_grad_op": FSDPConfig, "fsdp_full": FSDPFullConfig,
    "fsdp_hybrid": FSDPHybridConfig, "fsdp2_full": FSDP2FullConfig, "fsdp2_grad_op": FSDP2Config,
    "fsdp2_hybrid": FSDP2HybridConfig, "zero1": ZeroConfig, "zero2": ZeroConfig, "deepspeed": DeepSpeedConfig,
}
