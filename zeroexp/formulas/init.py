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

from zeroexp.formulas.layout import ModelShape, pack
from zeroexp.formulas.paper import fsdp2_padded_numel, padded_numel
from zeroexp.formulas.rows import LAYOUTS

__all__ = ["INIT_KINDS", "INIT_KIND_OF_ROW", "init_peak_bytes", "largest_init_step"]

#: How each kind of row shards its parameters at initialisation (``init_peak_bytes``'s ``kind``).
INIT_KINDS = ("fsdp1", "fsdp2", "replica")
#: The rows of ``LAYOUTS`` whose ``init=meta`` is modelled, by kind (their adapters' ``meta_init``: ``replica`` or
#: ``shards``), read off each row's ``init_kind``. Not here: the paper's rows (no runtime), DeepSpeed's (refused),
#: hybrid sharding's (not modelled).
INIT_KIND_OF_ROW = {name: row.init_kind for name, row in LAYOUTS.items() if row.init_kind is not None}


def largest_init_step(shape: ModelShape) -> int:
    """Elements of the largest init step: the most parameters one module owns itself (``ModelShape.modules``)."""
    numels = shape.numels
    return max((sum(numels[i] for i in m) for m in shape.modules), default=0)


def _units(shape: ModelShape, kind: str, n: int, align: int = 0) -> list[tuple[int, int, int]]:
    """(u_k, f_k, s_k) per unit in wrap order: its elements, its FlatParameter's (FSDP1: ``u_k``, or with ``align``,
    ``use_orig_params``'s aligned layout padded to N) and the rank's shard (rank 0: a full chunk)."""
    out = []
    for unit in shape.units:
        u = sum(shape.numels[i] for i in unit)
        flat = padded_numel(pack([shape.numels[i] for i in unit], align)[1], n) if align and u else u
        s = (padded_numel(flat, n) if kind == "fsdp1" else
             sum(fsdp2_padded_numel(shape.params[i], n) for i in unit)) // n
        out.append((u, flat, s))
    return out


def init_peak_bytes(shape: ModelShape, kind: str, init: str, world_size: int, itemsize: int = 4,
                    use_orig_params: bool = True) -> int:
    """The init peak of the largest rank in bytes (computed): see the module docstring for each ``kind``
    (:data:`INIT_KINDS`) and ``init`` (``full`` | ``meta``); ``use_orig_params``: FSDP1's."""
    if kind not in INIT_KINDS or init not in ("full", "meta"):
        raise ValueError(f"init_peak_bytes: kind {kind!r} (accepted {INIT_KINDS}), init {init!r} (full, meta)")
    c, n, total = itemsize, world_size, shape.numel
    step = largest_init_step(shape)
    if kind == "replica":
        return c * total + (c * step if init == "meta" else 0)
    units = _units(shape, kind, n, 16 // c if kind == "fsdp1" and use_orig_params else 0)
    mesh = 4 * n if kind == "fsdp2" else 0  # FSDP2's device mesh: its rank map, int32
    if kind == "fsdp2":
        if init == "meta":  # fully_shard on meta allocates nothing; to_empty the shards, then the replay
            return mesh + c * sum(s for _, _, s in units) + c * step
        peak, held = 0, mesh + c * total  # bytes held before unit k
        for u, _, s in units:  # each unit's padded shards copied, then its parameters freed
            peak, held = max(peak, held + c * s), held + c * s - c * u
        return peak
    return max(_fsdp1_rank_peak(units, r, n, c, total, step, init) for r in range(n))


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
