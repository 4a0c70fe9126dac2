"""``activation_checkpointing=selective_op``'s policy as torch runs it: the per-op decision
(:meth:`zeroexp.formulas.peak.checkpointing.Checkpointing.saves`) behind
``torch.utils.checkpoint.create_selective_checkpoint_contexts``, one matmul count per checkpointed call and per
pass (its forward, its recompute), as torchtitan's ``_get_custom_policy`` keeps them."""

from __future__ import annotations

from typing import Any, Callable

from zeroexp.formulas.peak.checkpointing import MATMULS, Checkpointing

__all__ = ["policy_contexts", "op_name"]


def op_name(func: Any) -> str | None:
    """The ATen name of a dispatched op (``aten.mm.default`` -> ``mm``); None outside ``aten``."""
    return func.overloadpacket.__name__ if getattr(func, "namespace", None) == "aten" else None


def policy_contexts(mode: Checkpointing) -> Callable[[], Any]:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``mode``: each call makes the forward and
    recompute contexts of one checkpointed call, whose policy keeps (``MUST_SAVE``) the outputs ``mode.saves`` names
    and recomputes (``PREFER_RECOMPUTE``) every other op, collectives included."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def contexts() -> Any:
        matmuls = {False: 0, True: 0}  # per pass: the recompute counts its matmuls as the forward did

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            name = op_name(func)
            if name in MATMULS:
                matmuls[ctx.is_recompute] += 1
            saved = name is not None and mode.saves(name, matmuls[ctx.is_recompute])
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return contexts
