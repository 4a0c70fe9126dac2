"""The model config schemas (``model=``): what every model needs, and the built-in models' own keys; registered
as ``schema/model/<name>`` by :func:`zeroexp.config.schemas.register_schemas`, each extended by its
conf/model/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

__all__ = ["MODEL_RESERVED_KEYS", "MODEL_COUNTS", "ModelConfig", "MLPConfig", "GPTConfig", "LoRAGPTConfig", "HFConfig"]

#: The built-in models' keys that count something (layers, heads, widths): each set one is a positive integer.
MODEL_COUNTS = ("width", "depth", "vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "lora_rank", "hidden_size",
                "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_local_experts", "num_experts_per_tok")

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


@dataclass
class HFConfig(ModelConfig):
    """Any Hugging Face causal LM (``zeroexp.models.hf.causal_lm``), its config built here (no download): by
    architecture (``arch``, transformers' ``model_type``) or from a local ``config.json`` (``config_path``), the
    config's own fields flat beside them. Each field below left null is the architecture's (or the file's) own
    value; a field not listed here is added with ``+model.<field>=`` and checked against the architecture's config
    class. The token range is the config's ``vocab_size`` (``high`` null), the input ``seq_len`` tokens, the loss
    next-token cross entropy, the FSDP unit the model's own ``_no_split_modules`` (``wrap`` null)."""

    _target_: str = "zeroexp.models.hf.causal_lm"
    name: str = "hf"
    arch: Optional[str] = None  # llama, mistral, qwen2, mixtral, gemma2, ... (transformers' CONFIG_MAPPING)
    config_path: Optional[str] = None  # a local config.json (or its directory); flat fields override it
    seq_len: int = 2048  # tokens a sample (zeroexp's, not the config's max_position_embeddings)
    #: The dtype the config builds its weights in: ``precision.master_dtype`` (conf/model/hf.yaml), so a
    #: strategy's mixed precision casts from it as for any model. Not the input's dtype (``dtype``).
    weights_dtype: str = "float32"
    attn_implementation: Optional[str] = None  # sdpa (transformers' default) | eager
    dtype: str = "long"
    high: Optional[int] = None  # null: the config's vocab_size
    loss: str = "next_token"
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    hidden_act: Optional[str] = None
    hidden_activation: Optional[str] = None  # gemma2's name for it
    max_position_embeddings: Optional[int] = None
    rms_norm_eps: Optional[float] = None
    tie_word_embeddings: Optional[bool] = None
    rope_parameters: Optional[Dict[str, Any]] = None  # transformers 5's rope_theta and rope scaling
    attention_bias: Optional[bool] = None
    mlp_bias: Optional[bool] = None
    attention_dropout: Optional[float] = None
    sliding_window: Optional[int] = None
    use_sliding_window: Optional[bool] = None
    max_window_layers: Optional[int] = None
    num_local_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    router_aux_loss_coef: Optional[float] = None
    query_pre_attn_scalar: Optional[int] = None
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
