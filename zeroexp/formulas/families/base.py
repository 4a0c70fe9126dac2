"""What a strategy family is: the questions every consumer asks of a row, each answered by the row's family.

A row (:class:`zeroexp.formulas.layout.StateLayout`) is a label, a stage, a family and the family's flags; the family
knows how its strategies cut a model into groups, what they keep, how their collectives overlap the step, what the
framework costs per step, what each phase of the step holds (the peak model), what gloo may free late and what
``init=meta`` holds. This base answers for a row of no model (no peak model, no overlap rule); a family overrides
what it models. Families import nothing outside ``zeroexp.formulas`` (a calibration reaches them as data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from zeroexp.formulas.shapes import Cut, ModelShape, Payload, PlanKnobs, Unit

if TYPE_CHECKING:  # the peak model's types, for the hints alone
    from zeroexp.formulas.peak.phases import StepTrace
    from zeroexp.formulas.peak.precision import PrecisionTerms
    from zeroexp.formulas.shapes import Groups

__all__ = ["Family", "NO_FAMILY", "StateLayout"]


class Family:
    """A family of no model: every answer is the planner's count alone. Subclasses are the strategy families
    (:mod:`zeroexp.formulas.families`); each is a singleton its rows name."""

    #: The family's name, as docs and notes name it.
    name = "none"
    #: Frozen parameters sharded with the trained ones (FSDP's units, FSDP2's rows, DeepSpeed stage 3's parameters);
    #: otherwise the groups are cut from the trainable parameters alone.
    shards_frozen = False
    #: One Adam ``step`` scalar per trained shard where the groups are exact (FSDP's units and rows, zeroexp's
    #: buckets).
    steps_per_shard = False
    #: FSDP gathers units: no unsharded parameter is left at the optimizer boundary (``param_unsharded`` factor 0).
    gathers_units = False
    #: The strategy's parameters are views of flat buffers the optimizer steps whole (zeroexp's ZeRO, FSDP1).
    flat_buffers = False
    #: The parameters are DTensors (FSDP2): the step time needs the calibration's DTensor terms.
    dtensor_params = False
    #: With ``use_orig_params`` Adam's moments and steps are per unpadded view of a shard (FSDP1) [FSDP].
    views_with_orig_params = False
    #: A unit kept unsharded from step to step (``Unit.kept``) holds its unsharded parameters at rest (FSDP1).
    holds_kept_units = False
    #: A full state dict made whole name by name (FSDP1's FULL_STATE_DICT, FSDP2's DTensors): a parameter with two
    #: names is gathered, and written, twice; otherwise a tied parameter is one tensor under both names, written once.
    gathers_each_name = False
    #: The strategy runs its collectives on a process group of its own over every rank, a second NCCL communicator
    #: beside the default group's (DeepSpeed: deepspeed/utils/groups.py ``_clone_world_group``).
    clones_world = False

    def sharded_written(self, row: StateLayout, groups: Groups, itemsize: int, knobs: PlanKnobs, state: Any,
                        again: int) -> dict[str, Any] | None:
        """What ``checkpoint=sharded`` writes (zeroexp.formulas.checkpoint.written_bytes; ``state``: its
        ``StatePayload``, ``again``: a tied parameter's value under its other names): torch.distributed.checkpoint's
        items (DDP, FSDP1, FSDP2 and hybrids): every item once over the ranks, each state-dict name its own item (a
        tied parameter's value again), the rank of a replicated one decided at run time by ``dedup_save_plans``
        (``ranks`` None); a family that writes its own files overrides it. ``layout`` names how: ``dcp``, ``owners``
        (ZeroRedundancyOptimizer), ``deepspeed``."""
        return {"layout": "dcp", "total": state.total + again, "ranks": None, "state": state.record(),
                "aliases": again}

    def cuts_frozen(self, row: StateLayout) -> bool:
        """Whether the row's groups are cut from every parameter, frozen ones too (:attr:`shards_frozen`)."""
        return self.shards_frozen

    def pads_count(self, row: StateLayout) -> bool:
        """Whether a parameter count's state is padded as one flat buffer (False: replicated or owned, never
        padded: DDP, ZeroRedundancyOptimizer)."""
        return True

    def groups_kind(self, row: StateLayout) -> str:
        """How the row's groups are cut, by name (notes and docs): ``none``, ``flat``, ``params``, ``units``,
        ``rows``, ``buckets``, ``owners``."""
        return "none"

    def cut(self, row: StateLayout, shape: ModelShape, n: int, knobs: PlanKnobs, itemsize: int, narrow: int) -> Cut:
        """The groups of an exact ``shape`` (the trainable parameters', or the whole model's where
        :attr:`shards_frozen`) sharded over ``n`` ranks; ``narrow``: FSDP2's post-forward group size (0: none)."""
        return Cut()

    def unit(self, numel: int, gathers: int, calls: int = 1, reached: bool = True, reduced: int | None = None,
             next_reached: bool = True, narrow: bool = False) -> Unit:
        """A gathered unit as a traced step drives it [FSDP]. ``gathers`` per step for one forward call that
        backward reaches: 2 when the unit is resharded after forward and gathered again before backward, 1 when kept
        unsharded into backward; it reduce-scatters ``reduced`` elements (None: ``numel``) only where backward
        reaches it. Each further forward call of a resharded unit gathers again. Here FSDP1's hooks (a parameter
        count's one unit too): backward gathers a resharded unit once (its pre-backward hook runs once per
        backward), and a unit backward never reaches not at all; one kept after forward is then never resharded
        (steady steps gather it no more: ``kept``). FSDP2's hooks: :meth:`zeroexp.formulas.families.fsdp2.
        Fsdp2Rows.unit`. ``next_reached`` and ``narrow``: FSDP2's."""
        resharded, reached = gathers >= 2, reached and calls > 0
        kept = not resharded and calls > 0 and not reached
        again = 1 if resharded and reached else 0
        total = (calls if resharded else (0 if kept else min(calls, 1))) + again
        scattered = (numel if reduced is None else reduced) if reached else 0
        return Unit(numel, total, None if scattered == numel else scattered, kept, 0)

    def extra_groups(self, row: StateLayout, shape: ModelShape, full: ModelShape, cut: Cut) -> dict[str, Any]:
        """Fields of :class:`Groups` beyond the cut: ``grad_shards`` where they are not every shard, ``ungraded``
        where the family finds them itself."""
        return {"grad_shards": tuple(cut.grad_shards) if self.cuts_frozen(row) and full.frozen else None}

    # --- time ---------------------------------------------------------------------------------------------------
    def collective_slots(self, row: StateLayout, groups: Groups, prefetch: str, f: float, b: float, o: float,
                         knobs: PlanKnobs) -> tuple[list, str]:
        """Where each collective of a step is issued and waited for (:func:`zeroexp.formulas.time.overlap.
        collective_slots`) under the strategy's ``knobs`` (FSDP2's explicit prefetch, DeepSpeed's ``overlap_comm``),
        and the rule's name."""
        return [], "no overlap rule for this row: every collective exposed"

    def follows_prefetch(self, row: StateLayout) -> bool:
        """Whether the row's backward prefetch (``prefetch``) is a knob of its step: FSDP1 resharding after forward."""
        return False

    def below_min_world(self, row: StateLayout) -> str:
        """Why the row starts at ``row.min_world_size`` ranks (the planner's note for fewer)."""
        return ""

    def reads_overlap_comm(self, row: StateLayout) -> bool:
        """Whether ``PlanKnobs.overlap_comm`` (DeepSpeed's) is a knob of the row: its slots and peak read it."""
        return False

    def time_knobs(self, row: StateLayout, knobs: PlanKnobs, device: str) -> PlanKnobs:
        """The knobs the step-time model places the row's calls with on ``device`` (``cpu``, ``cuda``): a knob the
        runtime ignores there reads as off."""
        return knobs

    def framework_terms(self, row: StateLayout, groups: Groups, itemsize: int, cost: Any, orig_params: bool,
                        terms: dict[str, float], notes: list[str]) -> tuple[float, float, float]:
        """The framework's seconds of one step in forward, backward and the optimizer beyond the loop's
        (:func:`zeroexp.formulas.time.framework.framework_time`), each term added to ``terms``, each gap to
        ``notes``."""
        notes.append(f"groups {self.groups_kind(row)!r}: only the loop's cost is calibrated for this row")
        return 0.0, 0.0, 0.0

    # --- the peak model -----------------------------------------------------------------------------------------
    def flow(self, row: StateLayout) -> str | None:
        """The row's gradient flow in the peak model, by name (None: no peak model)."""
        return None

    def unmodelled(self, row: StateLayout) -> str | None:
        """Why a row without a flow can have no peak model at all (None: a runtime whose model is not built yet)."""
        return None

    #: Where the family's rows are listed among the covered ones (messages), and the order within it.
    covered_rank = 9
    #: Where the peak model of the family is written.
    peak_source = "zeroexp.formulas.peak.phases"

    def covered_key(self, row: StateLayout) -> tuple:
        return ()

    def accumulates(self, row: StateLayout) -> bool:
        """Whether the peak model covers ``grad_accum`` > 1 for the row whatever its ``no_sync`` knobs."""
        return False

    def accumulated_grad_bytes(self, row: StateLayout, grad_bytes: int) -> int | None:
        """The gradient bytes the later micro-batches hold from their start that a step without accumulation does
        not (None: no accumulation model)."""
        return None

    def precision_terms(self, row: StateLayout, precision: str, param_dtype: str,
                        compute_itemsize: int) -> PrecisionTerms | None:
        """How the row computes in ``precision`` (None: no precision terms)."""
        return None

    def needs_in_place(self, row: StateLayout, micro_batches: int) -> bool:
        """Whether the peak model reads the step traced with its gradients allocated before it."""
        return False

    def trace_options(self, row: StateLayout) -> dict[str, bool]:
        """How the step is traced for the row: segmented at every module holding parameters (``own_params_units``),
        a model of no unit as one unit (``root_unit``)."""
        return {"own_params_units": False, "root_unit": False, "converts_module": False, "tensor_bytes": False}

    def shape_limits(self, row: StateLayout, shape: ModelShape) -> tuple[list[str], list[str], list[str]]:
        """Why the peak model does not cover this model's shape under the row, placed among the limits every family
        shares (:func:`zeroexp.plan.check.memory.shape_limits`): before them, after the RNN one, last."""
        return [], [], []

    def offload_limit(self, row: StateLayout, offload: str, micro_batches: int = 1) -> str | None:
        """Why the peak model does not cover the row with ``offload`` (optimizer, full) and ``micro_batches`` (None:
        it does): FSDP's offload runs on a GPU alone, so no CPU cell can check a model of it."""
        return (f"no peak model yet for offload={offload} (no strategy the peak model covers runs it on CPU: FSDP's "
                "CPUOffload needs a GPU; covered: offload none)")

    def checkpointing_limit(self, row: StateLayout, frozen: bool = False) -> str | None:
        """Why the peak model does not cover the row with activation checkpointing (None: it does); ``frozen``: the
        model has parameters that do not train."""
        return None

    def accumulation_limit(self, row: StateLayout, reduce_dtype: str | None, param_dtype: str) -> str | None:
        """Why the peak model does not cover the row's accumulation with these dtypes (``strategy.reduce_dtype``,
        None: the compute dtype; ``precision.param_dtype``); None: it does (or :meth:`mixed_accumulation_limit`
        says)."""
        return None

    def frozen_accumulation_limit(self, row: StateLayout) -> str | None:
        """Why the peak model does not cover the row's accumulation (no_sync, or reducing every micro-batch) on a model
        with frozen parameters (None: it does)."""
        return None

    def no_sync_checkpointing(self, row: StateLayout) -> bool:
        """Whether the peak model of the row's no_sync accumulation (``StateLayout.no_sync_accumulation``) covers
        activation checkpointing too."""
        return False

    def sync_accumulation(self, row: StateLayout) -> bool:
        """Whether the peak model covers the row's accumulation reducing every micro-batch
        (``strategy.sync_each_microbatch``), any checkpointing and dtypes."""
        return False

    def mixed_accumulation_limit(self, row: StateLayout) -> str | None:
        """Why the peak model does not cover the row's accumulation (grad_accum > 1 under its no_sync) below fp32
        (None: it does, as in fp32)."""
        return None

    def state_note(self, row: StateLayout, shape: ModelShape, n: int) -> str | None:
        """What a reader of the row's per-rank state at N should know of how it shards this model (None: nothing
        beyond its factors)."""
        return None

    def peak_limits(self, row: StateLayout, groups: Groups, bucket_cap_bytes: int,
                    recompute: bool | str = False) -> list[str]:
        """Why the peak model does not cover these groups (empty: it does; ``recompute``: activation checkpointing
        on, its mode where known)."""
        return []

    def phase_peaks(self, row: StateLayout, groups: Groups, shape: ModelShape, trace: StepTrace, itemsize: int, *,
                    rank: int, prefetch: str, gloo: bool, micro_batches: int, in_place: StepTrace | None,
                    bucket_cap_bytes: int, terms: PrecisionTerms | None, reduce: str, root_kept: bool, foreach: bool,
                    knobs: PlanKnobs, block: int) -> dict[str, dict]:
        """Per phase, the bytes rank ``rank`` holds above steady at the phase's peak, by category."""
        raise KeyError(row.label)  # no peak model

    def worst_rank(self, row: StateLayout, groups: Groups, trace: StepTrace, itemsize: int, *, micro_batches: int,
                   in_place: StepTrace | None, bucket_cap_bytes: int, foreach: bool, knobs: PlanKnobs = PlanKnobs()
                   ) -> int | tuple[int, ...] | None:
        """For a row whose ranks differ (``ranks_differ``), the first rank whose largest phase in
        :meth:`phase_peaks` (given the same ``knobs``) is highest, found without each rank's phases; a tuple: the
        ranks to evaluate, the highest taken; None: each rank's phases are evaluated."""
        return None

    def steady_buffers(self, row: StateLayout, groups: Groups, itemsize: int, bucket_cap_bytes: int,
                       terms: PrecisionTerms | None) -> int:
        """What a rank holds at the optimizer boundary beside its model state."""
        return 0

    def step_frees_grads(self, row: StateLayout) -> bool:
        """Whether the step frees the gradients the state at the optimizer boundary holds (none between steps)."""
        return False

    def late_free(self, row: StateLayout, groups: Groups, itemsize: int, micro_batches: int,
                  bucket_cap_bytes: int = 0) -> dict[str, list[tuple[str, int]]]:
        """Per phase, the tensors of which gloo may free one late (a CPU cell), each with its bytes
        (``bucket_cap_bytes``: ``strategy.bucket_cap_mb`` in bytes; 0: not known)."""
        return {}

    # --- init=meta ----------------------------------------------------------------------------------------------
    def init_peak_bytes(self, shape: ModelShape, init: str, world_size: int, itemsize: int,
                        use_orig_params: bool) -> int | None:
        """The largest rank's init peak in bytes (:mod:`zeroexp.formulas.init`); None: not modelled."""
        return None

    # --- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_peaks(self, row: StateLayout, groups: Groups, shape: ModelShape, itemsize: int, kind: str,
                         device: Any, full_file: int, state: Any, knobs: PlanKnobs) -> Any:
        """What a ``kind`` checkpoint's save and load hold on each rank, a ``CheckpointPeaks`` on ``device``'s
        ``DeviceSemantics`` (zeroexp.formulas.checkpoint_peak, whose terms import the layout this module is part of;
        ``full_file``: the tensors' bytes of the row's full checkpoint, ``state``: its ``StatePayload``); None: not
        modelled for the family."""
        return None


NO_FAMILY = Family()


@dataclass(frozen=True)
class StateLayout:
    """Where one strategy keeps each kind of model state at the optimizer boundary, and what it sends per step.

    ``sharded``: the kinds each rank holds 1/N of (a master follows ``optim``). ``master``: an fp32 copy of the
    parameters ``always``, only with a low-precision compute dtype (``mixed``, K = 12 [ZeRO 5.1]) or ``never``.
    ``family``: the strategy family (:mod:`zeroexp.formulas.families`) that answers every question of the row's
    kind: how :func:`derive_groups` cuts the shards (``Family.groups_kind``: ``flat``, one buffer padded to ``pad`` x
    N; ``params``, each parameter padded to N; ``units``, FSDP FlatParameters; ``rows``, FSDP2's dim-0 chunks;
    ``buckets``, zeroexp's; ``owners``, ZeroRedundancyOptimizer's; ``none``), the peak model, the overlap rule, the
    framework's cost, the init peak. ``payload``: (groups, itemsize, knobs) -> the
    per-step collectives [ZeRO 7]. ``gather``: unsharded parameters held while computing (``largest`` unit, ``all``,
    ``none``). ``fp32_at_rest``: parameters and gradients stay fp32 between steps (FSDP MixedPrecision).
    ``fp32_on_the_wire``: collectives move fp32 (autocast). ``padded_moments``: Adam's moments as long as the
    padded shard. ``comm``: extra groups the payload needs, derived from shapes (DDP's buckets, DeepSpeed's).
    DeepSpeed's rows: ``whole_grads`` (ZeRO-1/2 hold the full gradient of every parameter their partition
    overlaps), ``offload_grad`` (``replace`` / ``add`` the fp32 host gradient partition), ``flat_optimizer`` (one Adam
    ``step`` per flat partition; ``sub_groups``: how many partitions of the shards' partition lengths),
    ``payload_limits`` ((groups, knobs, precision, offload) -> why the payload model is not exact for a cell).
    ``hybrid``: sharded within a shard group of ``PlanKnobs.shard_size`` ranks, replicated across the groups (HSDP).
    ``reference``: a closed form no strategy runs (the ZeRO paper's stages): planned beside the strategies for
    comparison, never recommended.
    """

    label: str
    stage: int
    sharded: frozenset[str]
    master: str
    family: Family
    payload: Payload
    gather: str = "none"
    pad: int = 1
    fp32_at_rest: bool = False
    fp32_on_the_wire: bool = False
    padded_moments: bool = True
    precisions: frozenset[str] = frozenset({"fp32"})
    offloads: frozenset[str] = frozenset({"none"})
    source: str = ""
    whole_grads: bool = False
    offload_grad: str = "none"
    flat_optimizer: bool = False
    payload_limits: Callable[..., list[str]] | None = None
    comm: Callable[[ModelShape, int, PlanKnobs], dict] | None = field(default=None, compare=False)
    #: A unit's all_gathers per step from (whether it is the root, the knobs[, whether it is the last unit in forward
    #: order: FSDP2's ``strategy.reshard_policy=default`` keeps it]).
    gathers_per_unit: Callable[..., int] = field(default=lambda root, knobs, last=False: 1, compare=False)

    def at_rest_bytes(self, itemsize: int) -> int:
        """Bytes per element of a parameter held between steps without a master (a frozen one): fp32 where the row
        keeps parameters fp32 at rest, else the precision's ``itemsize``."""
        return 4 if self.fp32_at_rest else itemsize
    #: Whether the strategy passes ``PlanKnobs.post_forward_ranks`` (FSDP2's ``reshard_after_forward=k``) to every
    #: unit: resharded after forward to a group of k ranks (:attr:`Groups.post_forward_size`, ``Unit.post_forward``).
    post_forward_group: bool = False
    #: Whether the strategy casts the module's floating buffers to the compute dtype (below fp32).
    casts_buffers: bool = False
    sub_groups: Callable[[list[int]], int] = field(default=len, compare=False)
    hybrid: bool = False
    reference: bool = False
    #: The fewest ranks the row runs at: FSDP at one rank shards nothing (torch runs FSDP1 as NO_SHARD and FSDP2
    #: skips its all-gathers and reduce-scatters), so its rows start at 2; the strategies refuse fewer.
    min_world_size: int = 1
    # --- the family's flags (zeroexp.formulas.families reads these, never the row's name) ---
    #: FSDP: whether the row reshards a unit after forward (FULL_SHARD, FSDP2 ``reshard_after_forward=True``) and,
    #: for FSDP1, so follows ``prefetch``; SHARD_GRAD_OP keeps its units unsharded until their backward.
    reshard_after_forward: bool = False
    #: Whether the peak model covers the row's ``grad_accum`` under ``no_sync`` (FSDP1 SHARD_GRAD_OP, which keeps
    #: its units unsharded across the micro-batches).
    no_sync_accumulation: bool = False
    #: DeepSpeed's ZeRO stage for a DeepSpeed row (None: not DeepSpeed).
    deepspeed_stage: int | None = None
    #: Whether the row's ranks hold different state or buffers, so that the worst rank must be searched for
    #: (ZeroRedundancyOptimizer's owners, DeepSpeed stage 1-2's partitions).
    ranks_differ: bool = False
    #: Whether the row's ``init=meta`` is modelled (its family's :meth:`~zeroexp.formulas.families.Family.
    #: init_peak_bytes`; not: the paper's rows, no runtime; DeepSpeed's, refused; hybrid sharding's).
    init_modelled: bool = False
