"""Hugging Face causal LMs from their configs (``model=hf`` and its presets, conf/model/): the config built here from an
architecture's name or a local ``config.json`` with the model node's flat fields over it, no hub download; the model
built from it by ``AutoModelForCausalLM.from_config``; its natural FSDP unit and token range read from the config.

The factory :func:`causal_lm` takes the model node's keys (``zeroexp.models.build_model``); :func:`hf_config` is the
one place a node becomes a ``PretrainedConfig``, so the build, the token range (:func:`vocab_size`) and the unit
(:func:`unit_paths`) read the same config.
"""

from __future__ import annotations

import difflib
import inspect
import sys
from typing import Any, Mapping

from torch import nn

__all__ = ["causal_lm", "hf_config", "unit_paths", "vocab_size", "ZEROEXP_KEYS"]

#: The HF node's keys that are zeroexp's, not the config's (besides zeroexp.models.MODEL_RESERVED_KEYS).
ZEROEXP_KEYS = ("arch", "config_path", "seq_len", "weights_dtype", "attn_implementation")


def _config_fields(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's own fields the node sets: every key that is neither zeroexp's nor null (null: the architecture's
    or the file's value)."""
    from zeroexp.models.schemas import MODEL_RESERVED_KEYS

    skip = set(MODEL_RESERVED_KEYS) | set(ZEROEXP_KEYS) | {"_target_"}
    return {str(k): v for k, v in model_cfg.items() if k not in skip and v is not None}


def hf_config(model_cfg: Mapping[str, Any]) -> Any:
    """The ``PretrainedConfig`` of an HF model node: ``config_path``'s file (a ``config.json`` or its directory, read
    locally) or ``arch``'s defaults (transformers' ``AutoConfig.for_model``), with the node's non-null fields set over
    it, ``dtype`` the node's ``weights_dtype`` and ``use_cache`` off (training keeps no KV cache). A field the
    architecture's config class does not have is refused naming it and the nearest fields, as are a missing or unknown
    ``arch`` and a file of another architecture (:class:`~zeroexp.errors.ConfigError`, naming the key)."""
    import torch
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from zeroexp.errors import ConfigError

    arch, path = model_cfg.get("arch"), model_cfg.get("config_path")
    fields = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v
              for k, v in _config_fields(model_cfg).items()}
    if path is not None:
        base = AutoConfig.from_pretrained(str(path), local_files_only=True)
        if arch is not None and base.model_type != arch:
            raise ConfigError("model.arch", arch, f"null or {base.model_type} (the file's)",
                              why=f"{path} is a {base.model_type!r} config")
        cls = type(base)
    else:
        if arch is None or arch not in CONFIG_MAPPING:
            near = difflib.get_close_matches(str(arch), list(CONFIG_MAPPING.keys()), n=5) if arch else []
            raise ConfigError("model.arch", arch, ", ".join(near or ("llama", "mistral", "qwen2", "mixtral", "gemma2"))
                              + ", ... (transformers' model_type), or model.config_path=<a local config.json>",
                              why="an architecture transformers knows is needed" if arch is None else
                              "not an architecture transformers knows")
        cls, base = CONFIG_MAPPING[arch], None
    known = set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
    for key in fields:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=3)
            raise ConfigError(f"model.{key}", fields[key], ", ".join(near) if near else f"the fields of {cls.__name__}",
                              why=f"{cls.__name__} has no field {key!r}")
    if base is None:
        config = cls(**fields)
    else:
        config = cls.from_dict({**base.to_dict(), **fields})
    config.dtype = getattr(torch, str(model_cfg.get("weights_dtype") or "float32"))
    config.use_cache = False
    if model_cfg.get("attn_implementation") is not None:
        config._attn_implementation = str(model_cfg["attn_implementation"])
    return config


def causal_lm(**node: Any) -> nn.Module:
    """The causal LM of an HF model node (``model._target_``: the node's keys but zeroexp's data spec), built from
    :func:`hf_config` with ``AutoModelForCausalLM.from_config`` (on whatever device is current: the meta device for
    plans, real memory in cells)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config(node))


def _model_class(model_cfg: Mapping[str, Any]) -> type:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config(model_cfg))]


def unit_paths(model_cfg: Mapping[str, Any]) -> list[str]:
    """The model's natural FSDP units: its class's ``_no_split_modules`` (the modules transformers never splits across
    devices, its decoder layers), each class name resolved in the model's own module to an import path."""
    cls = _model_class(model_cfg)
    module = sys.modules[cls.__module__]
    names = sorted(getattr(cls, "_no_split_modules", None) or ())
    return [f"{cls.__module__}.{n}" for n in names if isinstance(getattr(module, n, None), type)]


def vocab_size(model_cfg: Mapping[str, Any]) -> int:
    """The config's ``vocab_size``: the token ids' range when the node's ``high`` is null."""
    return int(hf_config(model_cfg).vocab_size)


#: ``zeroexp.models.wrap_paths``: a factory's own units when neither strategy.wrap nor model.wrap names any.
causal_lm.zeroexp_units = unit_paths  # type: ignore[attr-defined]
#: ``zeroexp.models.token_high``: a factory's own token range when model.high is null.
causal_lm.zeroexp_vocab_size = vocab_size  # type: ignore[attr-defined]
#: ``zeroexp.plan.stack``: the decoder layers (``model.layers``, ``num_hidden_layers`` of them) run one after another,
#: built alike (their ``layer_idx`` reads only a KV cache, off in training); a deep model's traces are derived from
#: two, three and four layers, checked at four (an architecture whose layers differ, Gemma 2's alternating sliding
#: and global attention beyond the window, fails that check and is traced whole).
causal_lm.repeated_blocks = ("num_hidden_layers", "model.layers")  # type: ignore[attr-defined]
