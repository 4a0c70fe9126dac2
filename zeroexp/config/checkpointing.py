"""The ``activation_checkpointing`` axis (conf/activation_checkpointing/): ``none``, ``full``, ``selective_layer``
(every k-th wrap unit, ``activation_checkpointing.every=k``), ``selective_op`` (every wrap unit under a per-op
policy: ``activation_checkpointing.save_ops``, ``activation_checkpointing.matmul_recompute_every``). What each mode
does is :mod:`zeroexp.formulas.peak.checkpointing`'s; how it is applied, :func:`zeroexp.models.checkpoint_units`.

Its schema, its checks before launch and the option a node names live here; zeroexp.config.schemas registers and
calls them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf

from zeroexp.errors import ConfigError
from zeroexp.formulas.peak.checkpointing import MODES, Checkpointing, checkpointing_of

__all__ = ["ActivationCheckpointingConfig", "MODES", "MODE_KEYS", "checkpointing_of", "option", "overrides_of",
           "check_checkpointing", "checked_option",
           "check_save_ops", "check_checkpointing_units"]


@dataclass
class ActivationCheckpointingConfig:
    name: str = MISSING  # none | full | selective_layer | selective_op (zeroexp.formulas.peak.checkpointing)
    every: Optional[int] = None  # selective_layer: every k-th wrap unit checkpointed (torchtitan's selective_ac_option)
    save_ops: Optional[List[str]] = None  # selective_op: ATen ops whose outputs are kept; null: torchtitan's list
    matmul_recompute_every: Optional[int] = None  # selective_op: each unit's every k-th matmul recomputed; null: 2


#: The keys each mode reads (a key set under another mode is refused: it would change nothing).
MODE_KEYS = {"none": (), "full": (), "selective_layer": ("every",),
             "selective_op": ("save_ops", "matmul_recompute_every")}


def option(name: str) -> Checkpointing:
    """The option ``name`` as its YAML (conf/activation_checkpointing/<name>.yaml) sets it."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "conf" / "activation_checkpointing" / f"{name}.yaml"
    if name not in MODES or not path.exists():
        raise ConfigError("activation_checkpointing", name, ", ".join(MODES))
    return checkpointing_of(OmegaConf.load(path))


def overrides_of(mode: Checkpointing) -> list[str]:
    """The ``python -m zeroexp`` overrides that select ``mode``: the option, and each of its keys where the option's
    YAML sets another value."""
    out = [f"activation_checkpointing={mode.mode}"]
    default = option(mode.mode)
    if mode.every != default.every:
        out.append(f"activation_checkpointing.every={mode.every}")
    if mode.save_ops != default.save_ops:
        out.append(f"activation_checkpointing.save_ops=[{','.join(mode.save_ops)}]")
    if mode.matmul_recompute_every != default.matmul_recompute_every:
        out.append(f"activation_checkpointing.matmul_recompute_every={mode.matmul_recompute_every}")
    return out


def check_checkpointing(cfg: Any, explicit_overrides: tuple[str, ...] | None = None) -> None:
    """The node's mode and keys, from the config alone (no torch): a key of another mode refused where the user set
    it for this cell (``explicit_overrides``: a single run's keys; None: every key, as the planner reads them; in a
    sweep, set for the other modes, it does not apply and the mode reads its default), ``every`` an integer >= 1,
    ``matmul_recompute_every`` one >= 0 (0: every matmul saved), ``save_ops`` a list of names."""
    node = cfg.get("activation_checkpointing")
    if node is None:
        return
    mode = str(node.name)
    if mode not in MODES:
        raise ConfigError("activation_checkpointing", mode, ", ".join(MODES))
    for key in ("every", "save_ops", "matmul_recompute_every"):
        asked = explicit_overrides is None or f"activation_checkpointing.{key}" in explicit_overrides
        if node.get(key) is not None and key not in MODE_KEYS[mode] and asked:
            owner = next(m for m, keys in MODE_KEYS.items() if key in keys)
            raise ConfigError(f"activation_checkpointing.{key}", OmegaConf.select(cfg, f"activation_checkpointing."
                                                                                       f"{key}"),
                              "null", why=f"a key of activation_checkpointing={owner} only (this cell: {mode})")
    for key, low in (("every", 1), ("matmul_recompute_every", 0)):
        value = node.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ConfigError(f"activation_checkpointing.{key}", value, f"null or an integer >= {low}")
    ops = node.get("save_ops")
    if ops is not None and (not OmegaConf.is_list(ops) or not all(isinstance(o, str) and o for o in ops)):
        raise ConfigError("activation_checkpointing.save_ops", ops, "null or a list of ATen op names ([mm, bmm])")


def checked_option(cfg: Any) -> Checkpointing:
    """The option of ``cfg``'s ``activation_checkpointing`` node, its keys and op names checked (the planner's and
    the recommender's reading of a run's command line: every key as given)."""
    check_checkpointing(cfg)
    check_save_ops(cfg)
    return checkpointing_of(cfg.get("activation_checkpointing"))


def check_save_ops(cfg: Any) -> None:
    """``selective_op``'s ``save_ops``: each an ATen operator (``torch.ops.aten.<name>``; torch imported)."""
    mode = checkpointing_of(cfg.get("activation_checkpointing"))
    if not mode.policy:
        return
    import torch

    unknown = [o for o in mode.save_ops if not _is_aten_op(torch, o)]
    if unknown:
        raise ConfigError("activation_checkpointing.save_ops", list(mode.save_ops),
                          "ATen operator names (torch.ops.aten.<name>: mm, addmm, bmm, "
                          "_scaled_dot_product_flash_attention_for_cpu)", why=f"not ATen operators: {unknown}")


def _is_aten_op(torch: Any, name: str) -> bool:
    try:
        return callable(getattr(torch.ops.aten, name)) and not name.startswith("__")
    except (AttributeError, RuntimeError):
        return False


def check_checkpointing_units(cfg: Any, wrap: Any) -> None:
    """A mode other than ``none`` checkpoints wrap units: refused for a cell with none (``wrap``: its wrap paths)."""
    mode = checkpointing_of(cfg.get("activation_checkpointing"))
    if mode and not wrap:
        raise ConfigError("activation_checkpointing", mode.mode, "none",
                          why="it checkpoints wrap units (strategy.wrap, else model.wrap), and this cell has none "
                              "(set model.wrap or strategy.wrap to module classes)")
