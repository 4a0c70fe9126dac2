"""What one training step runs, counted on the operations it runs, not assumed: its FLOPs (not 6 x parameters x tokens)
and the ATen operators its forward and its backward dispatch.

The step (forward, the loss, backward: the model config's module and loss) runs on the meta device. FLOPs: under torch's
``FlopCounterMode`` (``torch.utils.flop_counter``: matmuls, convolutions and scaled-dot-product attention counted by
their shapes; elementwise ops count 0, as in every MFU convention since PaLM's appendix B; torch 2.13's registry lacks
fused experts' grouped matmul, ``aten._grouped_mm``, counted here: :func:`grouped_mm_flops`). Attention's FLOPs are in
it; with ``checkpointing`` each wrap unit is checkpointed, so its forward runs again inside backward and its recompute
is counted too. Operators: every call that reaches the dispatcher below autograd (a Python dispatch mode sees each,
views and in-place ops included: what a CPU or a GPU pays a call's fixed cost for), forward (with the loss) apart from
backward, on fake tensors of the step's device (its kernels' choice is the device's). Nothing is allocated."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from zeroexp.cell.memo import memoized

__all__ = ["step_flops", "step_ops", "grouped_mm_flops", "recompute_share", "dispatched_step", "RAISED"]


def _key(model_cfg: Mapping[str, Any], *rest: Any) -> tuple:
    from omegaconf import OmegaConf

    return (repr(OmegaConf.to_container(model_cfg, resolve=True)) if OmegaConf.is_config(model_cfg)
            else repr(model_cfg), *rest)


def _derived(model_cfg: Mapping[str, Any], derive: bool, count: Callable[[Mapping[str, Any]], Any]) -> Any:
    """``count`` of a model that declares a stack of identical blocks deeper than ``DERIVED_ABOVE``
    (``zeroexp.plan.stack``) from its counts at two, three and four blocks: every block runs the same operations on
    the same shapes, the rest of the step none that depends on the depth, so C(L) = C(2) + (L - 2) x (C(3) - C(2)),
    exact in integers, where C(4) checks it (a tuple: each of its counts); None where not derived (``derive=False``,
    no such stack, or a failed check)."""
    from zeroexp.plan.stack import at_depth, stack_of

    stack = stack_of(model_cfg) if derive else None
    if stack is None:
        return None
    argument, _, depth = stack
    two, three, four = (count(at_depth(model_cfg, argument, d)) for d in (2, 3, 4))
    one = not isinstance(two, tuple)
    two, three, four = ((x,) if one else x for x in (two, three, four))
    if any(d - c != c - b for b, c, d in zip(two, three, four)):
        return None
    grown = tuple(b + (depth - 2) * (c - b) for b, c in zip(two, three))
    return grown[0] if one else grown


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)`` (fused experts: each row of ``a`` multiplied by its group's matrix of
    ``b``): 2 x M x K x N for every row once, whatever the routing, so a MoE step counts the experts each token is
    routed to (``num_experts_per_tok``), not all of them. 2-D x 3-D and 3-D x 3-D: 2 x (output elements) x K; 2-D x
    2-D (groups along K): 2 x M x K x N over all the groups."""
    import math

    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def step_flops(model_cfg: Mapping[str, Any], batch_size: int, wrap: tuple[type, ...] = (),
               checkpointing: Any = False, derive: bool = True) -> int:
    """The FLOPs one rank computes in one micro-batch of ``batch_size`` samples (forward, loss, backward; the
    recompute of the units ``checkpointing`` checkpoints: a ``Checkpointing``, True for ``full``; under
    ``selective_op`` the ops its policy does not save, as torch's checkpoint reruns them), counted by
    ``FlopCounterMode`` on the meta device (shapes alone: a FLOP count needs no values, and meta tensors skip the
    initialisation and the fake-tensor dispatch); a deep stack of identical blocks from two, three and four blocks
    (:func:`_derived`; ``derive=False``: counted whole; ``selective_layer``'s blocks differ: derived only where the
    counts at two, three and four blocks grow alike)."""
    from zeroexp.formulas.peak.checkpointing import mode_of
    from zeroexp.models import unit_names

    mode = mode_of(checkpointing)
    key = _key(model_cfg, "flops", int(batch_size), unit_names(wrap), mode, derive)
    return memoized("op_counts", key, lambda: _step_flops(model_cfg, batch_size, wrap, mode, derive))


def recompute_share(model_cfg: Mapping[str, Any], batch_size: int, wrap: tuple[type, ...], checkpointing: Any
                    ) -> float:
    """The share of its checkpointed units' forward FLOPs that ``checkpointing`` recomputes: 1 where a checkpointed
    unit reruns whole (``full``, ``selective_layer``), else (``selective_op``) the FLOPs its recompute counts over
    those ``full``'s counts (:func:`step_flops`, each less the step without checkpointing)."""
    from zeroexp.formulas.peak.checkpointing import FULL, mode_of

    mode = mode_of(checkpointing)
    if not mode.policy:
        return 1.0 if mode else 0.0
    bare = step_flops(model_cfg, batch_size, wrap, False)
    full = step_flops(model_cfg, batch_size, wrap, FULL) - bare
    return (step_flops(model_cfg, batch_size, wrap, mode) - bare) / full if full > 0 else 0.0


