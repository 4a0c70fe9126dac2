"""The plain data of the expectation model: a model's shape (:class:`ModelShape`), the settings that change bytes
(:class:`PlanKnobs`) and a strategy's groups (:class:`Groups`: its sharded buffers, FSDP units, buckets, owners),
which :mod:`zeroexp.formulas.layout` turns into bytes and collectives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from zeroexp.formulas.paper import Collectives

__all__ = ["ModelShape", "PlanKnobs", "Shard", "Unit", "Groups", "Cut", "Payload", "next_reached", "WORLD",
           "POST_FORWARD"]

#: The process groups a collectives model names besides a device mesh's dimensions: ``world``, the default group
#: (every rank); ``post_forward``, FSDP2's post-forward group (``reshard_after_forward=k``: k consecutive ranks, the
#: rows of the mesh ``view(-1, k)``, _fsdp_init.py ``_get_post_forward_mesh_info``).
WORLD, POST_FORWARD = "world", "post_forward"

@dataclass(frozen=True)
class ModelShape:
    """What the planner knows of a model: each parameter's shape in definition order (a shared one once); the FSDP
    units (indices of their parameters in FlatParameter order; ``root`` marks the root unit); ``ready``: the order
    in which the parameters' gradients become ready in backward (a meta-device backward; None: reverse definition
    order). Known only by its count (:meth:`from_count`), a model is one flat parameter (``exact`` False)."""

    params: tuple[tuple[int, ...], ...]
    units: tuple[tuple[int, ...], ...]
    root: tuple[bool, ...]
    exact: bool = True
    ready: tuple[int, ...] | None = None
    modules: tuple[tuple[int, ...], ...] = ()
    #: Per parameter: whether it trains (``requires_grad``); empty: every parameter does.
    trains: tuple[bool, ...] = ()
    #: Per unit, from a traced step: its forward calls (a module applied twice: 2) and whether backward reaches it
    #: (its output requires grad); empty: one call each, backward through every unit.
    unit_calls: tuple[int, ...] = ()
    unit_backward: tuple[bool, ...] = ()
    #: Per unit: whether the unit after it in forward order is reached by backward (FSDP2 prefetches it then).
    unit_next_reached: tuple[bool, ...] = ()
    #: The module's buffers (BatchNorm statistics, masks), each as (dtype name, bytes), in ``buffers()`` order.
    buffers: tuple[tuple[str, int], ...] = ()
    #: Indices of the trainable parameters a traced step gives no gradient (a branch forward never calls).
    unused: tuple[int, ...] = ()
    #: The module classes whose CPU kernels allocate or save what a fake-tensor trace does not see (convolutions,
    #: recurrent layers).
    opaque: tuple[str, ...] = ()
    #: Indices of the parameters, frozen ones too, that no module holding them (as its own) is called for in a traced
    #: forward: DeepSpeed stage 3 fetches a module's parameters in its pre-forward hook, so never these.
    uncalled: tuple[int, ...] = ()
    #: Every module call of a traced forward, as DeepSpeed stage 3's hooks see them (``ModuleCall``\ s: the module, its
    #: own parameters' indices, whether its input and its output need a gradient, its depth); empty: not traced.
    module_calls: tuple = ()
    #: Each ``torch.nn.Linear`` with a bias as (its weight's index, its bias's): DeepSpeed stage 3 computes them with
    #: its own ``F.linear`` (``LinearFunctionForZeroStage3``), whose hooks fire the weight's gradient before the bias's.
    linear_pairs: tuple[tuple[int, int], ...] = ()
    #: Each parameter with more than one name in the module's state dict (a tied weight: the GPT's head is its token
    #: embedding) as (its index, its names beyond the first).
    aliases: tuple[tuple[int, int], ...] = ()
    #: Indices into ``buffers`` of those the state dict leaves out (``persistent=False``: the rotary ``inv_freq`` of
    #: transformers' Llama): held, never in a checkpoint.
    unsaved_buffers: tuple[int, ...] = ()

    @classmethod
    def from_count(cls, numel: int) -> ModelShape:
        """A model known only by its number of parameters."""
        return cls(((int(numel),),), ((0,),), (False,), exact=False)

    @cached_property  # read per parameter in the planner's loops: computed once per shape
    def numels(self) -> tuple[int, ...]:
        """Each parameter's number of elements."""
        return tuple(math.prod(s) for s in self.params)

    @cached_property
    def numel(self) -> int:
        """Psi: the number of parameters."""
        return sum(self.numels)

    @cached_property
    def trained_numel(self) -> int:
        """The parameters that train (``Groups.numel`` of every layout: what forward and backward are timed over)."""
        return sum(k for i, k in enumerate(self.numels) if self.train(i))

    @property
    def ready_order(self) -> tuple[int, ...]:
        """Parameter indices in gradient-ready order (reverse definition order when no backward was traced)."""
        return self.ready if self.ready is not None else tuple(i for i in range(len(self.params))[::-1]
                                                               if self.train(i))

    def train(self, i: int) -> bool:
        """Whether parameter ``i`` trains (gets a gradient and optimizer state)."""
        return not self.trains or self.trains[i]

    @property
    def frozen(self) -> tuple[int, ...]:
        """The numels of the parameters that do not train, in definition order."""
        return tuple(k for i, k in enumerate(self.numels) if not self.train(i))

    def trainable(self) -> ModelShape:
        """The shape of the trainable parameters alone (what an optimizer, DDP's buckets and ZeRO's partitions are
        given): units and modules re-indexed, the frozen parameters dropped."""
        if not self.trains or all(self.trains):
            return self
        keep = [i for i in range(len(self.params)) if self.trains[i]]
        new = {old: k for k, old in enumerate(keep)}

        def remap(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(new[i] for i in g if i in new) for g in groups)

        return ModelShape(tuple(self.params[i] for i in keep), remap(self.units), self.root, self.exact,
                          None if self.ready is None else tuple(new[i] for i in self.ready if i in new),
                          remap(self.modules), (), self.unit_calls, self.unit_backward, self.unit_next_reached,
                          self.buffers, tuple(new[i] for i in self.unused if i in new), self.opaque,
                          tuple(new[i] for i in self.uncalled if i in new), (),
                          tuple((new[w], new[b]) for w, b in self.linear_pairs if w in new and b in new),
                          tuple((new[i], k) for i, k in self.aliases if i in new), self.unsaved_buffers)

    def calls(self, u: int) -> int:
        """Forward calls of unit ``u`` per step (1 unless traced otherwise)."""
        return self.unit_calls[u] if self.unit_calls else 1

    def backward(self, u: int) -> bool:
        """Whether backward reaches unit ``u`` (True unless traced otherwise)."""
        return self.unit_backward[u] if self.unit_backward else True

    def next_reached(self, u: int) -> bool:
        """Whether backward reaches the unit after ``u`` in forward order (True unless traced otherwise)."""
        return self.unit_next_reached[u] if self.unit_next_reached else True


