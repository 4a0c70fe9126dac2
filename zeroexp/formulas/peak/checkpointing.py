"""Activation checkpointing, its modes, and what a checkpointed forward keeps, from the per-unit figures of one bare
forward (``zeroexp.plan.activations``).

The modes (``activation_checkpointing=``), each a wrap unit (``strategy.wrap``, else ``model.wrap``) in torch's
non-reentrant ``checkpoint_wrapper``:

- ``full``: every unit checkpointed;
- ``selective_layer``: every k-th unit in forward order (``activation_checkpointing.every=k``): the unit whose
  1-based index is a multiple of k, as torchtitan's layer SAC counts them (torchtitan
  ``distributed/activation_checkpoint.py``, ``_apply_layer_sac``: ``_count % ac_freq == 0``);
- ``selective_op``: every unit checkpointed under a per-op policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the ops ``save_ops`` names are kept
  from forward (``CheckpointPolicy.MUST_SAVE``), every other op runs again in backward (``PREFER_RECOMPUTE``);
  of the matmuls among them every ``matmul_recompute_every``-th in a unit is recomputed (torchtitan's op SAC policy,
  ``_op_sac_save_list`` and its ``mm_count % 2 == 0`` rule, there for ``aten.mm`` alone; here for every matmul:
  ``mm``, ``addmm``, ``bmm``, ``_grouped_mm``). Collectives are never saved: they are named by no save list.

torch/utils/checkpoint.py (non-reentrant): a checkpointed unit's forward saves nothing of its own for backward but its
inputs (and, under a policy, the outputs it must save); when backward first needs one of its saved tensors it reruns
the unit's forward and keeps what that forward saves until the unit's backward has used it. So forward keeps each
checkpointed unit's input and what the other units save, beside the output and the loss; backward adds, one unit at a
time, that unit's activations less what its policy kept. Chen et al., "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174, section 3; Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, section 5 (selective recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["Checkpointing", "NONE", "FULL", "MODES", "mode_of", "checkpointing_of", "SAVE_OPS", "MATMULS",
           "checkpointed_forward_bytes",
           "recompute_bytes"]

MODES = ("none", "full", "selective_layer", "selective_op")

#: The matmuls a policy counts (torch's ATen names; ``nn.Linear`` reaches the dispatcher as ``mm`` or ``addmm``,
#: batched attention as ``bmm``, fused MoE experts as ``_grouped_mm``).
MATMULS = ("mm", "addmm", "bmm", "_grouped_mm")

#: The default ``save_ops`` (torchtitan's op SAC save list, torchtitan/models/llama3/infra/parallelize.py
#: ``_op_sac_save_list``, for the ops a CPU and a GPU dispatch): the matmuls and every scaled-dot-product-attention
#: kernel, the CPU's ``_for_cpu`` variant included (torch 2.13's ``scaled_dot_product_attention`` dispatch on CPU).
SAVE_OPS = (*MATMULS, "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


@dataclass(frozen=True, order=True)
class Checkpointing:
    """One ``activation_checkpointing`` option: its ``mode`` and that mode's keys (``every``: selective_layer's k;
    ``save_ops`` and ``matmul_recompute_every``: selective_op's policy). False for ``none``."""

    mode: str = "none"
    every: int = 1
    save_ops: tuple[str, ...] = SAVE_OPS
    matmul_recompute_every: int = 2

    def __bool__(self) -> bool:
        return self.mode != "none"

    def checkpointed(self, index: int) -> bool:
        """Whether the wrap unit at 0-based ``index`` in forward order is checkpointed."""
        if self.mode == "selective_layer":
            return (index + 1) % self.every == 0
        return self.mode != "none"

    def chosen(self, names: Sequence[str]) -> tuple[str, ...]:
        """Of the wrap units ``names`` (in forward order; ``root`` is never a wrap unit), those checkpointed."""
        units = [n for n in names if n != "root"]
        return tuple(n for i, n in enumerate(units) if self.checkpointed(i))

    @property
    def policy(self) -> bool:
        """Whether a per-op policy decides what a checkpointed unit keeps (``selective_op``)."""
        return self.mode == "selective_op"

    def saves(self, op: str, matmul_index: int) -> bool:
        """``selective_op``: whether the policy keeps the output of ATen op ``op`` (its packet's name, ``mm``), the
        ``matmul_index``-th (1-based) matmul of the unit's forward when it is one."""
        if op not in self.save_ops:
            return False
        if op in MATMULS and self.matmul_recompute_every:
            return matmul_index % self.matmul_recompute_every != 0
        return True

    @property
    def label(self) -> str:
        """The mode with its keys where they are not the defaults: ``selective_layer-every2``, ``selective_op``,
        ``selective_op-mm2-ops<n>`` (what a cell's name and identity carry)."""
        if self.mode == "selective_layer":
            return f"selective_layer-every{self.every}"
        if self.mode == "selective_op" and (self.save_ops, self.matmul_recompute_every) != (SAVE_OPS, 2):
            return f"selective_op-mm{self.matmul_recompute_every}-" + "+".join(self.save_ops)
        return self.mode


