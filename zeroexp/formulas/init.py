"""The initialisation peak of one rank: the most bytes it holds at once while the model is built and wrapped, with
``init=full`` (every rank builds the whole model, then wraps it) and ``init=meta`` (built on the meta device, each
rank materialises its part: zeroexp/models/init.py, zeroexp/strategies/_meta_init.py), for the largest rank.

Read from the source, per FSDP unit k in wrap order (children first, the root last), u_k its parameters' elements,
s_k the elements of the rank's shard, c bytes per element:

- FSDP1 [FSDP-INIT] (torch/distributed/fsdp/_flat_param.py ``flatten_tensors``, ``FlatParamHandle.shard``): a
  unit's parameters (u_k) are concatenated into the FlatParameter (u_k) and the rank's chunk is cloned (s_k; a
  short last chunk cloned, then padded to s_k) before the unit's parameters and the full FlatParameter are freed;
  the largest rank is the one with the longest short chunk, rank 0 when every unit divides by N. With
  ``use_orig_params`` (FSDP1's default) ``flatten_tensors`` lays the parameters 16-byte aligned and pads the
  FlatParameter to a multiple of N as it concatenates (padding tensors in the ``cat``): every chunk is full, none
  short, and the FlatParameter is the padded length. ``full``: the whole
  model is there
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

Not modelled: the process group's own buffers, hybrid sharding (shards over the shard group), DeepSpeed
(``init=meta`` refused).
"""

from __future__ import annotations

from zeroexp.formulas.layout import pack
from zeroexp.formulas.paper import fsdp2_padded_numel, padded_numel
from zeroexp.formulas.shapes import ModelShape

__all__ = ["init_peak_bytes", "largest_init_step", "replica_init_peak_bytes", "fsdp1_init_peak_bytes",
           "fsdp2_init_peak_bytes"]


def init_peak_bytes(shape: ModelShape, row, init: str, world_size: int, itemsize: int = 4,
                    use_orig_params: bool = True) -> int | None:
    """The init peak of the largest rank in bytes (computed) under ``row`` (a
    :class:`~zeroexp.formulas.layout.StateLayout`) and ``init`` (``full`` | ``meta``): its family's
    (:meth:`zeroexp.formulas.families.Family.init_peak_bytes`); None where the row's init is not modelled
    (``StateLayout.init_modelled``); ``use_orig_params``: FSDP1's."""
    if init not in ("full", "meta"):
        raise ValueError(f"init_peak_bytes: init {init!r} (accepted: full, meta)")
    if not row.init_modelled:
        return None
    return row.family.init_peak_bytes(shape, init, world_size, itemsize, use_orig_params)


def largest_init_step(shape: ModelShape) -> int:
    """Elements of the largest init step: the most parameters one module owns itself (``ModelShape.modules``)."""
    numels = shape.numels
    return max((sum(numels[i] for i in m) for m in shape.modules), default=0)


def replica_init_peak_bytes(shape: ModelShape, init: str, itemsize: int) -> int:
    """A replica's: the whole model, and with ``meta`` the replay's one module beside it."""
    c = itemsize
    return c * shape.numel + (c * largest_init_step(shape) if init == "meta" else 0)


def fsdp1_init_peak_bytes(shape: ModelShape, init: str, world_size: int, itemsize: int,
                          use_orig_params: bool) -> int:
    """FSDP1's, the largest rank's (``use_orig_params``: the 16-byte aligned layout padded to N)."""
    c, n = itemsize, world_size
    align = 16 // c if use_orig_params else 0
    units = []  # (u_k, f_k, s_k): its elements, its FlatParameter's, the rank's shard (rank 0: a full chunk)
    for unit in shape.units:
        u = sum(shape.numels[i] for i in unit)
        flat = padded_numel(pack([shape.numels[i] for i in unit], align)[1], n) if align and u else u
        units.append((u, flat, padded_numel(flat, n) // n))
    step = largest_init_step(shape)
    return max(_fsdp1_rank_peak(units, r, n, c, shape.numel, step, init) for r in range(n))


def fsdp2_init_peak_bytes(shape: ModelShape, init: str, world_size: int, itemsize: int) -> int:
    """FSDP2's: its device mesh's rank map, then each unit's padded shards copied before its parameters are freed."""
    c, n = itemsize, world_size
    shards = [sum(fsdp2_padded_numel(shape.params[i], n) for i in unit) // n for unit in shape.units]
    mesh = 4 * n  # FSDP2's device mesh: its rank map, int32
    if init == "meta":  # fully_shard on meta allocates nothing; to_empty the shards, then the replay
        return mesh + c * sum(shards) + c * largest_init_step(shape)
    peak, held = 0, mesh + c * shape.numel  # bytes held before unit k
    for unit, s in zip(shape.units, shards):  # each unit's padded shards copied, then its parameters freed
        u = sum(shape.numels[i] for i in unit)
        peak, held = max(peak, held + c * s), held + c * s - c * u
    return peak


def _fsdp1_rank_peak(units: list[tuple[int, int, int]], rank: int, n: int, c: int, total: int, step: int,
                     init: str) -> int:
    """FSDP1, rank ``rank``: at each unit, the unit's parameters (materialised just before with ``meta``), their
    concatenation (the FlatParameter, unpadded), and the rank's chunk of it cloned (``FlatParamHandle._get_shard``:
    ``torch.chunk`` into ceil(u / N) elements, so the last ranks' chunks are short or empty); a short chunk is then
    padded to a full shard (``F.pad``: a second tensor while the clone lives)."""
    peak, held = 0, (c * total if init == "full" else 0)  # bytes held before unit k
    for u, flat, s in units:
        chunk = min(max(flat - rank * s, 0), s)
        short = chunk if chunk < s else 0  # the clone that F.pad copies into a full shard
        materialised = 0 if init == "full" else c * u  # meta: param_init_fn materialises the unit just before
        peak = max(peak, held + materialised + c * flat + c * short + c * s)
        held += c * s - (c * u if init == "full" else 0)
    return max(peak, held + c * step) if init == "meta" else peak
