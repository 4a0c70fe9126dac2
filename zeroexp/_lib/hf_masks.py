"""transformers' attention-mask preparation as zeroexp's fake-tensor traces need it (``transformers.masking_utils``,
transformers 5: a module-level function, not a documented hook). A leaf: it imports nothing of zeroexp.

With no cache (training: ``use_cache=False``) transformers looks for packed sequences in the position ids
(``find_packed_sequence_indices``): on real data it finds none in ``0..S-1`` and attention takes SDPA's ``is_causal``
path (no mask; grouped-query K/V not repeated); on fake tensors (or the meta device) it cannot read the values, keeps a
packed-sequence mask, and attention then builds an explicit mask and repeats K/V -- another path, whose saved tensors
are not the run's (a shrunk Llama: 24,576 B a layer at two samples). zeroexp feeds one token tensor and never position
ids, so the model's positions are its own ``arange``: never packed. Under fake tensors the check answers as it does on
that data."""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["install_unpacked_positions"]


def install_unpacked_positions() -> bool:
    """If transformers' ``masking_utils`` is imported, make its ``find_packed_sequence_indices`` answer None (no packed
    sequences) for fake or meta position ids (the meta device cannot read them either: ``.item()`` raises), as it
    answers for the ``arange`` positions of every zeroexp input; real tensors are answered by transformers' own
    function. On fake and meta tensors its operators and the check run as on data (a traced step counts and
    allocates what the run does), the answer None. Idempotent; False when transformers' module is not loaded."""
    masks = sys.modules.get("transformers.masking_utils")
    if masks is None or not hasattr(masks, "find_packed_sequence_indices"):
        return False
    original = masks.find_packed_sequence_indices
    if getattr(original, "_zeroexp_unpacked", False):
        return True

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        from torch._subclasses.fake_tensor import is_fake

        if position_ids.device.type == "meta":  # the meta device reads no value, and counts no operator
            return None
        if not is_fake(position_ids):
            return original(position_ids)
        mask = original(position_ids)  # its operators, as a step on data dispatches them (step_ops counts them)
        if mask is not None:
            try:  # and the check data answers (a real step dispatches it; here its value cannot be read)
                bool((mask[:, -1] == 0).all())
            except RuntimeError:  # fake tensors' DataDependentOutputException
                pass
        return None

    find_packed_sequence_indices._zeroexp_unpacked = True  # type: ignore[attr-defined]
    masks.find_packed_sequence_indices = find_packed_sequence_indices
    return True
