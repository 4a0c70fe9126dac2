"""What the equivalence probe's unsharded reference holds in host memory, on rank 0, after the measured steps.

Read from ``zeroexp.probes.equivalence`` (``EquivalenceProbe.on_train_end``, ``train_reference``): rank 0 copies the
trained full parameters to the CPU, then trains the reference, a plain fp32 module (``build_model``, the model's own
dtype) with ``torch.optim.AdamW``, in one process on every rank's batch; with ``world_size`` > 1 it trains it a
second time with data parallelism's arithmetic while keeping the first one's parameters. Its two moments exist from
the first update on, a gradient per trainable parameter from the first backward. Counted in two moments, the largest
of which is the reference's peak (computed from the code's structure, not measured; a lower bound of what the
allocator holds: AdamW's per-tensor temporaries and the batches are left out):

- the mean loss (``torch.stack`` of every rank's loss, one backward): the copy (4 B a parameter), the module (4 B),
  its gradients (4 B a trainable parameter) and moments (8 B), and the saved activations of all ``world_size``
  forwards at once;
- data parallelism's arithmetic (one rank's forward and backward at a time): the copy and the first reference's
  parameters (4 + 4 B), the module (4 B), its moments (8 B), and per trainable parameter its gradient, the running
  sum ``total`` and the new sum ``t + g`` while it is formed (3 x 4 B), beside one forward's activations.

``zeroexp.config.resources`` counts it before a local cell starts, beside each rank's state and activations.
"""

from __future__ import annotations

__all__ = ["reference_host_bytes", "FP32"]

#: The reference's dtype: ``build_model`` builds the module in its own dtype, fp32 for every model zeroexp builds.
FP32 = 4


def reference_host_bytes(numel: int, trainable: int, activations: int, world_size: int) -> int:
    """The reference's peak host bytes (see the module): ``numel`` parameters of which ``trainable`` train,
    ``activations`` the bytes one fp32 forward at the cell's per-rank micro-batch saves for backward (output and loss
    included), ``world_size`` ranks' batches a step."""
    mean_loss = FP32 * (2 * numel + trainable) + 2 * FP32 * trainable + world_size * activations
    if world_size == 1:  # one rank: no other order, no second reference
        return mean_loss
    averaged = FP32 * (3 * numel + 3 * trainable) + 2 * FP32 * trainable + activations
    return max(mean_loss, averaged)