@dataclass(frozen=True)
class PlanKnobs:
    """Strategy settings that change bytes: the bucket cap (``strategy.bucket_cap_mb``: DDP, zeroexp's ZeRO,
    DeepSpeed's reduce bucket of cap / 4 elements), zeroexp's ``reduce`` and its norm all_reduce (clipping or loss
    scaling), FSDP ``use_orig_params`` (16-byte aligned parameters, moments per unpadded view), ZeroRedundancyOptimizer
    ``parameters_as_bucket_view``, fp16 loss scaling, hybrid sharding's ``shard_size`` (0: not hybrid), global-norm
    clipping (``strategy.clip_grad_norm``), gradient accumulation (``grad_accum``), FSDP2's root kept after forward and
    its explicit prefetch."""

    bucket_cap_bytes: int = 25 * 2**20
    reduce: str = "reduce_scatter"
    norm_allreduce: bool = False
    use_orig_params: bool = True  # FSDP1's default (zeroexp.cell.strategy.FSDPConfig); no other row reads it
    loss_scaling: bool = False
    parameters_as_bucket_view: bool = False
    shard_size: int = 0
    clipping: bool = False
    micro_batches: int = 1  # grad_accum: micro-batches per optimizer step
    sync_each_microbatch: bool = False  # FSDP / FSDP2 with grad_accum: reduce-scatter each micro-batch, no no_sync
    find_unused_parameters: bool | None = None  # DDP's; None: when a traced step leaves a parameter ungraded
    compute_dtype: str = "float32"  # precision.param_dtype: what a row that casts the module's buffers casts them to
    #: FSDP2's reshard_after_forward=None (its default; ``strategy.reshard_after_forward=null``): the root unit kept
    #: unsharded from its forward to its backward, gathered once a step
    root_kept_after_forward: bool = False
    #: FSDP2's explicit prefetch (``strategy.forward_prefetch`` / ``backward_prefetch``): the units each unit's
    #: pre-forward / pre-backward all-gathers ahead; 0: FSDP2's default (forward: none; backward: its implicit one).
    #: Neither changes what is sent, only when (the step-time model's slots) and what is unsharded at once.
    forward_prefetch: int = 0
    backward_prefetch: int = 0
    #: FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)`` (``strategy.reduce_dtype``): the dtype its gradients are
    #: reduce-scattered (and, hybrid, all-reduced) in; "": the compute dtype, FSDP2's default
    reduce_dtype: str = ""
    #: FSDP2's ``reshard_after_forward=k`` (an int, 1 < k < N, ZeRO++'s hpZ): after its forward each unit keeps 1/k of
    #: its gathered parameters (``to_sharded_post_forward``), gathered again in backward from a group of k ranks;
    #: 0: not an int (resharded over the whole shard group, or kept)
    post_forward_ranks: int = 0
    #: FSDP2's per-unit reshard policy (``strategy.reshard_policy``, torchtitan's): "" none (every unit as the row
    #: reshards it), ``always``, ``default`` (the last unit kept after forward, the root kept) or ``never`` (all kept):
    #: :func:`zeroexp.formulas.families.fsdp2.kept_after_forward`
    reshard_policy: str = ""
    #: DeepSpeed stage 3's coordinator limits as the cell sets them (``strategy.stage3_prefetch_bucket_size``,
    #: ``stage3_max_live_parameters``, ``stage3_param_persistence_threshold``, ``stage3_max_reuse_distance``), parameter
    #: elements; None: the default
    #: :func:`zeroexp.formulas.deepspeed.ds_stage3_limits` resolves
    ds_prefetch_bucket: int | None = None
    ds_max_live: int | None = None
    ds_persistence: int | None = None
    ds_max_reuse: int | None = None
    #: DeepSpeed's ``overlap_comm`` (``strategy.overlap_comm``, stages 2-3): the reductions on a side stream (the
    #: step-time model's slots) and, at stage 2, a second ipg buffer (the peak model)
    overlap_comm: bool = False
    #: Activation checkpointing on (``activation_checkpointing`` not none): a checkpointed unit's forward runs again in
    #: backward, its modules' hooks with it
    recompute: bool = False
    #: The ``activation_checkpointing`` mode (``full``, ``selective_layer``, ``selective_op``; "" none or unknown)
    recompute_mode: str = ""
    #: ``selective_layer``'s k: the wrap units it checkpoints are every k-th in forward order
    recompute_every: int = 1
    #: ``offload`` (none, optimizer, full): what a row keeps on the host (DeepSpeed's offloaded optimizer computes its
    #: gradient norm on the host: :func:`zeroexp.formulas.deepspeed.ds_norm_bytes`)
    offload: str = "none"
    #: The optimizer state was loaded from a whole (``full``) checkpoint (``checkpoint.load_from``): torch's
    #: ``set_state_dict(full_state_dict=True)`` distributes each moment into its parameter's shard layout, padding
    #: included, so Adam's moments are as long as the padded shard even where the row creates them unpadded (FSDP2:
    #: ``zeros_like`` of the unpadded local chunk; measured, a 64-row weight at N=3: 20 rows held in 22 on rank 2)
    state_loaded_whole: bool = False

    def post_forward_over(self, shard_over: int) -> int:
        """The ranks FSDP2 reshards each unit to after forward over a shard group of ``shard_over`` ranks
        (:attr:`post_forward_ranks`), 0 where none: FSDP2 takes the int 1 as False, ``shard_over`` as True
        (_fsdp_init.py ``_get_post_forward_mesh_info``)."""
        k = self.post_forward_ranks
        return k if 1 < k < shard_over and shard_over % k == 0 else 0

    def reduce_itemsize(self, itemsize: int) -> int:
        """Bytes per element of the gradients' reduction: ``reduce_dtype``'s, else the compute dtype's ``itemsize``."""
        from zeroexp.formulas.paper import COMPUTE_ITEMSIZE

        return COMPUTE_ITEMSIZE[self.reduce_dtype] if self.reduce_dtype else itemsize


