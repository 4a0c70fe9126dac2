"""The model config schemas (``model=``): what every model needs, and the built-in models' own keys; registered
as ``schema/model/<name>`` by :func:`zeroexp.config.schemas.register_schemas`, each extended by its
conf/model/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

__all__ = ["MODEL_RESERVED_KEYS", "ModelConfig", "MLPConfig", "GPTConfig", "LoRAGPTConfig"]

#: Keys of the model node that belong to zeroexp (data spec, loss, naming, FSDP unit); every other key is passed to
#: the ``_target_`` factory.
MODEL_RESERVED_KEYS = ("name", "input_shape", "dtype", "low", "high", "loss", "wrap")


@dataclass
class ModelConfig:
    """Any ``nn.Module`` factory plus the shape of one sample, so zeroexp can make synthetic batches."""

    _target_: str = MISSING
    name: str = MISSING
    input_shape: List[int] = MISSING  # one sample, without the batch dimension
    dtype: str = "float32"  # float32 | float16 | bfloat16 | long (token ids in [low, high))
    low: int = 0
    high: int = 2
    loss: str = "mean_square"  # see zeroexp.models.LOSSES
    # The model's natural FSDP unit (module classes by import path), used when strategy.wrap is null.
    wrap: Optional[List[str]] = None


@dataclass
class MLPConfig(ModelConfig):
    """The reference Linear stack: ``depth`` bias-free ``nn.Linear(width, width)`` layers."""

    _target_: str = "zeroexp.models.LinearStack"
    width: int = 256
    depth: int = 8
    wrap: Optional[List[str]] = field(default_factory=lambda: ["torch.nn.Linear"])


@dataclass
class GPTConfig(ModelConfig):
    """zeroexp's decoder-only transformer (``zeroexp.models.gpt.GPT``) on random token ids."""

    _target_: str = "zeroexp.models.gpt.GPT"
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True
    tie_weights: bool = True
    wrap: Optional[List[str]] = field(default_factory=lambda: ["zeroexp.models.gpt.Block"])


@dataclass
class LoRAGPTConfig(GPTConfig):
    """The GPT, frozen, with low-rank adapters on its projections (``zeroexp.models.lora.lora_gpt``)."""

    _target_: str = "zeroexp.models.lora.lora_gpt"
    lora_rank: int = 4
    lora_alpha: float = 8.0
