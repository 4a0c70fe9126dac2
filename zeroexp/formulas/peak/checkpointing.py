"""Activation checkpointing (``activation_checkpointing=full``: each wrap unit in torch's non-reentrant
``checkpoint_wrapper``) from the per-unit activations of one bare forward (``zeroexp.plan.activations``).

torch/utils/checkpoint.py (non-reentrant): a checkpointed unit's forward saves nothing of its own for backward but its
inputs; when backward first needs one of its saved tensors it reruns the unit's forward and keeps what that forward
saves until the unit's backward has used it. So forward keeps each unit's input and what the root unit saves
(outside every checkpointed unit), beside the output and the loss; backward adds, one unit at a time, that unit's
activations. Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174, section 3.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["checkpointed_forward_bytes", "recompute_bytes"]


def checkpointed_forward_bytes(kept_bytes: int, unit_bytes: Mapping[str, int], unit_input_bytes: Mapping[str, int]
                               ) -> int:
    """What one forward keeps for backward with every unit checkpointed: what it keeps without checkpointing
    (``kept_bytes``), less each checkpointed unit's saved activations (``unit_bytes``; the root unit's stay), plus
    each unit's input (``unit_input_bytes``), which the checkpoint keeps."""
    return (int(kept_bytes) - sum(int(b) for u, b in unit_bytes.items() if u != "root")
            + sum(int(b) for b in unit_input_bytes.values()))


def recompute_bytes(unit_bytes: Mapping[str, int]) -> int:
    """The most a checkpointed unit's recompute holds while its backward runs: the largest unit's activations (its
    saved tensors in a forward without checkpointing; ``root`` is not checkpointed)."""
    return max((int(b) for u, b in unit_bytes.items() if u != "root"), default=0)
