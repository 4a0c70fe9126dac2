"""Activations traced, not guessed: what one forward keeps for backward, per FSDP unit, for any ``nn.Module``.

The model is built under ``FakeTensorMode`` on the cell's device (not the meta device: for attention the meta
device takes the math path, which saves the s^2 probabilities, where the CPU and CUDA kernels save a logsumexp) and
one forward and the loss run at the per-rank batch and the model's input shape. ``saved_tensors_hooks`` see every
tensor autograd saves; a storage is counted once however often it is saved, parameters and their views are not
activations. Attribution: to the innermost FSDP unit (a module of a ``wrap`` class) whose forward is running, else to
the root. The forward's output and the loss are held too, whether saved or not (``held_bytes``). Nothing is allocated:
a fake tensor has a shape, a dtype and a storage size, no data.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198, section 4.1:
a transformer layer saves 34 s b h + 5 a s^2 b bytes with 2-byte activations (s sequence, b batch, h hidden, a heads);
:func:`korthikanti_layer_bytes` gives it beside the trace for GPT configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from zeroexp._lib.storages import storage_address

__all__ = ["ActivationTrace", "FakeBuild", "fake_build", "trace_activations", "korthikanti_layer_bytes"]


@dataclass
class ActivationTrace:
    """One forward's saved activations at a per-rank batch: per unit (``unit_bytes``, units in the order their
    forward started, the root last) and in total; ``held_bytes``: the output and the loss; ``batch_size``."""

    batch_size: int
    unit_bytes: dict[str, int] = field(default_factory=dict)
    held_bytes: int = 0
    tensors: int = 0
    #: Each unit's input (its tensor arguments' storages, the first time one is seen): what a checkpointed unit keeps.
    #: Every unit is in it, in the order its forward started (0 where its input was seen before).
    unit_input_bytes: dict[str, int] = field(default_factory=dict)
    #: Traced with a selective policy (``activation_checkpointing=selective_op``): per unit, the outputs of the ops
    #: the policy saves that are no unit's input (what a checkpointed unit keeps besides its input); else empty.
    unit_policy_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        return sum(self.unit_bytes.values())

    @property
    def total_bytes(self) -> int:
        """What one forward holds at its end: everything saved for backward, plus the output and the loss."""
        return self.saved_bytes + self.held_bytes


@dataclass(frozen=True)
class FakeBuild:
    """A model config's module built on fake tensors of ``device`` in its own ``FakeTensorMode`` (``mode``), its
    floating parameters and buffers cast to ``module_dtype`` (None: as built): what :func:`trace_activations` runs."""

    mode: Any
    net: torch.nn.Module
    device: str
    module_dtype: torch.dtype | None


def fake_build(model_cfg: Mapping[str, Any], device: str = "cpu",
               module_dtype: torch.dtype | None = None) -> FakeBuild:
    """Build the model config's module under a new ``FakeTensorMode`` on ``device`` (nothing allocated), cast to
    ``module_dtype`` below fp32 (``.data``: as ``trace_step`` casts them)."""
    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp.models import build_model

    mode = fake_tensor_mode()
    with mode, torch.device(device):
        net = build_model(model_cfg)
        cast = cast_module(net, module_dtype)
    return FakeBuild(mode, net, device, cast)


def cast_module(net: torch.nn.Module, module_dtype: torch.dtype | None) -> torch.dtype | None:
    """Cast ``net``'s floating parameters and buffers to ``module_dtype`` below fp32 (``.data``: as ``trace_step``
    casts them); the dtype cast to (None: none, fp32 or no dtype)."""
    if module_dtype in (None, torch.float32):
        return None
    for t in [*net.parameters(), *net.buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(module_dtype)
    return module_dtype


def trace_activations(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), device: str = "cpu",
                      dtype: torch.dtype | None = None, module_dtype: torch.dtype | None = None,
                      build: FakeBuild | None = None, policy: Any = None) -> ActivationTrace:
    """Build the model config's module under ``FakeTensorMode`` on ``device``, run one forward and the loss at
    ``batch_size`` samples of ``model.input_shape``, and count what autograd saves, per unit of a ``wrap`` class.
    ``dtype``: the compute dtype (autocast on ``device``; None or fp32: the model's own); ``module_dtype``: the
    module's floating parameters, buffers and input cast to it instead (as zeroexp's ZeRO, FSDP and DeepSpeed
    compute below fp32). ``build``: the module already built (:func:`fake_build` of the same config, device and
    ``module_dtype``) to run instead of building one: what is counted is what the forward saves and holds, never
    the module's own tensors, so several batches traced on one build count what fresh builds do
    (tests/test_activations.py, on the corpus of foreign models). ``policy``: a selective
    :class:`~zeroexp.formulas.peak.checkpointing.Checkpointing` whose per-op policy is counted too
    (``unit_policy_bytes``: the outputs it would save, its matmuls counted per unit as torch's checkpoint counts them
    per checkpointed call)."""
    from contextlib import nullcontext

    from zeroexp.models import loss_of, zeros_batch

    cast_to = module_dtype if module_dtype not in (None, torch.float32) else None
    build = build or fake_build(model_cfg, device, module_dtype)
    if (build.device, build.module_dtype) != (device, cast_to):
        raise ValueError(f"a build on {build.device} in {build.module_dtype} traced as {device} in {cast_to}")
    from zeroexp.models import unit_classes

    classes = unit_classes(wrap)
    trace = ActivationTrace(batch_size=int(batch_size))
    stack: list[str] = ["root"]
    # storages are told apart by address: every tensor counted is held here until the trace ends, so that no
    # address is reused by a later tensor within it (a unit's input that autograd does not save dies at once)
    held: list[torch.Tensor] = []
    seen: set[Any] = set()
    with build.mode, torch.device(device):
        net = build.net
        names = {id(m): name or "root" for name, m in net.named_modules()}
        params = {_key(p) for p in net.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _key(t)
            if key not in seen and key not in params:
                seen.add(key)
                held.append(t)
                trace.unit_bytes[stack[-1]] = trace.unit_bytes.get(stack[-1], 0) + t.untyped_storage().nbytes()
                trace.tensors += 1
            return t

        inputs: set[Any] = set()  # the units' inputs' storages

        def enter(m: torch.nn.Module, args: Any) -> None:
            name = names[id(m)]
            stack.append(name)
            trace.unit_input_bytes.setdefault(name, 0)
            for t in (a for a in args if isinstance(a, torch.Tensor)):
                if _key(t) not in inputs:
                    inputs.add(_key(t))
                    held.append(t)
                    trace.unit_input_bytes[name] = trace.unit_input_bytes.get(name, 0) + t.untyped_storage().nbytes()

        units = [m for m in net.modules() if classes and isinstance(m, classes)]
        hooks = [m.register_forward_pre_hook(enter) for m in units]
        hooks += [m.register_forward_hook(lambda m, a, o: stack.pop() and None) for m in units]  # None: output kept
        batch = zeros_batch(model_cfg, batch_size)
        cast = torch.autocast(device, dtype=dtype) if dtype not in (None, torch.float32) else nullcontext()
        counting = _policy_counter(policy, stack, inputs, held, trace) if policy is not None else nullcontext()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast, counting:
                out = net(batch.to(module_dtype) if module_dtype is not None and batch.is_floating_point() else batch)
                loss = loss_of(model_cfg)(out, batch)
        finally:
            for h in hooks:
                h.remove()
        for t in (getattr(out, "logits", out), loss):  # held by the step until backward, saved or not
            if _key(t) not in seen:
                seen.add(_key(t))
                trace.held_bytes += t.untyped_storage().nbytes()
    order = {n: i for i, n in enumerate(names.values())}
    trace.unit_bytes = dict(sorted(trace.unit_bytes.items(), key=lambda kv: (kv[0] == "root", order.get(kv[0], 0))))
    return trace


def _policy_counter(policy: Any, stack: list[str], inputs: set[Any], held: list[torch.Tensor],
                    trace: ActivationTrace) -> Any:
    """A dispatch mode that adds to ``trace.unit_policy_bytes`` the output storages of the ops ``policy`` saves
    inside a unit (``stack[-1]``; never the root's, which is not checkpointed), each once, no unit's input."""
    from zeroexp._lib.dispatch import dispatch_mode_base
    from zeroexp.formulas.peak.checkpointing import MATMULS
    from zeroexp.models.sac import op_name

    matmuls: dict[str, int] = {}
    seen: set[Any] = set()

    def tensors(out: Any) -> list[torch.Tensor]:
        if isinstance(out, torch.Tensor):
            return [out]
        return [t for o in out for t in tensors(o)] if isinstance(out, (list, tuple)) else []

    class Count(dispatch_mode_base()):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            unit, name = stack[-1], op_name(func)
            if unit == "root" or name is None:
                return out
            if name in MATMULS:
                matmuls[unit] = matmuls.get(unit, 0) + 1
            if policy.saves(name, matmuls.get(unit, 0)):
                for t in tensors(out):
                    if _key(t) not in seen and _key(t) not in inputs:
                        seen.add(_key(t))
                        held.append(t)
                        trace.unit_policy_bytes[unit] = (trace.unit_policy_bytes.get(unit, 0)
                                                         + t.untyped_storage().nbytes())
            return out

    return Count()


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (views share it)."""
    return storage_address(t.untyped_storage())


def korthikanti_layer_bytes(seq_len: int, batch_size: int, n_embd: int, n_head: int, itemsize: int = 2) -> int:
    """Activation bytes one transformer layer saves [Korthikanti et al., arXiv:2205.05198, eq. in section 4.1]:
    s b h (34 + 5 a s / h) at 2-byte activations (dropout masks 1 byte each included), scaled by ``itemsize`` / 2
    for the 2-byte terms."""
    s, b, h, a = seq_len, batch_size, n_embd, n_head
    return int(s * b * h * (34 + 5 * a * s / h) * itemsize / 2)
