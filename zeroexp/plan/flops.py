"""FLOPs of one training step, counted on the operations the step runs, not assumed (6 x parameters x tokens).

The step (forward, the loss, backward: the model config's module and loss) runs on the meta device under torch's
``FlopCounterMode`` (``torch.utils.flop_counter``: matmuls, convolutions and scaled-dot-product attention
counted by their shapes; elementwise ops count 0, as in every MFU convention since PaLM's appendix B). Attention's
FLOPs are in it; with ``checkpointing`` each wrap unit is checkpointed, so its forward runs again inside backward and
its recompute is counted too. Nothing is allocated.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["step_flops"]

#: step_flops's answers in this process, by their arguments.
_FLOPS: dict[tuple, int] = {}


def step_flops(model_cfg: Mapping[str, Any], batch_size: int, wrap: tuple[type, ...] = (),
               checkpointing: bool = False, derive: bool = True) -> int:
    """The FLOPs one rank computes in one micro-batch of ``batch_size`` samples (forward, loss, backward; the
    recompute where checkpointed), counted by ``FlopCounterMode`` on the meta device (shapes alone: a FLOP count
    needs no values, and meta tensors skip the initialisation and the fake-tensor dispatch). A model that declares
    a stack of identical blocks deeper than ``DERIVED_ABOVE`` (``zeroexp.plan.stack``) is counted at two, three and
    four blocks: every block computes the same operations on the same shapes, the rest of the step none that
    depends on the depth, so F(L) = F(2) + (L - 2) x (F(3) - F(2)), exact in integers, where F(4) checks it
    (``derive=False``, or a failed check: counted whole)."""
    import torch
    from omegaconf import OmegaConf
    from torch.utils.flop_counter import FlopCounterMode

    from zeroexp.models import build_model, checkpoint_units, loss_of, zeros_batch
    from zeroexp.plan.stack import at_depth, stack_of

    key = (repr(OmegaConf.to_container(model_cfg, resolve=True)) if OmegaConf.is_config(model_cfg) else
           repr(model_cfg), int(batch_size), tuple(c.__qualname__ for c in wrap), bool(checkpointing)) \
        + (() if derive else ("whole",))
    if key in _FLOPS:
        return _FLOPS[key]
    stack = stack_of(model_cfg) if derive else None
    if stack is not None:
        argument, _, depth = stack
        two, three, four = (step_flops(at_depth(model_cfg, argument, d), batch_size, wrap, checkpointing)
                            for d in (2, 3, 4))
        if four - three == three - two:
            _FLOPS[key] = two + (depth - 2) * (three - two)
            return _FLOPS[key]
    with torch.device("meta"):
        net = build_model(model_cfg)
        if checkpointing and wrap:
            checkpoint_units(net, tuple(wrap))
        batch = zeros_batch(model_cfg, batch_size, device="meta")
        with FlopCounterMode(display=False) as counter:
            loss = loss_of(model_cfg)(net(batch), batch)
            loss.backward()
    _FLOPS[key] = int(counter.get_total_flops())
    return _FLOPS[key]
