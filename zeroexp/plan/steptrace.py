"""One training step of the bare model traced under ``FakeTensorMode``: the live bytes at every unit boundary.

The peak model (:mod:`zeroexp.formulas.peak`) adds to this what a strategy holds (unsharded units, gradient shards,
buckets, the optimizer's temporaries). What the trace gives is what every strategy shares: the activations the forward
saves and the transients of its ops, the loss, and in backward the gradients of activations and of the parameters as
autograd produces them. Nothing is allocated: the model is built and run on fake tensors of the cell's device (not the
meta device: attention's math path there saves the s^2 probabilities where the CPU and CUDA kernels save a logsumexp),
and ``torch.distributed._tools.MemTracker`` follows their storages exactly as the memory probe follows real ones.

The step is the training step zeroexp runs (``zeroexp.module``): forward, the loss, Lightning's detached copy of the
loss (``ClosureResult``), backward. Segments end at each unit's forward pre/post hook and backward pre/post hook, at
the loss and at the end of backward; each records the peak inside it and the bytes live at its end, by category
(MemTracker's: parameter gradients are ``gradients``, what backward allocates besides is ``temporaries``).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from zeroexp.formulas.peak import Segment, StepTrace
from zeroexp.memtrack import step_mem_tracker, totals

__all__ = ["trace_step"]


def trace_step(model_cfg: Mapping[str, Any], batch_size: int, wrap: Iterable[type] = (), device: str = "cpu",
               dtype: torch.dtype | None = None, param_dtype: torch.dtype | None = None) -> StepTrace:
    """Trace one step of the model config's module at ``batch_size`` samples of ``model.input_shape`` on fake tensors
    of ``device``; units are the modules of a ``wrap`` class (FSDP's units; every strategy is segmented the same
    way). ``dtype``: autocast's dtype (None or fp32: no autocast). ``param_dtype``: the module's floating parameters
    and buffers cast to it before the step and the floating input cast to it inside the step, as a strategy that
    computes in a low precision does (FSDP's ``MixedPrecision`` / ``MixedPrecisionPolicy``, zeroexp's ZeRO); None:
    the model's own (:func:`zeroexp.formulas.peak_precision.trace_dtypes` says which for a cell)."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    from zeroexp.models import build_model, loss_of, zeros_batch

    classes = tuple(wrap)
    segments: list[Segment] = []
    with FakeTensorMode(), torch.device(device):
        net = build_model(model_cfg)
        if param_dtype not in (None, torch.float32):  # as zeroexp's ZeRO casts them (``.data``: fake tensors swap not)
            for t in [*net.parameters(), *net.buffers()]:
                if t.is_floating_point():
                    t.data = t.data.to(param_dtype)
        names = {id(m): name or "root" for name, m in net.named_modules()}
        batch = zeros_batch(model_cfg, batch_size)
        mt = step_mem_tracker()
        mt.track_external(net, batch)
        base: list[tuple[int, dict[str, int]]] = []  # the step's start: parameters and the batch

        def mark(phase: str, unit: str, at: str) -> None:
            (b, b_cats), (peak, peak_cats) = base[0], totals(mt.get_tracker_snapshot("peak"), device)
            now, now_cats = totals(mt.get_tracker_snapshot("current"), device)
            segments.append(Segment(phase, unit, at, peak - b, _less(peak_cats, b_cats), now - b, _less(now_cats, b_cats)))
            mt.reset_peak()

        units = [m for m in net.modules() if classes and isinstance(m, classes)]
        hooks = []
        for m in units:
            u = names[id(m)]
            hooks += [m.register_forward_pre_hook(lambda m, a, u=u: mark("forward", u, "start")),
                      m.register_forward_hook(lambda m, a, o, u=u: mark("forward", u, "end")),
                      m.register_full_backward_pre_hook(lambda m, g, u=u: mark("backward", u, "start")),
                      m.register_full_backward_hook(lambda m, gi, go, u=u: mark("backward", u, "end"))]
        # Without autocast's weight-cast cache, as Lightning's MixedPrecision plugin runs it (plugins/precision/amp.py:
        # cache_enabled=False): a cast the backward does not need (the first Linear's weight) is freed at once.
        cast = (torch.autocast(device, dtype=dtype, cache_enabled=False) if dtype not in (None, torch.float32)
                else nullcontext())
        try:
            with mt:
                base.append(totals(mt.get_tracker_snapshot("current"), device))
                mt.reset_peak()
                with cast:
                    x = batch.to(param_dtype) if param_dtype is not None and batch.is_floating_point() else batch
                    out = net(x)
                    del x
                    loss = loss_of(model_cfg)(out, batch)
                del out  # the step keeps only what autograd saved of the output
                kept = loss.detach().clone()  # Lightning's ClosureResult keeps this copy of the loss
                mark("forward", "loss", "end")
                loss.backward()
                mark("backward", "root", "end")
                del kept
        finally:
            for h in hooks:
                h.remove()
    return StepTrace(batch_size=int(batch_size), segments=tuple(segments),
                     loss_bytes=2 * loss.untyped_storage().nbytes())


def _less(cats: dict[str, int], base: dict[str, int]) -> dict[str, int]:
    """``cats`` above ``base``, category by category, zeros left out."""
    return {c: int(b) - base.get(c, 0) for c, b in cats.items() if int(b) != base.get(c, 0)}
