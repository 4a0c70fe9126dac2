"""What an adapter is given: the cell's settings it acts on, resolved once from the composed config into typed, frozen
policies (:class:`CellPolicy`), so that no adapter reads the whole config ad hoc.

An adapter's instance methods read ``self.policy`` and its own strategy config, ``self.config`` (an instance of its
schema, zeroexp.cell.strategy); its classmethods ``validate`` / ``validate_model`` still read the composed config,
before launch, where a refusal names the config key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from zeroexp.cell.strategy import SCHEMAS, StrategyConfig
from zeroexp.formulas.peak.checkpointing import Checkpointing

__all__ = ["CellPolicy", "PrecisionPolicy", "OptimizerPolicy", "strategy_config"]


@dataclass(frozen=True)
class PrecisionPolicy:
    """``precision=`` (conf/precision/): its name, the compute and master dtypes by torch's names, and fp16's dynamic
    loss scale (its initial value, None without, and its growth interval)."""

    name: str
    param_dtype: str
    master_dtype: str
    loss_scale: float | None
    growth_interval: int


@dataclass(frozen=True)
class OptimizerPolicy:
    """``optimizer.*``: AdamW's hyper-parameters and its update path (``impl``: single, foreach, fused; None: torch's
    choice)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    impl: str | None = None

    def kwargs(self) -> dict[str, Any]:
        """As ``torch.optim.AdamW`` takes them (``impl`` as its ``foreach=`` / ``fused=``, only when set)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay,
                **self.path()}

    def path(self) -> dict[str, bool]:
        """``impl`` as ``torch.optim.AdamW``'s ``foreach=`` and ``fused=`` (none when unset: torch's choice)."""
        return {} if self.impl is None else {"foreach": self.impl == "foreach", "fused": self.impl == "fused"}


@dataclass(frozen=True)
class CellPolicy:
    """Everything of the cell an adapter acts on. ``model``: the model node, read-only (building the model again,
    ``init=meta``'s replay of its initialisation, DDP's unused-parameter probe); ``wrap``: the wrap units' classes by
    import path (``strategy.wrap``, else ``model.wrap``); ``prefetch``: the ``prefetch`` option (the strategies whose
    cells it names read it); ``warmup_steps``: the step after which the probes record (DeepSpeed's adapter captures its
    gradients then). Not here: the rank and the world size, which a rank reads from its process group alone."""

    strategy: StrategyConfig
    precision: PrecisionPolicy
    offload: str
    prefetch: str
    wrap: tuple[str, ...]
    activation_checkpointing: Checkpointing
    optimizer: OptimizerPolicy
    model: Mapping[str, Any]
    seed: int
    batch_size: int
    grad_accum: int
    warmup_steps: int
    #: Whether the model's step leaves a trainable parameter without a gradient (DDP's ``find_unused_parameters`` when
    #: null), read once before launch from the shape's meta-device step (``ModelShape.unused``); None: not read there
    #: (the model's shape was not traced), the adapter reads it itself.
    ungraded: bool | None = None

    @classmethod
    def of(cls, cfg: DictConfig) -> CellPolicy:
        """The policy of a composed cell config (its strategy's keys that its schema lacks left out)."""
        from zeroexp.formulas.peak.checkpointing import checkpointing_of
        from zeroexp.models import wrap_paths

        p, o = cfg.precision, cfg.optimizer
        model = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
        OmegaConf.set_readonly(model, True)
        return cls(strategy=strategy_config(cfg.strategy),
                   precision=PrecisionPolicy(str(p.name), str(p.param_dtype), str(p.master_dtype),
                                             None if p.loss_scale is None else float(p.loss_scale),
                                             int(p.growth_interval)),
                   offload=str(cfg.offload.name), prefetch=str(cfg.prefetch.name),
                   wrap=tuple(str(w) for w in wrap_paths(cfg)),
                   activation_checkpointing=checkpointing_of(cfg.activation_checkpointing),
                   optimizer=OptimizerPolicy(float(o.lr), (float(o.betas[0]), float(o.betas[1])), float(o.eps),
                                             float(o.weight_decay), None if o.get("impl") is None else str(o.impl)),
                   model=model, seed=int(cfg.seed), batch_size=int(cfg.batch_size),
                   grad_accum=int(cfg.grad_accum), warmup_steps=int(cfg.warmup_steps))


def strategy_config(node: DictConfig) -> StrategyConfig:
    """``strategy.*`` as an instance of its schema (resolved; keys the schema lacks, set in a sweep for other
    strategies, left out; a strategy with no schema entry gets the common keys)."""
    schema = SCHEMAS.get(str(node.name), StrategyConfig)
    values = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    own = {f.name for f in fields(schema)}
    return schema(**{k: v for k, v in values.items() if k in own})