NONE = Checkpointing("none")
FULL = Checkpointing("full")


def checkpointing_of(node: Any) -> Checkpointing:
    """The option a composed ``activation_checkpointing`` node names (a mapping with ``name`` and the modes' keys;
    None: ``none``); null keys take the defaults above (``every``: 2 for ``selective_layer``), and so do the keys of
    other modes (set in a sweep over modes: they do not apply)."""
    if node is None:
        return NONE
    mode = str(node.get("name"))
    layer, op = mode == "selective_layer", mode == "selective_op"
    every = node.get("every") if layer else None
    ops, mm = (node.get("save_ops"), node.get("matmul_recompute_every")) if op else (None, None)
    return Checkpointing(mode, every=int(every) if every is not None else (2 if mode == "selective_layer" else 1),
                         save_ops=tuple(str(o) for o in ops) if ops is not None else SAVE_OPS,
                         matmul_recompute_every=2 if mm is None else int(mm))


def mode_of(checkpointing: Checkpointing | bool | None) -> Checkpointing:
    """A :class:`Checkpointing` as given, or ``full`` for True and ``none`` for False and None (the callers that
    say only whether every unit is checkpointed)."""
    if isinstance(checkpointing, Checkpointing):
        return checkpointing
    return FULL if checkpointing else NONE


def checkpointed_forward_bytes(kept_bytes: int, unit_bytes: Mapping[str, int], unit_input_bytes: Mapping[str, int],
                               mode: Checkpointing = FULL, policy_bytes: Mapping[str, int] | None = None,
                               units: Sequence[str] | None = None) -> int:
    """What one forward keeps for backward with the units ``mode`` checkpoints: what it keeps without checkpointing
    (``kept_bytes``), less each checkpointed unit's saved activations (``unit_bytes``; the root unit's stay), plus
    each checkpointed unit's input (``unit_input_bytes``), which the checkpoint keeps, and under a policy what it
    keeps of the unit (``policy_bytes``: the outputs of the ops it saves that are not the unit's input). ``units``:
    every wrap unit in forward order (default: those of ``unit_bytes``), which ``selective_layer`` counts."""
    if not mode:
        return int(kept_bytes)
    chosen = mode.chosen(units if units is not None else list(unit_bytes))
    kept = (policy_bytes or {}) if mode.policy else {}
    return (int(kept_bytes) - sum(int(unit_bytes.get(u, 0)) for u in chosen)
            + sum(int(unit_input_bytes.get(u, 0)) + int(kept.get(u, 0)) for u in chosen))


def recompute_bytes(unit_bytes: Mapping[str, int], mode: Checkpointing = FULL,
                    policy_bytes: Mapping[str, int] | None = None, units: Sequence[str] | None = None) -> int:
    """The most a checkpointed unit's recompute holds while its backward runs: the largest checkpointed unit's
    activations (its saved tensors in a forward without checkpointing; ``root`` is not checkpointed) less what its
    policy kept from forward."""
    kept = (policy_bytes or {}) if mode.policy else {}
    chosen = mode.chosen(units if units is not None else list(unit_bytes))
    return max((int(unit_bytes.get(u, 0)) - int(kept.get(u, 0)) for u in chosen), default=0)
