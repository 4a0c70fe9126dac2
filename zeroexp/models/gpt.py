"""A small, readable decoder-only transformer (GPT-2 style), for cells whose wrapping unit is a block.

Token and position embeddings, ``n_layer`` pre-norm blocks of causal self-attention and an MLP, a final
layer norm and a language-model head that is tied to the token embedding by default (as in GPT-2; Radford
et al. 2019, and nanoGPT's ``model.py``). Dropout is left out so that every strategy computes the same
numbers. The forward pass returns logits; the loss (``next_token``) is zeroexp's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT", "Block"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)  # GPT-2's 4x expansion
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the default FSDP unit of ``model=gpt``."""

    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``(batch, seq_len)`` token ids -> ``(batch, seq_len, vocab_size)`` logits."""

    def __init__(self, vocab_size: int, seq_len: int, n_layer: int, n_head: int, n_embd: int,
                 bias: bool = True, tie_weights: bool = True) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight  # one parameter, counted once by every probe
        for step in self.init_steps():
            step.fn(step.module)

    #: ``init=meta`` (zeroexp.models.init): the constructor draws only its modules' ``reset_parameters`` (in
    #: construction order) and :meth:`init_steps`.
    replayable_init = True
    #: ``n_layer`` blocks in ``self.h``, built alike, each run on the previous one's output and none reading its
    #: index or the depth: the planner derives a deep GPT's traces from 2, 3 and 4 blocks (zeroexp.plan.stack).
    repeated_blocks = ("n_layer", "h")

    def init_steps(self) -> list:
        """GPT-2's initialisation after the modules are built, as steps of one module each (``InitStep``):
        N(0, 0.02) for every Linear and Embedding weight and zero biases, in ``self.apply`` order (children first;
        the tied head draws the embedding a second time), then the residual projections (``c_proj``) again at
        std 0.02 / sqrt(2 n_layer) [GPT-2, nanoGPT]. The constructor runs them; ``init=meta`` replays them."""
        from zeroexp.models.init import InitStep

        order: list[nn.Module] = []
        self.apply(order.append)  # the post-order GPT-2's init walks
        steps = [InitStep(m, ("weight",) + (("bias",) if getattr(m, "bias", None) is not None else ()), self._init)
                 for m in order if isinstance(m, (nn.Linear, nn.Embedding))]
        std = 0.02 / math.sqrt(2 * len(self.h))
        for name, _ in self.named_parameters():
            if name.endswith("c_proj.weight"):
                steps.append(InitStep(self.get_submodule(name.rpartition(".")[0]), ("weight",),
                                      lambda m: nn.init.normal_(m.weight, mean=0.0, std=std)))
        return steps

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
