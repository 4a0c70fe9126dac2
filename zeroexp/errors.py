"""The errors zeroexp refuses a configuration with: a leaf module (it imports nothing of zeroexp), so every layer
(config, strategies, planner, CLI) can raise them."""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "NotApplicableHere"]


class ConfigError(ValueError):
    """A configuration that zeroexp refuses before any work starts.

    The message always names the offending key, the given value and what is accepted.
    """

    def __init__(self, key: str, value: Any, accepted: str, why: str = "") -> None:
        self.key, self.value, self.accepted = key, value, accepted
        msg = f"invalid config: {key}={value!r}: {why + '; ' if why else ''}accepted: {accepted}"
        super().__init__(msg)


class NotApplicableHere(ConfigError):
    """A cell of valid axis values that cannot run, on this machine (FSDP CPU offload with no accelerator) or in
    this combination (DeepSpeed offload at stage 0): refused up front in a single run; in a ``--multirun`` sweep
    the cell is ``skipped`` with this message and the sweep goes on (a sweep is a product of axes)."""
