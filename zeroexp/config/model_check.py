"""The model checked before launch: its ``_target_`` imports, it builds on the meta device from
the model config's keys, and one forward and the loss run on a batch of the cell's input shape -- so a bad factory
argument, a sample shape the model cannot take or a loss that cannot take its output is refused in one line
(:class:`~zeroexp.errors.ConfigError`, exit 2), in well under a second, before any rank starts. Called by
``zeroexp.config.schemas.validate``."""

from __future__ import annotations

import re
from typing import Any

from zeroexp.errors import ConfigError

__all__ = ["check_model", "CHECK_BATCH", "OPTIONAL_EXTRAS"]


def check_model(cfg: Any) -> None:
    """Refuse the cell's model (``cfg.model``) if it does not import, build, or run one forward and its loss. A model
    config found good once in this invocation is not built again (a refusal is always computed afresh)."""
    from omegaconf import OmegaConf

    from zeroexp.cell.memo import memo_table

    # a sweep validates each of its jobs, which mostly share a model (a meta build and a forward: 0.1 s on a small
    # MLP, more on a GPT): a model config found good is remembered for the invocation (zeroexp.cell.memo)
    key, passed = OmegaConf.to_yaml(cfg.model, resolve=True), memo_table("models_checked")
    if passed is not None and key in passed:
        return
    _check_target(str(cfg.model._target_))
    _check_model_builds(cfg)
    if passed is not None:
        passed[key] = True


#: The batch of the model check: 2 samples (a batch dimension of 1 can hide a shape mistake).
CHECK_BATCH = 2


def _check_model_builds(cfg: Any) -> None:
    """Build the model on the meta device (no memory, any size) and run one forward and the loss on a batch of
    the cell's input shape, so bad factory arguments (``model._target_`` or the argument's key), a sample shape the
    model cannot take (``model.input_shape``) and a loss that cannot take its output (``model.loss``) fail now, in
    one line, before any rank starts. An operator with no meta kernel (or a model that reads values, ``.item()``)
    cannot be checked this way: the forward check is then skipped, not refused. A model that declares a stack of
    identical blocks deeper than the planner derives (``zeroexp.plan.stack.stack_of``: Llama 3 405B's 126 decoder
    layers) is checked at the planner's shallowest depth: each block takes what the one before gives, so the stack
    runs at any depth where it runs at that one (the whole 405B forward on meta tensors took 1.7 s of a 2.4-s check)."""
    import torch

    from zeroexp.errors import one_line
    from zeroexp.models import LOSSES, build_model, torch_dtype
    from zeroexp.plan.stack import STEP_DEPTHS, at_depth, stack_of

    stack = stack_of(cfg.model)
    model_cfg = cfg.model if stack is None else at_depth(cfg.model, stack[0], STEP_DEPTHS[0])
    try:
        with torch.device("meta"):
            net = build_model(model_cfg)
    except Exception as e:  # noqa: BLE001 - any failure of the user's factory is a config error
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):  # the factory named the key itself (zeroexp.models.hf)
            raise cause from e
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(cause))
        if isinstance(cause, TypeError) and unexpected and unexpected.group(1) in cfg.model:
            key = f"model.{unexpected.group(1)}"
            raise ConfigError(key, cfg.model[unexpected.group(1)], f"the arguments of {cfg.model._target_}",
                              why=f"{cfg.model._target_} does not take {unexpected.group(1)!r}") from e
        raise ConfigError("model._target_", cfg.model._target_, "a factory that builds an nn.Module from the "
                          "model config's other keys", why=f"{type(cause).__name__}: {one_line(str(cause), 300)}") \
            from e
    shape = (CHECK_BATCH, *(int(d) for d in cfg.model.input_shape))
    batch = torch.empty(shape, dtype=torch_dtype(str(cfg.model.dtype)), device="meta")

    def unchecked(e: BaseException) -> bool:  # the meta device cannot run it: no verdict
        return isinstance(e, NotImplementedError) or "meta" in str(e).lower()

    try:
        with torch.no_grad():
            out = net(batch)
    except Exception as e:  # noqa: BLE001
        if unchecked(e):
            return
        if _needs_more_inputs(e):  # T5: decoder inputs; any forward(a, b) without defaults
            raise ConfigError("model._target_", cfg.model._target_, "a module whose forward takes one batch tensor of "
                              "model.input_shape (zeroexp feeds one synthetic tensor; wrap the model so that it "
                              "makes its other inputs, e.g. a decoder's, from it)",
                              why=f"its forward needs more than one input: {type(e).__name__}: "
                                  f"{one_line(str(e), 300)}") from e
        raise ConfigError("model.input_shape", list(cfg.model.input_shape),
                          f"the shape of one sample that {cfg.model._target_} takes",
                          why=f"one forward on a batch of shape {list(shape)} ({cfg.model.dtype}) fails: "
                              f"{type(e).__name__}: {one_line(str(e), 300)}") from e
    try:
        loss = LOSSES[str(cfg.model.loss)](out, batch)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise ValueError(f"the loss is not one number (shape {list(getattr(loss, 'shape', []))})")
    except Exception as e:  # noqa: BLE001
        if unchecked(e):
            return
        got = getattr(out, "shape", None)
        raise ConfigError("model.loss", cfg.model.loss, ", ".join(sorted(LOSSES)),
                          why=f"it cannot take the model's output ({type(out).__name__}"
                              f"{' of shape ' + str(list(got)) if got is not None else ''}): "
                              f"{type(e).__name__}: {one_line(str(e), 300)}") from e


#: Optional dependencies and the extra that installs them.
OPTIONAL_EXTRAS = {"transformers": "hf", "deepspeed": "deepspeed"}


def _check_target(target: str) -> None:
    from zeroexp.models import import_class

    try:
        obj = import_class(target, base=None)
    except (ImportError, AttributeError, ValueError) as e:
        why = str(e)
        top = target.split(".")[0]
        if isinstance(e, ImportError) and top in OPTIONAL_EXTRAS:
            why = f"{top} is not installed; install it with: pip install -e '.[{OPTIONAL_EXTRAS[top]}]'"
        raise ConfigError("model._target_", target, "an importable nn.Module class or factory", why=why) from e
    if not callable(obj):
        raise ConfigError("model._target_", target, "an importable nn.Module class or factory", why="not callable")


def _needs_more_inputs(e: BaseException) -> bool:
    """Whether a forward failed for an input it was not given (a missing argument, a decoder's inputs), not for the
    shape of the one it was."""
    text = str(e)
    return (isinstance(e, TypeError) and "missing" in text and "argument" in text) or \
        bool(re.search(r"(specify|provide|pass)\b.*\b(decoder_input|input_ids|inputs_embeds|labels)", text))