class Shard(NamedTuple):
    """A buffer sharded over the ranks: its parameters' element ranges in it (padding excluded), its padded length."""

    spans: tuple[tuple[int, int], ...]
    numel: int


class Unit(NamedTuple):
    """An FSDP unit: the padded elements it gathers, its all_gathers per step, and the padded elements it
    reduce-scatters (``reduced``; None: ``numel``; 0: none, a unit with no trainable parameter or none backward
    reaches)."""

    numel: int
    gathers: int
    reduced: int | None = None
    #: Its parameters stay unsharded from one step to the next (FSDP1: a unit kept after forward that backward never
    #: reaches is never resharded), so steady steps gather it no more.
    kept: bool = False
    #: Of its ``gathers``, those that run over FSDP2's post-forward group (``Groups.post_forward_size`` ranks): the
    #: gathers of a unit resharded to it after a forward call (``reshard_after_forward=k``).
    post_forward: int = 0

    @property
    def scattered(self) -> int:
        """The padded elements of its gradient reduce-scatter (0: none)."""
        return self.numel if self.reduced is None else self.reduced


@dataclass(frozen=True)
class Groups:
    """What decides what a rank keeps and sends, as plain data (see the module docstring).

    ``numels``: the trainable parameters (definition order; a shared one once); ``frozen``: the numels of the others
    (``requires_grad=False``: held, not trained). ``shards``: the sharded buffers (the parameters' storage: frozen
    ones included where the strategy shards them with the rest, FSDP). ``grad_shards``: the buffers' ranges that
    hold gradients and optimizer state when they are not every parameter of ``shards`` (each as its shard, spans of
    the trainable parameters only; a buffer with none omitted); None: the same as ``shards``. ``ungraded``: indices
    into ``numels`` of the parameters a step gives no gradient, for which the layout then keeps neither gradient
    nor optimizer state (DDP, ZeroRedundancyOptimizer; a flat buffer holds a zero gradient for them instead, and
    DeepSpeed stages 1-3 reduce none for them, holding zeros in their gradient partition);
    ``used_map_bytes``: DDP's ``find_unused_parameters`` all-reduce of its used-parameter map. ``buffers``: the
    module's buffers, (dtype name, bytes) each, which every rank holds whole; ``buffer_broadcasts``: bytes of each
    broadcast of them per step (DDP's ``broadcast_buffers``).
    ``units``: FSDP units. ``buckets``: gradient reductions, each its parameters' numels in reduce order (DDP's
    buckets, DeepSpeed's). ``owners``: each rank's parameters' numels (ZeroRedundancyOptimizer).
    ``broadcasts``: elements per broadcast after the step (ZeroRedundancyOptimizer). ``gathers``: DeepSpeed stage
    3's parameter fetches, each one all_gather's numels. ``exact``: False when derived from a parameter count.
    ``shard_size``: the ranks one buffer is sharded over under hybrid sharding (the shard group; the buffers are
    padded to it and replicated across the world_size / shard_size replicas); 0: over all world_size ranks.
    ``post_forward_size``: the ranks FSDP2 reshards each unit to after forward (``reshard_after_forward=k``: each
    rank holds 1/k of the unit until backward gathers it from those k ranks, ``Unit.post_forward``); 0: none.
    ``reduce_order``: DeepSpeed stages 2-3, the indices into ``numels`` of the parameters whose gradients are
    reduced, in the order their hooks fire (the traced backward's, ``ModelShape.ready_order``); empty: none given.
    """

    layout: str
    world_size: int
    numels: tuple[int, ...]
    shards: tuple[Shard, ...] = ()
    units: tuple[Unit, ...] = ()
    buckets: tuple[tuple[int, ...], ...] = ()
    owners: tuple[tuple[int, ...], ...] = ()
    broadcasts: tuple[int, ...] = ()
    gathers: tuple[tuple[int, ...], ...] = ()
    exact: bool = True
    shard_size: int = 0
    frozen: tuple[int, ...] = ()
    grad_shards: tuple[Shard, ...] | None = None
    buffers: tuple[tuple[str, int], ...] = ()
    buffer_broadcasts: tuple[int, ...] = ()
    ungraded: tuple[int, ...] = ()
    used_map_bytes: int = 0
    post_forward_size: int = 0
    reduce_order: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def trained_shards(self) -> tuple[Shard, ...]:
        """The shards' ranges that hold gradients and optimizer state."""
        return self.shards if self.grad_shards is None else self.grad_shards

    @property
    def shard_over(self) -> int:
        """The ranks a sharded buffer is split over: the shard group under hybrid sharding, else the world."""
        return self.shard_size or self.world_size

    def differences(self, other: Groups) -> list[str]:
        """What differs between two Groups, field by field (empty: equal)."""
        return [f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}" for f in self.__dataclass_fields__
                if getattr(self, f) != getattr(other, f)]


def next_reached(order: list[int], reached: list[bool]) -> tuple[bool, ...]:
    """Per unit: whether backward reaches the unit that finished its forward right after it (``order``: unit indices
    in the order their forwards finished, a unit called twice at its first; False for the last, or one not called)."""
    out = [False] * len(reached)
    first = list(dict.fromkeys(order))
    for a, b in zip(first, first[1:]):
        out[a] = reached[b]
    return tuple(out)


@dataclass
class Cut:
    """What a family cuts an exact model into (:meth:`zeroexp.formulas.families.Family.cut`): the sharded buffers,
    the gradient-holding ones where they differ, the gathered units, ZeroRedundancyOptimizer's owners."""

    shards: list[Shard] = field(default_factory=list)
    grad_shards: list[Shard] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    owners: list[tuple[int, ...]] = field(default_factory=list)


#: A row's payload model: (groups, the wire's bytes per element, knobs) -> one rank's collectives per step.
Payload = Callable[[Groups, int, PlanKnobs], "Collectives"]
