"""What every strategy adapter provides, and the one Lightning strategy that runs them all.

Lightning's own ``FSDPStrategy`` refuses a CPU accelerator and passes no CPU device to FSDP, so zeroexp runs
every strategy through :class:`CellStrategy`, a ``DDPStrategy`` (process group, ranks, barriers, the forward
redirection to ``training_step``) whose wrapping step is delegated to the adapter. The process group backend
follows the device: gloo on CPU, NCCL on CUDA (one GPU per rank).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, NamedTuple

import torch
from omegaconf import DictConfig
from torch import nn

from zeroexp.formulas import Groups
from zeroexp.cell.policy import CellPolicy
from zeroexp.cell.strategy import StrategyConfig


def post_order(module: nn.Module, keep: Any) -> list[nn.Module]:
    """The submodules of ``module`` (itself included) for which ``keep`` is true, children before parents, in
    definition order: the order in which FSDP's auto-wrap makes units, and the planner's (zeroexp.plan.shape)."""
    out = [m for child in module.children() for m in post_order(child, keep)]
    return out + ([module] if keep(module) else [])


class StateTensor(NamedTuple):
    """One rank-local tensor of model state, as an adapter reports it to the state probe.

    ``kind`` is an open set (``param``, ``grad``, ``optim``, ``optim_scalar``; later ``master``...);
    ``logical_numel`` is how many elements of the model's real parameters the tensor stands for (FSDP
    padding excluded), while the probe reads the physical size from the tensor's storage.
    """

    kind: str
    tensor: torch.Tensor
    logical_numel: int


def parameter_state_tensors(model: nn.Module) -> Iterator[StateTensor]:
    """Every parameter of ``model`` as ``param`` and its gradient, when it has one, as ``grad``; every buffer as
    ``buffers``."""
    for p in model.parameters():
        yield StateTensor("param", p.detach(), p.numel())
        if p.grad is not None:
            yield StateTensor("grad", p.grad, p.numel())
    yield from buffer_state_tensors(model)


def buffer_state_tensors(model: nn.Module) -> Iterator[StateTensor]:
    """Every buffer of ``model`` (BatchNorm statistics, masks) as ``buffers``: every strategy keeps them whole."""
    for b in model.buffers():
        yield StateTensor("buffers", b, b.numel())


def buffer_record(model: nn.Module) -> tuple[tuple[str, int], ...]:
    """The buffers of ``model`` as ``Groups.buffers`` holds them: (dtype name, bytes) each, in ``buffers()`` order."""
    return tuple((str(b.dtype).removeprefix("torch."), b.numel() * b.element_size()) for b in model.buffers())


def state_kind(key: str, value: torch.Tensor, param: torch.Tensor) -> str:
    """An optimizer state tensor's kind: ``optim_scalar`` for Adam's ``step`` and any other 0-dim entry of a
    parameter that has dimensions; ``optim`` otherwise (the moments, a 0-dim parameter's too)."""
    return "optim_scalar" if key == "step" or (value.dim() == 0 and param.dim() != 0) else "optim"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer,
                            logical_numel: dict[int, int] | None = None) -> Iterator[StateTensor]:
    """Every tensor in ``optimizer.state``: Adam's ``step`` as ``optim_scalar``, others ``optim`` (:func:`state_kind`).

    ``logical_numel`` maps ``id(param)`` to the param's logical numel when it differs from its numel (a
    padded FSDP shard); element-wise state of that param (same numel, e.g. Adam's moments) takes it too.
    """
    logical_numel = logical_numel or {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                kind = state_kind(key, value, param)
                elementwise = kind == "optim" and value.numel() == param.numel()
                yield StateTensor(kind, value, logical_numel.get(id(param), value.numel()) if elementwise
                                  else value.numel())


class StrategyAdapter:
    """One data-parallel strategy: how to wrap the model and build the optimizer, and what it claims.

    Subclasses set ``name`` (the ``strategy=`` option) and ``schema`` (the dataclass of its ``strategy.*`` keys, its
    entry in zeroexp.cell.strategy, which also names the cell axes that apply to it: ``schema.axes``).
    """

    name: ClassVar[str]
    #: The strategy's config schema (``strategy.*``), registered by zeroexp.config.schemas.register_schemas as
    #: ``schema/strategy/<name>``; its conf/strategy/<name>.yaml extends it.
    schema: ClassVar[type[StrategyConfig]] = StrategyConfig
    #: One sentence: which ZeRO semantics the strategy follows (reported beside the measurements).
    semantics: ClassVar[str] = ""
    #: Warm-up steps before the strategy issues its steady per-step collectives (checked by config.validate).
    min_warmup_steps: ClassVar[int] = 0
    #: The ``offload`` options (conf/offload/: none, optimizer, full) the strategy implements; others are refused.
    offloads: ClassVar[frozenset[str]] = frozenset({"none"})
    #: The ``checkpoint`` kinds (conf/checkpoint/: full, sharded) the adapter saves and loads; config.validate
    #: refuses the others. The default save and load are torch's state-dict API (zeroexp.strategies._checkpoint),
    #: which an adapter overrides only where its state needs its own.
    checkpoint_kinds: ClassVar[frozenset[str]] = frozenset()
    #: The ``checkpoint`` kinds it writes and reads in torch's state-dict layout, the one its checkpoints share with
    #: other strategies: the model's and the optimizer's state keyed by parameter name (``get_state_dict``), whole in
    #: one file (``full``) or through torch.distributed.checkpoint (``sharded``), which reshards it to whatever the
    #: loading strategy holds. A checkpoint of such a kind starts a cell of any strategy that reads its kind, at any
    #: world size (``checkpoint.load_from``, zeroexp.config.moves); empty: its checkpoints are its own.
    moved_kinds: ClassVar[frozenset[str]] = frozenset()
    #: ``dry_run=true`` (zeroexp.rank.dryrun): True when the strategy's own code runs under a fake process group and
    #: ``FakeTensorMode`` (its state and collectives are traced); False when it needs real storage (DDP's C++
    #: Reducer): the dry run then derives the collectives and the state table instead, and says so.
    dry_run_traced: ClassVar[bool] = False

    def __init__(self, policy: CellPolicy) -> None:
        #: The cell's settings the adapter acts on, resolved once (``Cell.policy``, zeroexp.cell); ``config``: its own.
        self.policy = policy
        self.config = self.policy.strategy

    @classmethod
    def validate(cls, cfg: DictConfig) -> None:
        """Refuse settings this strategy cannot run (raise ``zeroexp.errors.ConfigError``)."""

    @classmethod
    def validate_model(cls, cfg: DictConfig, shape: Any = None) -> None:
        """Refuse a model this strategy cannot run as configured (``ConfigError`` naming the key), read on the meta
        device before launch, once the model check passed (``shape``: its shape, zeroexp.formulas.ModelShape, read by
        validation; None where it could not be). Default: nothing."""

    def setup(self, device: torch.device) -> None:
        """Once the process group exists and before any model is built (a dry run calls it before entering
        ``FakeTensorMode``): make what must hold real tensors, e.g. a device mesh. Default: nothing."""

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """Wrap the LightningModule (already on ``device``) for training; called on every rank."""
        raise NotImplementedError

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer over the wrapped module's parameters (AdamW unless the strategy shards it)."""
        return torch.optim.AdamW(params, **self.optimizer_kwargs())

    @property
    def clip_grad_norm(self) -> float | None:
        """The max norm when the strategy clips gradients by their global norm (``strategy.clip_grad_norm``),
        else None; the equivalence reference clips the same way."""
        value = self.config.clip_grad_norm
        return None if value is None else float(value)

    #: ``activation_checkpointing=full``: checkpoint the units after :meth:`wrap` (FSDP1's
    #: ``apply_activation_checkpointing`` on the wrapped model) instead of before it (every other strategy).
    checkpoint_after_wrap: ClassVar[bool] = False

    #: ``init=meta`` (zeroexp.strategies._meta_init): what :meth:`wrap_meta` materialises on each rank of a model
    #: built on the meta device: ``replica`` (every parameter: the strategy keeps a full replica anyway), ``shards``
    #: (only the rank's shards), None (refused by config validation, zeroexp.config.init_mode).
    meta_init: ClassVar[str | None] = "replica"

    def wrap_cell(self, module: nn.Module, device: torch.device) -> nn.Module:
        """:meth:`wrap` (:meth:`wrap_meta` for a model built on the meta device, ``init=meta``), with the units
        checkpointed (``activation_checkpointing``) before or after it."""
        from zeroexp.strategies._meta_init import is_meta

        meta = is_meta(module)
        if not self.checkpoint_after_wrap:
            self.checkpoint_activations(module)
        model = self.wrap_meta(module, device) if meta else self.wrap(module, device)
        if self.checkpoint_after_wrap:
            self.checkpoint_activations(model)
        return model

    def wrap_meta(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``init=meta``: wrap ``module``, built on the meta device, with the full build's values on this rank.
        Default (``meta_init = "replica"``): every parameter materialised on the rank, then :meth:`wrap`."""
        from zeroexp.strategies._meta_init import fill_replica

        fill_replica(module, device, self.policy)
        return self.wrap(module, device)

    def checkpoint_activations(self, module: nn.Module) -> None:
        """``activation_checkpointing``: replace the wrap units of ``module`` (``strategy.wrap``, else
        ``model.wrap``) its mode checkpoints by torch's ``checkpoint_wrapper`` (``torch.utils.checkpoint``,
        non-reentrant; ``selective_op`` with its policy): forward keeps the unit's input (and what the policy saves),
        backward recomputes the rest (:func:`zeroexp.models.checkpoint_units`). Nothing for ``none``."""
        if not self.policy.activation_checkpointing:
            return
        from zeroexp.models import checkpoint_units, import_class

        checkpoint_units(module, tuple(import_class(p) for p in self.policy.wrap), self.policy.activation_checkpointing)

    def no_sync(self, model: nn.Module) -> Any:
        """The context of the first K-1 micro-batches of ``grad_accum=K`` (forward and backward): gradients
        accumulate locally and the K-th reduces them. Default: DDP's ``no_sync``; nothing for a model that is not
        DDP (the strategy reduces once per optimizer step by itself, or overrides this)."""
        from contextlib import nullcontext

        from torch.nn.parallel import DistributedDataParallel

        return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()

    def clip_gradients(self, model: nn.Module) -> None:
        """Clip the gradients of the wrapped ``model`` to the global norm ``strategy.clip_grad_norm`` (nothing when
        null), after backward and any fp16 unscaling, before the optimizer step (Lightning's
        ``configure_gradient_clipping``). Default: ``torch.nn.utils.clip_grad_norm_`` over gradients every rank holds
        in full (DDP's, all-reduced already): no collective. Sharded strategies override it."""
        if self.clip_grad_norm is not None:
            self.took_grad_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm))

    #: The total gradient norm the strategy's clipping took in the step just taken (a 0-dim tensor), where kept.
    _clip_norm: Any = None
    _keep_norm: bool = False

    def keep_grad_norm(self, model: nn.Module, keep: bool) -> None:
        """Whether the norm the strategy takes in the coming step is kept until :meth:`step_grad_norm` reads it: a
        0-dim tensor alive past the clipping, which the gradient-norm probe keeps through no memory-tracked step (it
        would count there)."""
        self._keep_norm = keep

    def took_grad_norm(self, norm: Any) -> None:
        """The strategy's clipping took ``norm``: kept where :meth:`keep_grad_norm` asked for it."""
        self._clip_norm = norm if self._keep_norm else None

    @property
    def computes_grad_norm(self) -> bool:
        """Whether the strategy computes the total gradient norm itself every step (:meth:`step_grad_norm`). Default:
        where it clips by the global norm (``strategy.clip_grad_norm``)."""
        return self.clip_grad_norm is not None

    def step_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """The total gradient norm, before clipping, the strategy computed in the step just taken (a number or a 0-dim
        tensor), without computing or sending anything, and no longer kept; None where it computed none or did not
        keep it (:meth:`keep_grad_norm`; the gradient-norm probe takes :meth:`grad_norm` where it computes none).
        Default: its clipping's (:meth:`clip_gradients`)."""
        norm, self._clip_norm = self._clip_norm, None
        return norm if self.computes_grad_norm else None

    #: Why :meth:`grad_norm` cannot be taken between backward and the optimizer step (the gradients are not whole
    #: anywhere yet); None: it can.
    grad_norm_unavailable: str | None = None

    def grad_norm(self, model: nn.Module) -> Any:
        """The total norm of the gradients now (after backward and their reduction, before clipping and the step),
        taken the way the strategy's clipping takes it: a collective where the gradients are sharded, so call it on
        every rank; not where :attr:`grad_norm_unavailable` says why not. Default:
        the whole gradient every rank holds (DDP's, all-reduced already): ``torch.nn.utils.get_total_norm``, no
        collective."""
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], 2.0)

    def optimizer_kwargs(self) -> dict[str, Any]:
        return self.policy.optimizer.kwargs()

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """Where this rank keeps its model state now: parameters, their gradients, the optimizer's tensors.

        ``model`` is the wrapped model, ``optimizer`` the one :meth:`make_optimizer` built. Yield each
        piece of state once; tensors that share a storage (views, buckets) are deduplicated by the probe.
        """
        yield from parameter_state_tensors(model)
        yield from optimizer_state_tensors(optimizer)

    def current_loss_scale(self) -> float | None:
        """The dynamic loss scale now (fp16): by default that of the GradScaler in the Lightning precision
        plugin the adapter installed; strategies that scale the loss themselves override this. None without."""
        plugin = getattr(getattr(self, "_lightning_strategy", None), "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        return float(scaler.get_scale()) if scaler is not None else None

    def known_divergence(self, ungraded: list[str]) -> tuple[str, str] | None:
        """Why this cell's training is known to leave the unsharded reference's, as ``(code, sentence)`` (the
        equivalence section's ``cause`` and ``why``), given the trainable parameters the reference's step gives no
        gradient (``ungraded``, by name); None: none known (the default)."""
        return None

    def beyond_canonical(self) -> dict[str, str]:
        """State kinds the strategy keeps beyond the canonical fp32 formula (param, grad, two moments [ZeRO 5.1])
        and in which tensors, e.g. ``{"master": "fp32 partition ..."}``; the state probe reports their bytes."""
        return {}

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """The live groups that decide what this rank keeps and sends (``zeroexp.formulas.Groups``), read off the
        wrapped ``model`` and its ``optimizer``: buckets, units, owners, partitions, as plain data. The expectation
        model (``zeroexp.formulas``, row ``strategy.layout``) turns them into bytes and collectives; the planner
        derives the same groups from shapes. Issues no collective; raise ``NotImplementedError`` with the reason
        when the strategy's structure is not modelled for this cell."""
        raise NotImplementedError(f"strategy {self.name!r} reports no groups")

    def live_groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """:meth:`groups`, with the module's buffers (which every strategy keeps whole on each rank) where the adapter
        did not report them."""
        from dataclasses import replace

        g = self.groups(model, optimizer)
        return g if g.buffers else replace(g, buffers=buffer_record(model))

    def mesh_dims(self) -> dict[str, str]:
        """The device-mesh dimension each of the strategy's own process groups stands for, by group name
        (``ProcessGroup.group_name``), e.g. hybrid sharding's ``shard`` and ``replicate``; the collectives probe names
        each op's group with it. Empty: the strategy uses the default group (``world``) only."""
        return {}

    @property
    def layout(self) -> str:
        """The expectation model's row this strategy follows (``strategy.layout`` in its YAML)."""
        return str(self.config.layout or self.name)

    @staticmethod
    def trainable(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters that train, in definition order, a shared one once (``Groups.numels``)."""
        return [p for p in params if p.requires_grad]

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """Every parameter of the wrapped ``model`` at full size, by its name in the wrapped LightningModule.

        A collective for strategies that shard parameters: enter it on every rank. The tensors are valid
        only inside the context and must not be modified. Default: a model that is not wrapped at all.
        """
        with torch.no_grad():
            yield {name: p.detach() for name, p in model.named_parameters()}

    def checkpoint_format(self, kind: str) -> str:
        """One sentence: how this strategy writes a ``kind`` checkpoint (reported in ``summary.json``). Default: the
        state-dict API's (:meth:`save_checkpoint`)."""
        if kind == "full":
            return ("get_state_dict(full_state_dict, cpu_offload): the model and optimizer state made whole on rank 0, "
                    "which writes it to one file")
        return ("torch.distributed.checkpoint of get_state_dict's state: each rank writes its items (a tensor the "
                "ranks hold alike once, DCP's deduplication), __<rank>_0.distcp; rank 0 the .metadata")

    def full_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state whole on rank 0, on the CPU, keyed by parameter name (the other ranks:
        empty dicts): what a ``full`` checkpoint writes. A collective: call it on every rank. Default: torch's
        ``get_state_dict(full_state_dict, cpu_offload)``."""
        from zeroexp.strategies._checkpoint import full_state_dicts

        return full_state_dicts(model, optimizer)

    @classmethod
    def unreadable(cls, kind: str, path: Path) -> str | None:
        """Why :meth:`read_whole` cannot read the ``kind`` checkpoint at ``path`` offline (None: it can):
        ``python -m zeroexp.checkpoint convert``'s refusal of a source. Default: a kind outside :attr:`moved_kinds`
        is a layout of its own."""
        return None if kind in cls.moved_kinds else f"a {kind} checkpoint of {cls.name} is in a layout of its own"

    @classmethod
    def read_whole(cls, kind: str, path: Path) -> dict:
        """``{"model": ..., "optim": ...}`` of a ``kind`` checkpoint in torch's state-dict layout (:attr:`moved_kinds`),
        whole, on the CPU, in this process alone (no collective): what a moved state is checked against and what the
        unsharded reference starts from. Default: that layout's files
        (:func:`zeroexp.strategies._checkpoint.read_whole`)."""
        from zeroexp.strategies._checkpoint import read_whole

        return read_whole(kind, path)

    def save_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
        """Write the wrapped ``model``'s and ``optimizer``'s state as a ``kind`` checkpoint into the existing
        directory ``path``; return the files this rank wrote. A collective: call it on every rank. Default: torch's
        state-dict API (``get_state_dict``; full: :func:`~zeroexp.strategies._checkpoint.save_full`, sharded: DCP)."""
        from zeroexp.strategies._checkpoint import save_state_dicts

        return save_state_dicts(kind, path, model, optimizer)

    def load_checkpoint(self, kind: str, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Restore a :meth:`save_checkpoint` directory into a freshly wrapped ``model`` and its ``optimizer``
        (same strategy, same world size). A collective: call it on every rank. Default: ``set_state_dict`` of
        what :meth:`save_checkpoint` wrote (full: every rank reads the one file and keeps its part)."""
        from zeroexp.strategies._checkpoint import load_state_dicts

        load_state_dicts(kind, path, model, optimizer)

    def train_step(self, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer,
                   batch: torch.Tensor) -> None:
        """One step outside Lightning (the checkpoint probe's continuation step): forward through the wrapped
        ``model``, ``loss_fn(output, batch)``, backward, optimizer step. A collective: call it on every rank."""
        optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss_fn(model(batch), batch).backward()
        self.clip_gradients(model)
        optimizer.step()

    def settle_restored(self, model: nn.Module, loss_fn: Any, batch: torch.Tensor) -> None:
        """Before a restored ``model``'s first step is compared with the trained model's (the checkpoint probe's
        continuation): redo what the trained model's first step changed in the wrapper itself, which no checkpoint
        holds. Default: nothing. A collective where it runs one: call it on every rank."""

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        """The Lightning strategy that runs this adapter."""
        from zeroexp.strategies._lightning import CellStrategy

        self._lightning_strategy = CellStrategy(adapter=self, timeout=timedelta(seconds=timeout_s),
                                                process_group_backend=backend)
        return self._lightning_strategy
