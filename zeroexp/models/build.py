"""Models, synthetic data and losses (read through :mod:`zeroexp.models`).

A model config names an ``nn.Module`` factory (``_target_``) and what one sample looks like
(``input_shape``, ``dtype``); zeroexp builds seeded synthetic batches of that shape, so any module can be
put in a cell. The loss is a fixed, documented function of the output (:data:`LOSSES`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from zeroexp.formulas import ITEMSIZE
from zeroexp.models.schemas import MODEL_RESERVED_KEYS

__all__ = ["LinearStack", "LOSSES", "MODEL_RESERVED_KEYS", "build_model", "make_batch", "zeros_batch", "loss_of",
           "import_class", "wrap_paths", "token_range", "torch_dtype", "checkpoint_units", "grad_tensors",
           "requires_grad", "unused_parameters"]



class LinearStack(nn.Sequential):
    """``depth`` bias-free ``nn.Linear(width, width)`` layers: the reference experiment's model.

    No activations, so the model is exactly the stack of weight matrices whose bytes the probes count.
    """

    #: ``init=meta`` (zeroexp.models.init): the constructor draws only each Linear's ``reset_parameters``, in order.
    replayable_init = True
    #: ``depth`` alike Linear layers run in a row: the planner derives a deep stack's traces from 2, 3 and 4
    #: (zeroexp.plan.stack).
    repeated_blocks = ("depth", "")

    def __init__(self, width: int, depth: int) -> None:
        super().__init__(*(nn.Linear(width, width, bias=False) for _ in range(depth)))


def _mean_square(output: Any, batch: torch.Tensor) -> torch.Tensor:
    """mean(output ** 2) over every element: a loss of the output alone, no targets needed (a Hugging Face output:
    of its ``logits``)."""
    return getattr(output, "logits", output).float().pow(2).mean()


def _next_token(output: Any, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits[:, :-1] against the input ids shifted by one."""
    logits = getattr(output, "logits", output)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
    )


def _sum(output: Any, batch: torch.Tensor) -> torch.Tensor:
    """sum(output) over every element, as PyTorch's own FSDP tests train (``model(x).sum().backward()``); of a Hugging
    Face output's ``logits``."""
    return getattr(output, "logits", output).float().sum()


LOSSES: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "mean_square": _mean_square,
    "next_token": _next_token,
    "sum": _sum,
}



def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype zeroexp's dtype name stands for (``precision.param_dtype``, ``model.dtype``): the names of
    ``zeroexp.formulas.ITEMSIZE``, the one dtype map, are torch's own."""
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name!r}: accepted {', '.join(ITEMSIZE)}")
    return getattr(torch, name)


def build_model(model_cfg: Mapping[str, Any]) -> nn.Module:
    """Instantiate the model config's ``_target_`` with every key that is not zeroexp's own."""
    from hydra.utils import instantiate

    kwargs = {k: v for k, v in model_cfg.items() if k not in MODEL_RESERVED_KEYS}
    module = instantiate(kwargs, _convert_="all")
    if not isinstance(module, nn.Module):
        raise TypeError(f"model._target_={model_cfg['_target_']} returned {type(module).__name__}, not an nn.Module")
    from zeroexp._lib.grouped_mm import install_grouped_mm_meta
    from zeroexp._lib.hf_masks import install_unpacked_positions

    # a model traced on the meta device or fake tensors takes the path it takes on data: transformers' masks, and
    # fused experts (torch._grouped_mm) in every floating dtype
    install_unpacked_positions()
    install_grouped_mm_meta()
    return module


