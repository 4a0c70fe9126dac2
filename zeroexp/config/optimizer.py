"""``optimizer.*``: AdamW's hyper-parameters and its update path (:class:`OptimizerConfig`), checked before launch
(:func:`check_optimizer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import DictConfig

from zeroexp.errors import ConfigError

__all__ = ["ADAMW_IMPLS", "OptimizerConfig", "check_optimizer"]

#: torch's AdamW update paths (torch/optim/adam.py): ``single`` (``_single_tensor_adam``, ``foreach=False``),
#: ``foreach`` (``_multi_tensor_adam``, ``foreach=True``), ``fused`` (``_fused_adam``, ``fused=True``; a CPU kernel
#: too since torch 2.4).
ADAMW_IMPLS = ("single", "foreach", "fused")


@dataclass
class OptimizerConfig:
    """AdamW, the optimizer of the reference experiment (two fp32 moments per parameter)."""

    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    #: AdamW's update path (:data:`ADAMW_IMPLS`); null: torch's own choice (``_default_to_fused_or_foreach``: foreach
    #: where every parameter is on a CUDA device, single-tensor on the CPU). In the cell's identity only when set.
    impl: Optional[str] = None


def check_optimizer(cfg: DictConfig) -> None:
    """``optimizer.lr``, ``eps``, ``weight_decay``, ``betas`` in torch's ranges, ``impl`` one of :data:`ADAMW_IMPLS`
    or null: refused before launch, naming the key (torch would refuse them in a rank)."""
    o = cfg.optimizer

    def number(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float))

    for key, strict, accepted in (("lr", False, "a number >= 0"), ("eps", True, "a number > 0"),
                                  ("weight_decay", False, "a number >= 0")):
        v = o.get(key)
        if not number(v) or (v <= 0 if strict else v < 0):
            raise ConfigError(f"optimizer.{key}", v, accepted)
    betas = list(o.betas)
    if len(betas) != 2 or any(not number(b) or not 0 <= b < 1 for b in betas):
        raise ConfigError("optimizer.betas", betas, "two numbers in [0, 1)")
    if o.get("impl") is not None and o.impl not in ADAMW_IMPLS:
        raise ConfigError("optimizer.impl", o.impl, "null (torch's choice: foreach on CUDA, single-tensor on the "
                          "CPU), " + ", ".join(ADAMW_IMPLS) + " (torch's AdamW paths)")