def _step_flops(model_cfg: Mapping[str, Any], batch_size: int, wrap: Any, checkpointing: Any, derive: bool) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from zeroexp.models import build_model, checkpoint_units, loss_of, unit_classes, zeros_batch

    grown = _derived(model_cfg, derive, lambda cfg: step_flops(cfg, batch_size, wrap, checkpointing))
    if grown is not None:
        return grown
    with torch.device("meta"):
        net = build_model(model_cfg)
        if checkpointing and wrap:
            checkpoint_units(net, unit_classes(wrap), checkpointing)
        batch = zeros_batch(model_cfg, batch_size, device="meta")
        with FlopCounterMode(display=False, custom_mapping=_MAPPING()) as counter:
            loss = loss_of(model_cfg)(net(batch), batch)
            loss.backward()
    return int(counter.get_total_flops())


def _MAPPING() -> dict[Any, Any]:  # noqa: N802 - a table, made where torch is imported
    from zeroexp._lib.grouped_mm import grouped_mm_op

    op = grouped_mm_op()
    return {op: grouped_mm_flops} if op is not None else {}


def step_ops(model_cfg: Mapping[str, Any], device: str = "cpu", batch_size: int = 1, derive: bool = True
             ) -> tuple[int, int]:
    """(forward, backward): the ATen operator calls one micro-batch dispatches in its forward (with the loss) and in
    its backward on ``device`` at micro-batch ``batch_size`` (a few depend on it: a batch of one skips some
    reshapes), on fake tensors of it (not the meta device: which kernels an op picks depends on the
    device, as scaled-dot-product attention's fused CPU kernel, one call, against the meta device's math path, eight);
    a deep stack derived as :func:`step_flops`'s. What a step's fixed cost
    per call is paid on (:meth:`~zeroexp.formulas.time.rates.ComputeRate.call_seconds`)."""
    key = _key(model_cfg, "ops", str(device), int(batch_size), derive)
    return memoized("op_counts", key, lambda: _step_ops(model_cfg, device, batch_size, derive))


def _step_ops(model_cfg: Mapping[str, Any], device: str, batch_size: int, derive: bool) -> tuple[int, int]:
    grown = _derived(model_cfg, derive, lambda cfg: step_ops(cfg, device, batch_size))
    if grown is not None:
        return grown
    # prim.device: a fake tensor's device asked, no operator
    forward, backward = dispatched_step(model_cfg, batch_size, device,
                                        on_call=lambda func, *_: True if func.namespace != "prim" else None)
    return len(forward), len(backward)


#: What :func:`dispatched_step` hands ``on_call`` as the output of a call that raised.
RAISED = object()


def dispatched_step(model_cfg: Mapping[str, Any], batch_size: int, device: str = "cpu", module_dtype: Any = None,
                    on_call: Callable[..., Any] = lambda *call: None) -> tuple[list, list]:
    """One micro-batch of ``batch_size``'s forward (with the loss) and backward on fake tensors of ``device``, the
    module cast to ``module_dtype`` (``zeroexp.plan.activations.cast_module``; a floating input too), under a
    dispatch mode that sees every ATen call below autograd: ``on_call(func, args, kwargs, out)`` for each (``out``
    :data:`RAISED` where the call raised on fake tensors and the model caught it: a data-dependent ``.item()``, which
    the CPU dispatches: HF Llama's forward has one); returns what it returned (None left out) in the forward and in
    the backward. What :func:`step_ops` counts and ``zeroexp.plan.optrace`` costs."""
    import torch

    from zeroexp._lib.dispatch import dispatch_mode_base
    from zeroexp._lib.fake_tensors import fake_tensor_mode
    from zeroexp.models import build_model, loss_of, zeros_batch
    from zeroexp.plan.activations import cast_module

    class Calls(dispatch_mode_base()):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            try:
                out = func(*args, **(kwargs or {}))
            except Exception:
                self.see(on_call(func, args, kwargs, RAISED))
                raise
            self.see(on_call(func, args, kwargs, out))
            return out

        def see(self, got: Any) -> None:
            if got is not None:
                self.seen.append(got)

    dtype = getattr(torch, module_dtype) if isinstance(module_dtype, str) else module_dtype
    with fake_tensor_mode(), torch.device(device):
        net = build_model(model_cfg)
        cast = cast_module(net, dtype)
        batch = zeros_batch(model_cfg, batch_size)
        if cast is not None and batch.is_floating_point():
            batch = batch.to(cast)
        with Calls() as forward:
            loss = loss_of(model_cfg)(net(batch), batch)
        with Calls() as backward:
            loss.backward()
    return forward.seen, backward.seen
