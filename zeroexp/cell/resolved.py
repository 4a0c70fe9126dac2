"""The cell as every layer reads it: :class:`Cell`, resolved once from the composed, validated config.

``zeroexp.config.schemas.validate`` returns it (with the model's shape); the launching process hands it to the ranks
(``zeroexp.rank.worker.rank_entry``), which hand it to the adapter (its :class:`~zeroexp.cell.policy.CellPolicy`), the
probes (``RunContext.cell``) and the expectation; the plan check reads it after the ranks. A key of the config is read
here, once: nothing above asks the config for a key with a default of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from zeroexp.cell.identity import init_of
from zeroexp.cell.policy import CellPolicy, strategy_config
from zeroexp.cell.schedule import Schedule
from zeroexp.cell.source import Source
from zeroexp.cell.strategy import BUCKET_CAP_MB
from zeroexp.formulas import ITEMSIZE, LAYOUTS, ModelShape, PlanKnobs, StateLayout
from zeroexp.formulas.peak.checkpointing import Checkpointing, checkpointing_of

__all__ = ["Cell", "knobs_of", "layout_of", "post_forward_ranks", "units_ahead"]


@dataclass(frozen=True)
class Cell:
    """A validated cell. ``policy``: what its adapter acts on (the strategy's own config among it); ``knobs``: the
    settings that change its bytes, as the expectation model reads them; ``schedule``: the steps each probe owns;
    ``row_name`` / ``row``: its row of the expectation model (``strategy.layout``); ``device`` / ``backend``: where its
    ranks run (``cuda``/``nccl`` or ``cpu``/``gloo``, zeroexp.devices' one rule); ``shape``: its model's shape (units
    cut by its wrap classes), read by validation; None where the model does not build on the meta device.
    ``logs_loss``: whether its training step hands the loss to Lightning's ``self.log``: only where Lightning has a
    logger to write it to (``logger=csv``, zeroexp.rank.fit.make_logger; never in a dry run, whose fake loss has no
    value); otherwise the call would only fill
    ``callback_metrics``, which nothing reads (the loss is the iterations probe's; W&B's run is logged from the
    files), at about a tenth of a small model's step in Lightning's result collection on every rank. The logged loss
    is held to the next step (``StepTrace.for_cell``). ``load_from``: the checkpoint its training starts from
    (``checkpoint.load_from``), its model and optimizer state and its data position (:attr:`first_step`)."""

    policy: CellPolicy
    knobs: PlanKnobs
    schedule: Schedule
    row_name: str
    row: StateLayout
    world_size: int
    steps: int
    precision: str
    offload: str
    init: str
    activation_checkpointing: str
    checkpoint: str
    device: str
    backend: str
    dry_run: bool
    calibration: str | None
    shape: ModelShape | None = None
    logs_loss: bool = False
    load_from: Source | None = None

    @classmethod
    def of(cls, cfg: Any, shape: ModelShape | None = None, local_world_size: int | None = None) -> Cell:
        """The cell of a composed config that validation accepted (``local_world_size``: its ranks on this node, for
        the device rule; default: every rank)."""
        from zeroexp.devices import ranks_get_a_gpu

        name, row = layout_of(cfg)
        on_gpu = ranks_get_a_gpu(cfg, local_world_size)
        policy = CellPolicy.of(cfg)
        if shape is not None and shape.ready is not None:  # a traced step: its ungraded parameters are known
            policy = dataclasses.replace(policy, ungraded=bool(shape.unused))
        source = _source(cfg)
        knobs = knobs_of(cfg)
        if source is not None and source.kind == "full":
            knobs = dataclasses.replace(knobs, state_loaded_whole=True)
        return cls(policy=policy, knobs=knobs, schedule=Schedule.from_cfg(cfg), row_name=name,
                   row=row, world_size=int(cfg.world_size), steps=int(cfg.steps), precision=str(cfg.precision.name),
                   offload=str(cfg.offload.name), init=init_of(cfg),
                   activation_checkpointing=str(cfg.activation_checkpointing.name),
                   checkpoint=str(cfg.checkpoint.name), device="cuda" if on_gpu else "cpu",
                   backend="nccl" if on_gpu else "gloo", dry_run=bool(cfg.dry_run),
                   calibration=None if cfg.calibration is None else str(cfg.calibration), shape=shape,
                   logs_loss=cfg.logger.name == "csv" and not cfg.dry_run,
                   load_from=source)

    def __getstate__(self) -> dict[str, Any]:
        # to the ranks by pickle: a row holds its family's closures, so it travels by name (zeroexp.formulas.LAYOUTS)
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "row": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in {**state, "row": LAYOUTS[state["row_name"]]}.items():
            object.__setattr__(self, key, value)

    def with_shape(self, shape: ModelShape | None) -> Cell:
        """This cell with its model's shape read."""
        return dataclasses.replace(self, shape=shape)

    def strategy_setting(self, key: str) -> Any:
        """The strategy's own ``key`` (``strategy.<key>``); None for a strategy whose schema has no such setting."""
        return getattr(self.policy.strategy, key, None)

    @property
    def itemsize(self) -> int:
        """Bytes per element of the compute dtype (``precision.param_dtype``)."""
        return ITEMSIZE[self.policy.precision.param_dtype]

    @property
    def first_step(self) -> int:
        """The optimizer step its first step is, counted from the run that began the training: 0, or the step of the
        checkpoint it starts from (its batches are those of steps ``first_step``, ``first_step + 1``, ...)."""
        return 0 if self.load_from is None else self.load_from.step

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step."""
        return self.policy.grad_accum

    @property
    def batch_size(self) -> int:
        return self.policy.batch_size

    @property
    def model(self) -> Mapping[str, Any]:
        """The model node, resolved and read-only."""
        return self.policy.model

    @property
    def wrap(self) -> tuple[str, ...]:
        """The wrap units' classes by import path (``strategy.wrap``, else ``model.wrap``)."""
        return self.policy.wrap

    @property
    def checkpointed(self) -> Checkpointing:
        """Which wrap units' activations are recomputed, and how (``activation_checkpointing``; false for none)."""
        return self.policy.activation_checkpointing


def knobs_of(cfg: Any) -> PlanKnobs:
    """The byte-relevant settings of a composed cell config; a strategy whose schema lacks a knob
    (zeroexp.cell.strategy) takes :class:`PlanKnobs`' value for it, which is what that strategy does."""
    own = strategy_config(cfg.strategy)  # the strategy's schema keys only (a sweep's keys for others left out)

    def knob(key: str, default: Any) -> Any:  # a knob this strategy's schema does not have: the strategy has none
        return getattr(own, key, default)

    cap, clip, scaling = knob("bucket_cap_mb", BUCKET_CAP_MB), knob("clip_grad_norm", None), \
        cfg.precision.loss_scale is not None
    reshard = knob("reshard_after_forward", True)
    checkpointing = checkpointing_of(cfg.activation_checkpointing)
    return PlanKnobs(
        bucket_cap_bytes=int(float(cap) * 2**20),
        reduce=str(knob("reduce", PlanKnobs.reduce)),
        norm_allreduce=clip is not None or scaling,
        use_orig_params=bool(knob("use_orig_params", PlanKnobs.use_orig_params)),
        loss_scaling=scaling,
        parameters_as_bucket_view=bool(knob("parameters_as_bucket_view", False)),
        shard_size=int(knob("shard_size", 0) or 0),  # a hybrid's shard_size=null: its node's ranks, read at run time
        clipping=clip is not None,
        micro_batches=int(cfg.grad_accum),
        sync_each_microbatch=bool(knob("sync_each_microbatch", False)),
        find_unused_parameters=knob("find_unused_parameters", None),
        compute_dtype=str(cfg.precision.param_dtype),
        root_kept_after_forward=hasattr(own, "reshard_after_forward") and reshard is None
        or knob("reshard_policy", None) in ("default", "never"),
        reshard_policy=str(knob("reshard_policy", None) or ""),
        forward_prefetch=units_ahead(knob("forward_prefetch", 0)),
        backward_prefetch=int(knob("backward_prefetch", 0) or 0),
        reduce_dtype=str(knob("reduce_dtype", None) or ""),
        post_forward_ranks=post_forward_ranks(reshard),
        ds_prefetch_bucket=knob("stage3_prefetch_bucket_size", None),
        ds_max_live=knob("stage3_max_live_parameters", None),
        ds_persistence=knob("stage3_param_persistence_threshold", None),
        ds_max_reuse=knob("stage3_max_reuse_distance", None),
        overlap_comm=bool(knob("overlap_comm", False)),
        recompute=bool(checkpointing),
        offload=str(cfg.offload.name),
        recompute_mode=checkpointing.mode.replace("none", ""),
        recompute_every=checkpointing.every,  # selective_layer's k, its null the mode's default (checkpointing_of)
    )


def units_ahead(forward_prefetch: Any) -> int:
    """A strategy's ``forward_prefetch`` as :attr:`PlanKnobs.forward_prefetch`, the units each unit's pre-forward
    all-gathers ahead: FSDP2's int as it is, FSDP1's bool one unit (its next unit's all-gather) or none."""
    return int(forward_prefetch or 0)


def post_forward_ranks(value: Any) -> int:
    """FSDP2's ``reshard_after_forward`` as :attr:`PlanKnobs.post_forward_ranks`: the int, 0 for a bool or null."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def layout_of(cfg: Any) -> tuple[str, StateLayout]:
    """The row the cell's strategy names (``strategy.layout``, e.g. ``deepspeed_stage2``), and its name."""
    name = str(cfg.strategy.layout)  # every strategy's schema has it (zeroexp.cell.strategy.StrategyConfig)
    if name not in LAYOUTS:
        raise KeyError(f"strategy.layout={name!r} is no row of zeroexp.formulas.LAYOUTS ({', '.join(LAYOUTS)})")
    return name, LAYOUTS[name]


def _source(cfg: Any) -> Source | None:
    """The checkpoint the cell starts from (``checkpoint.load_from``, or its ``checkpoint.source``'s:
    zeroexp.cell.written), its ``meta.json`` read; None where it starts from its seed, or where its source cell has
    not written it yet (a sweep's check of its jobs, before the job writes it: zeroexp.launch.sources)."""
    from zeroexp.cell.written import load_dir, source_pending

    where = load_dir(cfg)
    if where is None or source_pending(cfg):
        return None
    return Source.read(where, verify=False)
