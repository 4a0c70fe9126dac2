"""The model a plan or a recommendation is of: its shape built on the meta device (:func:`model_shape`), its FSDP
units (:func:`wrap_units`), and the store on disk that keeps both, with its traced steps and forwards, for the next
invocation of the same model and code (:func:`answer_store`, :mod:`zeroexp.cell.store`). Shared by
``zeroexp.cli.plan`` and ``zeroexp.cli.recommend``; every error names the planner's key."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from zeroexp.errors import ConfigError
from zeroexp.formulas import ModelShape
from zeroexp.plan.core import parse_count

__all__ = ["answer_store", "model_shape", "wrap_units"]


def model_shape(cfg: DictConfig) -> tuple[ModelShape, str]:
    """The planned model's shape: a parameter count's (no torch), or the model config's built on the meta device
    (remembered by the model config and ``wrap``: :data:`zeroexp.cell.memo.STORED_TABLES`)."""
    if (cfg.model is None) == (cfg.params is None):
        raise ConfigError("params", cfg.params, "either a parameter count (params=7.5e9) or a model (model=mlp, "
                          "conf/model/), not both", why="both given" if cfg.model is not None else "neither given")
    if cfg.model is None:
        try:
            return ModelShape.from_count(parse_count(cfg.params)), "params"
        except ValueError as e:
            raise ConfigError("params", cfg.params, "a positive count: 7.5e9, 7.5B, 350M, 1T", why=str(e)) from e
    from zeroexp.cell.memo import memoized

    return memoized("plan_shapes", _model_wrap_key(cfg), lambda: _built_shape(cfg))


def _model_wrap_key(cfg: DictConfig) -> str | None:
    """The model config (resolved) and ``wrap=``: what a plan's shape and units are answers of."""
    from zeroexp.plan.shape import arguments_key

    return arguments_key(cfg.model, list(cfg.wrap) if cfg.wrap is not None else None)


def _built_shape(cfg: DictConfig) -> tuple[ModelShape, str]:
    import torch

    from zeroexp.models import build_model, import_class, wrap_paths
    from zeroexp.plan.shape import shape_of

    wrap = wrap_paths(OmegaConf.create({"strategy": {"wrap": cfg.wrap}, "model": cfg.model}))
    try:
        classes = [import_class(p) for p in wrap]
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        key = "wrap" if cfg.wrap is not None else "model.wrap"
        raise ConfigError(key, wrap, "import paths of nn.Module classes", why=f"{type(e).__name__}: {e}") from e
    try:
        with torch.device("meta"):
            net = build_model(cfg.model)
    except Exception as e:  # noqa: BLE001 - any failure of the user's factory is a config error
        cause = e.__cause__ or e
        if isinstance(cause, ConfigError):  # the factory named the key itself (zeroexp.models.hf)
            raise cause from e
        raise ConfigError("model._target_", cfg.model.get("_target_"), "a factory that builds an nn.Module from "
                          "the model config's other keys", why=f"{type(cause).__name__}: {cause}") from e
    shape = shape_of(net, classes, model_cfg=cfg.model)
    if not shape.numel:
        raise ConfigError("model", cfg.model.name, "a model with parameters", why="it has none")
    return shape, str(cfg.model.name)


def wrap_units(cfg: DictConfig) -> list[str]:
    """The FSDP unit classes of a plan or recommend config, as import paths (imported where a step is traced:
    ``zeroexp.models.unit_classes``): ``wrap=``, else the model's own ``model.wrap``, else its factory's (checked by
    :func:`model_shape` first; remembered as the shape is)."""
    from zeroexp.cell.memo import memoized
    from zeroexp.models import wrap_paths

    return list(memoized("wrap_units", _model_wrap_key(cfg), lambda: wrap_paths(OmegaConf.create(
        {"strategy": {"wrap": cfg.wrap}, "model": cfg.model}))))


@contextmanager
def answer_store(cfg: DictConfig, notes: list[str]) -> Iterator[None]:
    """The body reads and writes the answers a model's plan shares with later invocations in the store on disk
    (:mod:`zeroexp.cell.store`: ``cache=true``, ``$ZEROEXP_CACHE_DIR`` or ``outputs/cache/``; none for a parameter
    count, or a model whose code is no installed distribution's nor zeroexp's; a ``model.config_path`` file counted
    in by its bytes); what it read and wrote appended to ``notes``."""
    from zeroexp.cell.memo import stored_answers
    from zeroexp.cell.store import AnswerStore, fingerprint, store_directory

    directory = store_directory(bool(cfg.cache)) if cfg.get("model") is not None else None
    files = [str(cfg.model.config_path)] if directory is not None and cfg.model.get("config_path") else []
    code = fingerprint(_code_paths(cfg), files) if directory is not None else None
    store = AnswerStore(directory, code) if code is not None else None
    with stored_answers(store):
        yield
    if store is not None and (store.read or store.written):
        notes.append(store.summary())


def _code_paths(cfg: DictConfig) -> list[str]:
    """The import paths whose code a plan of ``cfg.model`` runs: every ``_target_`` in the model config, its
    ``model.wrap`` and ``wrap=``."""
    def targets(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "_target_":
                    yield str(v)
                yield from targets(v)
        elif isinstance(node, list):
            for v in node:
                yield from targets(v)
    model = OmegaConf.to_container(cfg.model, resolve=True)
    return [*targets(model), *(str(p) for p in (model.get("wrap") or [])), *(str(p) for p in (cfg.wrap or []))]
