"""The initialisation peak of one rank: the most bytes it holds at once while the model is built and wrapped, with
``init=full`` (every rank builds the whole model, then wraps it) and ``init=meta`` (built on the meta device, each
rank materialises its part: zeroexp/models/init.py, zeroexp/strategies/_meta_init.py). The largest rank: rank 0,
whose shards are never short.

Read from the source, per FSDP unit k in wrap order (children first, the root last), u_k its parameters' elements,
s_k the elements of the rank's shard, c bytes per element:

- FSDP1 [FSDP-INIT] (torch/distributed/fsdp/_flat_param.py ``flatten_tensors``, ``FlatParamHandle.shard``): a
  unit's parameters (u_k) are concatenated into the padded FlatParameter (N s_k) and the rank's chunk is cloned
  (s_k) before the unit's parameters and the full FlatParameter are freed. ``full``: the whole model is there
  before, and each unit done leaves only its shard. ``meta``: ``param_init_fn`` materialises the unit just
  before; afterwards the replay holds one module's own parameters (the largest init step, ``step``) beside
  every shard.
- FSDP2 [FSDP2-INIT] (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``): each parameter's
  padded chunk is copied into new storage (s_k per unit), then the unit's parameters are freed. ``meta``:
  ``fully_shard`` on meta tensors allocates nothing, ``to_empty`` the shards, then the replay as for FSDP1. Both
  also hold the device mesh's rank map (``init_device_mesh``: ``torch.arange(N, dtype=torch.int)`` on the CPU,
  4 N bytes), made as the adapter wraps.
- replicas (``ddp``, ``zro``, ``zero1``, ``zero2``): the whole model, and with ``meta`` the replay's one module
  beside it. What a wrapper adds at wrapping (DDP's broadcast of the module states) is not in this model.

Not modelled: the process group's own buffers, FSDP1
``use_orig_params`` alignment, hybrid sharding (shards over the shard group), DeepSpeed (``init=meta`` refused).
"""

from __future__ import annotations

from zeroexp.formulas.layout import ModelShape
from zeroexp.formulas.paper import fsdp2_padded_numel, padded_numel

__all__ = ["INIT_KINDS", "INIT_KIND_OF_ROW", "init_peak_bytes", "largest_init_step"]

#: How each kind of row shards its parameters at initialisation (``init_peak_bytes``'s ``kind``).
INIT_KINDS = ("fsdp1", "fsdp2", "replica")
#: The rows of ``LAYOUTS`` whose ``init=meta`` is modelled, by kind (their adapters' ``meta_init``: ``replica`` or
#: ``shards``). Not here: the paper's rows (no runtime), DeepSpeed's (refused), hybrid sharding's (not modelled).
INIT_KIND_OF_ROW = {"ddp": "replica", "zro": "replica", "zero1": "replica", "zero2": "replica",
                    "fsdp_grad_op": "fsdp1", "fsdp_full": "fsdp1", "fsdp2_grad_op": "fsdp2", "fsdp2_full": "fsdp2"}


def largest_init_step(shape: ModelShape) -> int:
    """Elements of the largest init step: the most parameters one module owns itself (``ModelShape.modules``)."""
    numels = shape.numels
    return max((sum(numels[i] for i in m) for m in shape.modules), default=0)


def _units(shape: ModelShape, kind: str, n: int) -> list[tuple[int, int]]:
    """(u_k, s_k) per unit in wrap order: its elements and the rank's shard (rank 0: a full chunk)."""
    out = []
    for unit in shape.units:
        u = sum(shape.numels[i] for i in unit)
        s = (padded_numel(u, n) if kind == "fsdp1" else sum(fsdp2_padded_numel(shape.params[i], n) for i in unit)) // n
        out.append((u, s))
    return out


def init_peak_bytes(shape: ModelShape, kind: str, init: str, world_size: int, itemsize: int = 4) -> int:
    """The init peak of the largest rank in bytes (computed): see the module docstring for each ``kind``
    (:data:`INIT_KINDS`) and ``init`` (``full`` | ``meta``)."""
    if kind not in INIT_KINDS or init not in ("full", "meta"):
        raise ValueError(f"init_peak_bytes: kind {kind!r} (accepted {INIT_KINDS}), init {init!r} (full, meta)")
    c, n, total = itemsize, world_size, shape.numel
    step = largest_init_step(shape)
    if kind == "replica":
        return c * total + (c * step if init == "meta" else 0)
    units = _units(shape, kind, n)
    mesh = 4 * n if kind == "fsdp2" else 0  # FSDP2's device mesh: its rank map, int32
    if kind == "fsdp2" and init == "meta":  # fully_shard on meta allocates nothing; to_empty the shards, the replay
        return mesh + c * sum(s for _, s in units) + c * step
    flat = 1 if kind == "fsdp1" else 0  # FSDP1 also holds the padded FlatParameter (n s_k) while it shards
    peak, held = 0, mesh + (c * total if init == "full" else 0)  # bytes held before unit k
    for u, s in units:
        materialised = 0 if init == "full" else c * u  # FSDP1 meta: param_init_fn materialises the unit just before
        peak = max(peak, held + materialised + flat * c * n * s + c * s)
        held += c * s - (c * u if init == "full" else 0)
    if init == "meta":
        peak = max(peak, held + c * step)
    return peak

