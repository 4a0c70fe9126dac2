"""The GPT with low-rank adapters (LoRA; Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): every weight of the base model frozen, and each attention and MLP projection given a trainable
update ``B @ A`` of rank ``lora_rank`` (``A`` Kaiming-uniform as ``nn.Linear`` draws it, ``B`` zero, so training starts
at the base model), scaled by ``lora_alpha / lora_rank``. The way most large models are fine-tuned: a cell of it
measures what each strategy does with frozen parameters beside a few trainable ones in every unit."""

from __future__ import annotations

import math

import torch
from torch import nn

from zeroexp.models.gpt import GPT

__all__ = ["LoRALinear", "lora_gpt", "LORA_TARGETS"]

#: The projections that get an adapter: attention's qkv and output, the MLP's two (``zeroexp.models.gpt``).
LORA_TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (x A^T) B^T * alpha / rank``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        self.scale = alpha / rank
        if self.lora_a.device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's own draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scale


def lora_gpt(lora_rank: int = 4, lora_alpha: float = 8.0, **gpt: object) -> nn.Module:
    """A ``zeroexp.models.gpt.GPT`` (``gpt``: its arguments), frozen, with a :class:`LoRALinear` in place of each
    projection of :data:`LORA_TARGETS` in every block."""
    if int(lora_rank) < 1:
        raise ValueError(f"lora_rank must be a positive integer, got {lora_rank}")
    model = GPT(**gpt).requires_grad_(False)
    for block in model.h:
        for path in LORA_TARGETS:
            parent, _, name = path.rpartition(".")
            owner = block.get_submodule(parent)
            setattr(owner, name, LoRALinear(getattr(owner, name), int(lora_rank), float(lora_alpha)))
    return model


#: The GPT's blocks (``GPT.repeated_blocks``), each given the same adapters (zeroexp.plan.stack).
lora_gpt.repeated_blocks = GPT.repeated_blocks  # type: ignore[attr-defined]
