"""Lightning's Trainer internals as zeroexp touches them. A leaf: it imports nothing of zeroexp, nor Lightning."""

from __future__ import annotations

from typing import Any

__all__ = ["skip_sigterm_broadcast"]


def skip_sigterm_broadcast(trainer: Any) -> None:
    """Turn off the SIGTERM flag broadcast ``trainer``'s fit loop makes before every training step.

    Lightning >= 2.5 (targeted: 2.6) broadcasts a SIGTERM flag from rank 0 before every step
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``, private) and reads it back with ``.item()``, a device sync on
    CUDA. It is not the strategy's traffic and zeroexp's launcher ends ranks itself: the epoch loop's method is
    replaced by a no-op. On a Lightning without it this sets an attribute nothing reads (tests/test_lib_shims.py
    fails on an installed Lightning that lacks it)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
