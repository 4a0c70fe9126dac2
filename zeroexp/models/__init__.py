"""Models, synthetic data and losses: :mod:`zeroexp.models.build` (the built-in models, building any model from its
config, seeded synthetic batches, the losses), :mod:`~zeroexp.models.schemas` (their config schemas), the GPT, LoRA,
meta-device init and the LightningModule in their own modules.

Importing the package imports no torch: composing a cell (``python -m zeroexp --help``, a refused override) reads the
schemas alone; every name of ``build`` is read from it on first use (``zeroexp.models.LinearStack`` included, the
path the configs name).
"""

from __future__ import annotations

from typing import Any

from zeroexp.models.schemas import MODEL_RESERVED_KEYS

#: The names :mod:`zeroexp.models.build` provides here.
_BUILD = ("LinearStack", "LOSSES", "build_model", "make_batch", "zeros_batch", "loss_of", "import_class", "wrap_paths",
          "token_range", "torch_dtype", "checkpoint_units", "grad_tensors", "requires_grad", "unused_parameters",
          "unit_classes", "unit_names")

__all__ = ["MODEL_RESERVED_KEYS", *_BUILD]


def __getattr__(name: str) -> Any:
    if name in _BUILD:
        from zeroexp.models import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