def make_batch(model_cfg: Mapping[str, Any], batch_size: int, seed: int, step: int, rank: int) -> torch.Tensor:
    """The batch rank ``rank`` trains on at ``step``: a pure function of (seed, step, rank).

    The global batch of a step is the concatenation over ranks, which is what an unsharded reference
    trains on. Floats are standard normal; ``long`` samples are uniform in ``[low, high)``.
    """
    g = torch.Generator().manual_seed(hash((seed, step, rank)) & 0x7FFF_FFFF_FFFF_FFFF)
    shape = (batch_size, *model_cfg["input_shape"])
    dtype = torch_dtype(model_cfg.get("dtype", "float32"))
    if dtype == torch.long:
        return torch.randint(*token_range(model_cfg), shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def loss_of(model_cfg: Mapping[str, Any]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The model config's loss (``model.loss``, default ``mean_square``), from :data:`LOSSES`."""
    return LOSSES[str(model_cfg.get("loss", "mean_square"))]


def zeros_batch(model_cfg: Mapping[str, Any], batch_size: int, device: Any = None) -> torch.Tensor:
    """A batch of ``batch_size`` zero samples of ``model.input_shape`` in ``model.dtype``: the shape and dtype of
    :func:`make_batch`'s, for tracing (the planner's meta and fake-tensor passes), not for training."""
    return torch.zeros((int(batch_size), *model_cfg["input_shape"]),
                       dtype=torch_dtype(str(model_cfg.get("dtype", "float32"))), device=device)


def import_class(path: str, base: type | None = nn.Module) -> Any:
    """The object at import path ``module.attr``; with ``base``, it must be a subclass of it (TypeError otherwise).
    Raises ImportError, AttributeError or ValueError for a path that does not import."""
    import importlib

    module, _, attr = str(path).rpartition(".")
    obj = getattr(importlib.import_module(module), attr)
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise TypeError(f"{path} is not a {base.__module__}.{base.__qualname__} class")
    return obj


def unit_classes(wrap: Iterable[Any]) -> tuple[type, ...]:
    """The unit classes of ``wrap``: classes, or import paths imported here (the planner keeps paths, so that an
    answer read from its store needs no import of the model's code: :mod:`zeroexp.cell.store`)."""
    return tuple(import_class(c) if isinstance(c, str) else c for c in wrap)


def unit_names(wrap: Iterable[Any]) -> tuple[str, ...]:
    """What keys an answer by ``wrap``'s classes: an import path as given, a class by its qualified name."""
    return tuple(c if isinstance(c, str) else c.__qualname__ for c in wrap)


def wrap_paths(cfg: Any) -> list[str]:
    """The module classes wrapped as FSDP units: ``strategy.wrap``, else the model's ``model.wrap``, else none (the
    whole model is then one unit)."""
    strategy = cfg.strategy if cfg.get("strategy") is not None else {}
    paths = strategy.get("wrap") if strategy.get("wrap") is not None else cfg.model.get("wrap")
    if paths is None:
        paths = _factory_hook(cfg.model, "zeroexp_units")
    return [str(p) for p in (paths or [])]


def _factory_hook(model_cfg: Mapping[str, Any], name: str) -> Any:
    """What the model's factory says of itself (``zeroexp.models.hf.causal_lm``: its units, its vocabulary), from the
    model node; None when the factory has no such hook."""
    hook = getattr(import_class(str(model_cfg["_target_"]), base=None), name, None)
    return hook(model_cfg) if callable(hook) else None


def token_range(model_cfg: Mapping[str, Any]) -> tuple[int, int]:
    """``[low, high)`` of a ``long`` input's token ids: ``model.low`` and ``model.high``, a null ``high`` the factory's
    own vocabulary (an HF model's ``vocab_size``)."""
    high = model_cfg.get("high")
    if high is None:
        high = _factory_hook(model_cfg, "zeroexp_vocab_size")
    return int(model_cfg.get("low", 0)), int(high if high is not None else 2)


def checkpoint_units(module: nn.Module, classes: tuple[type, ...], mode: Any = None) -> None:
    """Replace the modules of ``classes`` inside ``module`` that ``mode`` checkpoints (a
    :class:`~zeroexp.formulas.peak.checkpointing.Checkpointing`; None: ``full``, every one) by torch's non-reentrant
    ``checkpoint_wrapper``, under ``selective_op`` with its policy (:func:`zeroexp.models.sac.policy_contexts`): the
    one way zeroexp checkpoints activations (``StrategyAdapter.checkpoint_activations``, the traced step, the counted
    FLOPs)."""
    from zeroexp._lib.checkpointing import checkpoint_modules
    from zeroexp.formulas.peak.checkpointing import FULL
    from zeroexp.models.sac import policy_contexts

    mode = FULL if mode is None else mode
    if not mode:
        return
    units = [m for m in module.modules() if isinstance(m, classes)]  # in forward order (registration order)
    chosen = {id(m) for i, m in enumerate(units) if mode.checkpointed(i)}
    checkpoint_modules(module, classes, lambda m: id(m) in chosen, policy_contexts(mode) if mode.policy else None)


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's arguments or output (nested in tuples, lists, dicts or a ModelOutput) that require
    grad, in order."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in grad_tensors(o)]
    if isinstance(output, Mapping):
        return [t for o in output.values() for t in grad_tensors(o)]
    return []


def requires_grad(output: Any) -> bool:
    """Whether any tensor in a module's output (nested in tuples, lists, dicts or a ModelOutput) requires grad: where
    FSDP registers its pre-backward hooks, so whether backward reaches the module."""
    return bool(grad_tensors(output))


def unused_parameters(model_cfg: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The trainable parameters one step of the model config's module gives no gradient (a branch forward never
    calls), by name: built on the meta device, one forward, the loss and backward on a zero batch of two samples.
    None when the module's step does not run on the meta device (then nothing is known)."""
    with torch.device("meta"):
        net = build_model(model_cfg)
    batch = zeros_batch(model_cfg, 2, device="meta")
    try:
        loss = loss_of(model_cfg)(net(batch), batch)
        if loss.requires_grad:
            loss.backward()
    except Exception:  # noqa: BLE001 - a module that needs real data: not known
        return None
    return tuple(n for n, p in net.named_parameters() if p.requires_grad and p.grad is None)
