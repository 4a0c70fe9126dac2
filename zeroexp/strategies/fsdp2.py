"""FSDP2 (``fully_shard``): every parameter a DTensor sharded on dim 0, one unit per wrapped module class.

``fully_shard`` is applied to each module of a wrapped class (``strategy.wrap``, else ``model.wrap``: the same
rule as FSDP1, :func:`zeroexp.models.wrap_paths`), children before parents, then to the root. A unit
all-gathers its parameters in one ``all_gather_into_tensor`` and reduce-scatters their gradients in one
``reduce_scatter_tensor``. Unlike FSDP1 there is no FlatParameter: each parameter is chunked on dim 0 and every
chunk is padded to the first's size (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so the padding is per
parameter, ``ceil(dim0 / N) * N`` rows. ``reshard_after_forward=True`` (``fsdp2_full``, ZeRO-3 direction)
frees each unit after forward and gathers it again in backward, the root included: passed explicitly, FSDP2
does not exempt the root (``FSDPState._lazy_init`` clears ``post_forward_mesh_info`` only when the flag was
left unset). ``False`` (``fsdp2_grad_op``) keeps the unsharded parameters until the end of backward. An int k
(``fsdp2_full``, ZeRO++'s hpZ) keeps each unit's 1/k after forward, the root too, and backward all-gathers it from k
ranks: each ``fully_shard`` call makes its own ``DeviceMesh`` of k-rank rows (``_get_post_forward_mesh_info``), so
every unit has a post-forward process group of its own (:meth:`FSDP2Adapter.mesh_dims` names them ``post_forward``).
``strategy.reshard_policy`` (torchtitan's) sets ``reshard_after_forward`` unit by unit instead
(:meth:`FSDP2Adapter.reshard_per_unit`): ``always`` True, ``never`` False, ``default`` every unit but the last True,
the last False and the root None (FSDP2's default: kept).
The device mesh is made on the rank's device type (``init_device_mesh("cpu", (N,))`` with gloo) in
:meth:`FSDP2Adapter.setup`, before any model exists (a dry run enters ``FakeTensorMode`` after it).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from zeroexp.devices import ranks_get_a_gpu
from zeroexp.errors import ConfigError, NotApplicableHere
from zeroexp.formulas import LAYOUTS, POST_FORWARD, Groups, Shard, fsdp2_padded_numel
from zeroexp.strategies import register
from zeroexp.strategies._unit_trace import UnitTrace
from zeroexp.strategies.base import StateTensor, StrategyAdapter, buffer_state_tensors, post_order, state_kind
from zeroexp.models import import_class, torch_dtype
from zeroexp.strategies.fsdp import FSDPAdapter
from zeroexp.cell.policy import CellPolicy
from zeroexp.cell.strategy import (FSDP2Config, FSDP2FullConfig, check_fsdp2_dtype, check_fsdp2_prefetch,
                                   check_fsdp2_reshard, check_reshard_policy)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of FSDP2's padded shard storage); any other tensor as it is."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # to_local() without autograd: the DTensor's own local tensor, not a view of it
        return t.to_local()


def _param_group(module: nn.Module) -> Any:
    """The FSDP2 parameter group of a ``fully_shard`` unit that holds parameters; None for any other module."""
    from zeroexp._lib.fsdp2 import fsdp2_param_group

    return fsdp2_param_group(module)


def _post_forward_size(group: Any) -> int:
    """The ranks an FSDP2 parameter group is resharded to after forward when that is a group of its own
    (``reshard_after_forward=k``: ``post_forward_mesh_info`` is not its ``mesh_info``), else 0."""
    post = group.post_forward_mesh_info
    k = 0 if post is None or post is group.mesh_info else int(post.shard_mesh_size)
    return k if k < group.mesh_info.shard_mesh_size else 0


def _param_groups(model: nn.Module) -> Iterator[Any]:
    """Every FSDP2 parameter group (one per ``fully_shard`` unit that holds parameters) under ``model``."""
    return (g for g in map(_param_group, model.modules()) if g is not None)


class FSDP2Adapter(StrategyAdapter):
    """Shared FSDP2 wrapping; subclasses fix ``reshard_after_forward``."""

    reshard_after_forward: bool
    schema = FSDP2Config
    #: bf16 / fp16 through ``MixedPrecisionPolicy`` (gathered, computed and reduced in the low precision, fp32
    #: shards); fp16 adds a dynamic ``ShardedGradScaler`` (zeroexp.strategies._amp), whose inf check runs on each
    #: rank's gradient shards (DTensors) and all-reduces found_inf, as with FSDP1.
    dry_run_traced = True
    checkpoint_kinds = frozenset({"full", "sharded"})  # torch's state-dict API (DTensors): the default trio
    moved_kinds = frozenset({"full", "sharded"})

    def __init__(self, policy: CellPolicy) -> None:
        super().__init__(policy)
        self._mesh: Any = None
        self._root: nn.Module | None = None  # the wrapped model (mesh_dims reads its units' groups)

    #: offload=full: ``CPUOffloadPolicy()`` (the sharded parameters, their gradients and the optimizer state on the
    #: host, each unit copied to the device to be all-gathered); needs an accelerator to compute on.
    offloads = frozenset({"none", "full"})

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.offload.name == "full" and not ranks_get_a_gpu(cfg):
            raise NotApplicableHere("offload", "full", "none (on this machine)", why=(
                "FSDP2's CPUOffloadPolicy keeps the shards in pinned host memory and copies each unit to the device "
                "to compute; this cell runs on the CPU (no GPU for each rank): pinning raises 'Cannot access "
                "accelerator device when none is available' (torch 2.13), and without pinning nothing would move"))
        FSDPAdapter.validate(cfg)  # the wrap classes must import, as for FSDP1
        back = cfg.strategy.get("backward_prefetch")
        check_fsdp2_prefetch(cfg.strategy.forward_prefetch, back)
        for key in ("reduce_dtype", "output_dtype"):
            check_fsdp2_dtype(f"strategy.{key}", cfg.strategy.get(key))
        reduce, compute = cfg.strategy.get("reduce_dtype"), str(cfg.precision.param_dtype)
        if reduce not in (None, "float32", compute):
            raise ConfigError("strategy.reduce_dtype", reduce, f"null, float32, {compute} (precision.param_dtype)",
                              why="a reduction below the compute dtype has no model in zeroexp's expectation (the "
                                  "gradients' cast before the reduce-scatter, the peak) yet")
        policy = cfg.strategy.get("reshard_policy")
        # fsdp2_full's own reshard_after_forward beside it: FSDP2FullAdapter.validate
        check_reshard_policy(policy, cls.name, reshards=cls.reshard_after_forward is not False)
        if back is not None and (cls.reshard_after_forward is False or policy == "never"):
            raise ConfigError("strategy.backward_prefetch", back, "null",
                              why=f"strategy={cls.name}" + (" with strategy.reshard_policy=never" if policy else "")
                                  + " keeps every unit unsharded from forward to backward: backward gathers nothing "
                                  "to prefetch")

    def mesh_dims(self) -> dict[str, str]:
        """``post_forward`` for each unit's post-forward process group (``reshard_after_forward=k``: FSDP2 makes a
        ``DeviceMesh`` of k-rank rows for each ``fully_shard`` call, so one group per unit); none otherwise."""
        root = getattr(self._root, "net", self._root)
        return {g.post_forward_mesh_info.shard_process_group.group_name: POST_FORWARD
                for g in (_param_groups(root) if root is not None else ()) if _post_forward_size(g)}

    def setup(self, device: torch.device) -> None:
        """The 1-D device mesh over the default group, on the rank's device type (``cpu`` with gloo)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device.type, (dist.get_world_size(),))

    def mp_policy(self, root: bool = False) -> Any:
        """``MixedPrecisionPolicy``: compute in the precision's ``param_dtype``; fp32 shards; reduce in
        ``strategy.reduce_dtype`` (null: the compute dtype); the ``root``'s outputs cast to ``strategy.output_dtype``
        (null: none). Only the root's: a unit's cast outputs would reach the root's own modules (a final norm) in a
        dtype other than their parameters' (torch: "mixed dtype (CPU)"), as torchtitan sets it on the root alone."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = torch_dtype(self.policy.precision.param_dtype)
        reduce, output = self.config.reduce_dtype, self.config.output_dtype if root else None
        return MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype,
                                    reduce_dtype=None if reduce is None else torch_dtype(reduce),
                                    output_dtype=None if output is None else torch_dtype(output))

    def offload_policy(self) -> Any:
        """``CPUOffloadPolicy()`` (pinned host shards) for ``offload=full``, else FSDP2's ``OffloadPolicy()``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy() if self.policy.offload == "full" else OffloadPolicy()

    def lightning_strategy(self, timeout_s: float, backend: str) -> Any:
        """CellStrategy; for fp16, Lightning's mixed-precision plugin with a ``ShardedGradScaler``."""
        from zeroexp.strategies._amp import with_sharded_scaler

        return with_sharded_scaler(super().lightning_strategy(timeout_s, backend), self.policy.precision, backend)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` on the root ``fully_shard`` module (every unit: unsharded
        gradients accumulate, no reduce_scatter) unless ``strategy.sync_each_microbatch``."""
        root = getattr(model, "net", model)
        if self.config.sync_each_microbatch:
            yield
            return
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def clip_gradients(self, model: nn.Module) -> None:
        """``torch.nn.utils.clip_grad_norm_`` as torchtitan runs it on FSDP2's DTensor gradients: each rank's norm of
        its shards (a partial DTensor), ``full_tensor()`` (one fp32 all_reduce of the squared norms), then every shard
        scaled by ``max_norm / (norm + 1e-6)``, at most 1 (``clip_grads_with_norm_``)."""
        if self.clip_grad_norm is None:
            return
        params = [p for p in model.parameters() if p.grad is not None]
        norm = self.grad_norm(model)
        torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad_norm, norm)
        self.took_grad_norm(norm)

    def grad_norm(self, model: nn.Module) -> Any:
        """``get_total_norm`` of the DTensor gradients (a partial DTensor over the shard dimension), ``full_tensor()``:
        one fp32 all_reduce of the squared norms over the shard group, as :meth:`clip_gradients` takes it."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None], 2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def wrap(self, module: nn.Module, device: torch.device) -> nn.Module:
        """``fully_shard`` each module of a wrapped class, innermost first, then the root; returns ``module``.

        The root is the user's model (``CellModule.net``), not the LightningModule: Lightning calls
        ``training_step`` directly on a module it does not see wrapped, so only the model's own ``forward``
        runs FSDP2's root hooks (lazy init, the root's unshard and reshard).
        """
        from torch.distributed.fsdp import fully_shard

        self.setup(device)
        root = getattr(module, "net", module)
        classes = tuple(import_class(p) for p in self.policy.wrap)
        kwargs = {"mesh": self._mesh, "mp_policy": self.mp_policy(), "offload_policy": self.offload_policy()}
        units = [m for m in root.modules() if classes and isinstance(m, classes) and m is not root]
        reshard = self.reshard_per_unit(units)
        for unit in reversed(units):  # reversed pre-order: every child before its parent
            fully_shard(unit, **kwargs, reshard_after_forward=reshard[id(unit)])
        fully_shard(root, **{**kwargs, "mp_policy": self.mp_policy(root=True)}, reshard_after_forward=reshard[None])
        self._explicit_prefetch(units)
        self._trace = UnitTrace(root, [*units, root])
        self._root = root
        return module

    def reshard_per_unit(self, units: list[nn.Module]) -> dict[int | None, bool | int | None]:
        """Each unit's ``reshard_after_forward`` by ``id`` (the root's under the key None): the strategy's own for all
        without ``strategy.reshard_policy``; else torchtitan's policy (zeroexp.cell.strategy.RESHARD_POLICIES): under
        ``default`` the last unit (the last in forward order not inside another unit: the last transformer block)
        False, the others True, the root None (FSDP2's default: kept)."""
        policy = self.config.reshard_policy
        value = {None: self.reshard_after_forward, "always": True, "never": False, "default": True}[policy]
        out: dict[int | None, bool | int | None] = {id(u): value for u in units}
        inside = {id(m) for u in units for m in u.modules() if m is not u}
        tops = [u for u in units if id(u) not in inside]
        if policy == "default" and tops:
            out[id(tops[-1])] = False
        out[None] = None if policy == "default" else value
        return out

    def _explicit_prefetch(self, units: list[nn.Module]) -> None:
        """``strategy.forward_prefetch`` / ``backward_prefetch``: each wrapped unit (in definition order, a stack's
        forward order) prefetches the next / previous that many, as PyTorch's test_fully_shard_comm.py sets them on
        its Transformer's blocks (``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``)."""
        ahead, back = int(self.config.forward_prefetch), self.config.backward_prefetch
        for i, unit in enumerate(units):
            if ahead and i + 1 < len(units):
                unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + ahead])
            if back and i:
                unit.set_modules_to_backward_prefetch(units[max(i - back, 0):i][::-1])

    #: init=meta: ``fully_shard`` on the meta model, ``to_empty`` (each rank allocates only its shards), then every
    #: shard filled with the full build's values (zeroexp.strategies._meta_init).
    meta_init = "shards"

    def wrap_meta(self, module: nn.Module, device: torch.device) -> nn.Module:
        from zeroexp.strategies._meta_init import fill_dtensors

        model = self.wrap(module, device)
        root = getattr(model, "net", model)
        root.to_empty(device=device)
        fill_dtensors(root, self.policy)
        return model

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[StateTensor]:
        """Each parameter's local shard and its gradient's, the optimizer's tensors, any unsharded buffer left.

        A shard's storage is FSDP2's padded chunk (physical); its logical numel is the rows this rank really
        holds (the last ranks hold fewer, or none). Gradient shards are views into the unit's reduce-scatter
        output. Adam's moments are DTensors of the local (unpadded) shard's size. ``param_unsharded``: a unit's
        all-gather output, reported only while its storage is allocated (FSDP2 frees it on reshard).
        """
        for p in model.parameters():
            local = _local(p.detach())
            yield StateTensor("param", local, local.numel())
            if p.grad is not None:
                grad = _local(p.grad)
                yield StateTensor("grad", grad, grad.numel())
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value = _local(value)
                    yield StateTensor(state_kind(key, value, param), value, value.numel())
        for group in _param_groups(model):
            for fsdp_param in group.fsdp_params:
                for out in fsdp_param.all_gather_outputs:
                    if out.untyped_storage().nbytes() > 0:
                        yield StateTensor("param_unsharded", out, fsdp_param.sharded_param.shape.numel())
        yield from buffer_state_tensors(model)

    def groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Groups:
        """Every parameter sharded on its own, dim 0 chunked and padded (``fsdp2_padded_numel``) [FSDP2]; each unit
        with parameters, children before parents: one all_gather of its padded parameters, twice when it is resharded
        after forward (``post_forward_mesh_info``), and one reduce_scatter."""
        world, params = dist.get_world_size(), list(model.parameters())
        n = self._mesh.size(-1)  # the ranks each parameter is sharded over: the mesh's last (shard) dimension

        def shard(p: nn.Parameter) -> Shard:
            return Shard(((0, p.numel()),), fsdp2_padded_numel(tuple(p.shape), n))

        shards = tuple(shard(p) for p in params if p.numel())
        frozen = tuple(p.numel() for p in params if not p.requires_grad)
        # read after a step's backward: a trainable parameter without a gradient got none (forward never used it)
        graded = [p.requires_grad and p.grad is not None for p in params]
        trained = [p for p in params if p.requires_grad]
        ungraded = tuple(i for i, p in enumerate(trained) if p.grad is None)
        units, narrow = [], 0
        for module in post_order(model, lambda m: _param_group(m) is not None):
            group = _param_group(module)
            sizes = [(fsdp2_padded_numel(tuple(q.sharded_param.shape), n),
                      q.sharded_param.requires_grad and q.sharded_param.grad is not None) for q in group.fsdp_params]
            calls, reached, after = self._trace.of(module) or (1, True, True)
            post = _post_forward_size(group)
            narrow = post or narrow
            units.append(LAYOUTS[self.layout].family.unit(
                sum(k for k, _ in sizes), 2 if group.post_forward_mesh_info is not None else 1, calls, reached,
                sum(k for k, t in sizes if t), after, narrow=bool(post)))
        return Groups(self.layout, world, tuple(p.numel() for p in trained), shards, tuple(units),
                      shard_size=n if n != world else 0, frozen=frozen, ungraded=ungraded, post_forward_size=narrow,
                      grad_shards=tuple(shard(p) for p, g in zip(params, graded) if p.numel() and g)
                      if frozen or ungraded else None)

    @contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
        """``DTensor.full_tensor()`` of every parameter: one all_gather each, so enter it on every rank."""
        with torch.no_grad():
            yield {name: p.full_tensor() if isinstance(p, DTensor) else p.detach()
                   for name, p in model.named_parameters()}


@register
class FSDP2FullAdapter(FSDP2Adapter):
    name = "fsdp2_full"
    schema = FSDP2FullConfig
    semantics = (
        "FSDP2 fully_shard, reshard_after_forward=True (ZeRO-3 direction): parameters, gradients and optimizer "
        "state sharded per parameter on dim 0; each unit, the root included, is all-gathered before forward and "
        "again before backward (with strategy.reshard_after_forward=null, FSDP2's default, the root is kept "
        "unsharded from its forward to its backward: gathered once; with an int k, ZeRO++'s hpZ, each unit keeps "
        "1/k of itself after forward and backward all-gathers it from a group of k ranks)."
    )

    @property
    def reshard_after_forward(self) -> bool | int | None:  # type: ignore[override]
        return self.config.reshard_after_forward

    @classmethod
    def validate(cls, cfg) -> None:
        check_fsdp2_reshard(cfg.strategy.reshard_after_forward, [int(cfg.world_size)])
        check_reshard_policy(cfg.strategy.get("reshard_policy"), cls.name,
                             reshard_after_forward=cfg.strategy.reshard_after_forward)
        super().validate(cfg)


@register
class FSDP2GradOpAdapter(FSDP2Adapter):
    name = "fsdp2_grad_op"
    reshard_after_forward = False
    semantics = (
        "FSDP2 fully_shard, reshard_after_forward=False: gradients and optimizer state sharded; parameters "
        "resharded after backward, so at the optimizer boundary the parameter factor is 1, unlike canonical "
        "ZeRO-2 which keeps parameters replicated."
    )
