"""Plan records: for one strategy at one world size, the bytes each rank keeps and sends, from zeroexp.formulas.

Nothing here allocates a parameter: a model enters as a :class:`~zeroexp.formulas.ModelShape` (its parameters'
shapes and FSDP units, read on the meta device by :mod:`zeroexp.plan.shape`) or as a bare count.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from zeroexp.cell.memo import memoized
from zeroexp.errors import ConfigError
from zeroexp.formulas import (COMPUTE_ITEMSIZE, LAYOUTS, STATE_KINDS, Groups, ModelShape, PlanKnobs, StateLayout,
                              derive_groups, offloaded_kinds, op_bus_bytes, pack, padded_numel, rank_state_bytes,
                              step_collectives, unsharded_floor_bytes)

__all__ = ["Precision", "strategy_table", "plan", "plan_record", "row_groups", "largest_unit_bytes", "parse_bytes",
           "parse_count", "judge_fits", "recommendable", "usable_bytes", "check_headroom", "untraced", "FITS_ON",
           "HEADROOM", "OFFLOADS", "UNITS"]

OFFLOADS = ("none", "optimizer", "full")
#: Table units: GB is 1e9 bytes (the ZeRO paper's, Figure 1), GiB is 2^30 bytes.
UNITS = {"GB": 10**9, "GiB": 2**30}
_SIZE = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30, "TIB": 2**40}
_COUNT = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
#: The fraction of a device's memory every prediction must leave free, in ``plan`` (``headroom=``), ``recommend``
#: (``recommend.headroom=``) and before a local run (``resources.headroom=``, against the host's available memory):
#: what none of them counts (the caching allocator's fragmentation beyond its rounding and the order of requests,
#: the side streams, NCCL's structures beside its buffers, a kernel's own workspace: docs/planner.md, What the
#: planner does not model). A margin the user sets, not a measured figure: every answer states it beside ``fits``
#: (``headroom``, ``usable_memory_bytes``).
HEADROOM = 0.1
#: What ``fits`` was judged on (a record's ``fits_on``; ``fits_bytes`` the bytes held against ``device_memory``).
FITS_ON = {
    "device": "the device as nvidia-smi counts it (device_total_bytes): the CUDA caching allocator's reserved peak + "
              "NCCL's communicator buffers + the CUDA context (zeroexp.formulas.device_memory)",
    "reserved": "the CUDA caching allocator's segments for the peak model's live bytes, phase after phase "
                "(reserved_peak_bytes: zeroexp.formulas.peak.allocator)",
    "peak": "the peak model: model state + its steady buffers + the largest phase above steady (activations, "
            "gathered units, collective buffers, optimizer temporaries)",
    "state+activations": "model state + gather floor + one forward's activations (below fp32 the fewer of autocast's "
                         "and the module cast's), no peak model for the row: its buffers and transients left out",
    "state": "model state + gather floor alone: no activations (give model= and batch_size=) and no peak model",
}


@dataclass(frozen=True)
class Precision:
    """A precision option (conf/precision/): its name and compute dtype; masters and moments are fp32."""

    name: str
    param_dtype: str = "float32"

    @property
    def itemsize(self) -> int:
        """Bytes per element of parameters and gradients."""
        return COMPUTE_ITEMSIZE[self.param_dtype]


def strategy_table() -> dict[str, StateLayout]:
    """Every row the planner can plan (``zeroexp.formulas.LAYOUTS``: each registered strategy's YAML names one in
    ``strategy.layout``, and the ZeRO paper's stages), by ZeRO stage."""
    return dict(sorted(LAYOUTS.items(), key=lambda item: item[1].stage))


def largest_unit_bytes(shape: ModelShape, world_size: int, itemsize: int) -> int | None:
    """The largest FSDP unit, unsharded and padded to N, in the compute dtype: what FULL_SHARD gathers at once (a
    unit's parameters packed into one flat buffer, ``zeroexp.formulas.pack``, its length padded to a multiple of N;
    units without parameters left out); None without the model's units."""
    if not shape.exact:
        return None
    sizes = [padded_numel(pack([shape.numels[i] for i in unit])[1], world_size) for unit in shape.units]
    return max(size for size in sizes if size) * itemsize


def row_groups(name: str, layout: StateLayout, shape: ModelShape, world_size: int, itemsize: int,
               knobs: PlanKnobs = PlanKnobs()) -> Groups:
    """:func:`zeroexp.formulas.derive_groups`, remembered for the invocation by its arguments (``zeroexp.cell.memo``;
    a ``Groups`` is read, never changed): a row's record, peak and step time at one world size read one derivation."""
    return memoized("row_groups", (name, layout, shape, int(world_size), int(itemsize), knobs),
                    lambda: derive_groups(name, layout, shape, world_size, itemsize, knobs))


def plan_record(name: str, layout: StateLayout, shape: ModelShape, world_size: int, precision: Precision,
                offload: str = "none", knobs: PlanKnobs = PlanKnobs(), device_memory: int | None = None,
                model: str = "params", headroom: float = HEADROOM) -> dict[str, Any]:
    """One strategy at one world size: per-rank bytes of each kind (the largest rank's, padding included), device
    and host totals, the gather floor, fits (against ``device_memory`` less ``headroom``: :func:`usable_bytes`), and
    per-step calls, payload and bus bytes by collective (bytes throughout), from the groups the row derives from
    ``shape`` (``zeroexp.formulas.derive_groups``)."""
    n, c = world_size, precision.itemsize
    groups = row_groups(name, layout, shape, n, c, knobs)
    state = rank_state_bytes(layout, groups, c, knobs, offload)
    host = offloaded_kinds(layout, offload)

    def largest(kinds: Iterable[str]) -> int:
        kinds = [k for k in kinds if k in state]
        return max(sum(state[k][r][1] for k in kinds) for r in range(n)) if kinds else 0

    device = largest(k for k in STATE_KINDS if k not in host)
    floor = unsharded_floor_bytes(layout, groups, c)
    judged = device + (floor or 0)
    collectives = step_collectives(layout, groups, c, knobs)
    payload = {op: v["payload_bytes"] for op, v in collectives.items()}
    bus = {op: op_bus_bytes(op, v, n) for op, v in collectives.items()}
    return {
        "strategy": name, "label": layout.label, "zero_stage": layout.stage, "reference": layout.reference,
        "world_size": n,
        "precision": precision.name, "offload": offload, "model": model, "numel": shape.numel,
        "shapes_known": shape.exact,
        **{f"{k}_bytes": largest([k]) for k in STATE_KINDS},
        "total_bytes": largest(STATE_KINDS), "device_bytes": device, "host_bytes": largest(host),
        "largest_unit_bytes": largest_unit_bytes(shape, n, c), "gather_floor_bytes": floor,
        "device_floor_bytes": judged, "device_memory_bytes": device_memory, "headroom": headroom,
        "usable_memory_bytes": usable_bytes(device_memory, headroom),
        "fits": None if device_memory is None else judged <= usable_bytes(device_memory, headroom), "fits_on": "state",
        "fits_bytes": judged,
        "counts": {op: v["count"] for op, v in collectives.items()}, "payload_bytes": payload, "bus_bytes": bus,
        "payload_total_bytes": sum(payload.values()),
        "bus_total_bytes": sum(b for b in bus.values() if b is not None), "source": layout.source,
        "state_note": layout.family.state_note(layout, shape, knobs.shard_size if layout.hybrid else n),
        "checkpoint": checkpoint_record(layout, groups, c, shape, knobs),
    }


def checkpoint_record(layout: StateLayout, groups: Any, itemsize: int, shape: ModelShape, knobs: PlanKnobs
                      ) -> dict[str, Any]:
    """What a checkpoint of the row writes (zeroexp.formulas.checkpoint.written_bytes), per kind: ``written_bytes``
    (the tensors' bytes, all ranks), ``rank0_bytes`` (full: what rank 0 gathers on its host and writes alone) or
    ``largest_rank_bytes`` (sharded, where the layout fixes each rank's: ZeroRedundancyOptimizer's owners) and
    ``mean_rank_bytes`` (sharded: the total over N; torch.distributed.checkpoint balances the replicated items at run
    time); ``layout``; None for a row with no sharded kind (the paper's stages)."""
    from zeroexp.formulas.checkpoint import written_bytes

    full = written_bytes(layout, groups, itemsize, "full", shape, knobs)
    sharded = written_bytes(layout, groups, itemsize, "sharded", shape, knobs)
    n = groups.world_size
    return {"state_bytes": full["state"]["total"],
            "full": {"written_bytes": full["total"], "rank0_bytes": full["ranks"][0]},
            "sharded": None if sharded is None else {
                "layout": sharded["layout"], "written_bytes": sharded["total"],
                "largest_rank_bytes": max(sharded["ranks"]) if sharded["ranks"] else None,
                "mean_rank_bytes": sharded["total"] // n}}


def checkpoint_peak_records(records: list[dict[str, Any]], shape: ModelShape, precision: Precision,
                            knobs: PlanKnobs, device: Any) -> None:
    """Each record's ``checkpoint[kind]["peaks"]`` (zeroexp.formulas.checkpoint.checkpoint_peaks, on ``device``'s
    semantics): per phase (``save``, ``load``) ``rank0_bytes`` and ``largest_rank_bytes`` above what the rank held
    before (the device's), ``host_rank0_bytes`` and ``host_largest_rank_bytes`` (an accelerator: what the host holds
    at the phase's peak; null on the CPU, where it is in the device's), ``lower_bound`` (some term is not sized:
    ``unsized`` names it); ``peaks`` null where the row's family has no model (``peaks_note`` says so)."""
    from zeroexp.formulas.checkpoint import checkpoint_peaks

    table = strategy_table()
    for r in records:
        name, n, layout = r["strategy"], r["world_size"], table[r["strategy"]]
        groups = row_groups(name, layout, shape, n, precision.itemsize, knobs)
        for kind in ("full", "sharded"):
            if r["checkpoint"][kind] is None:
                continue
            peaks = checkpoint_peaks(layout, groups, precision.itemsize, kind, shape, device, knobs)
            r["checkpoint"][kind]["peaks"] = None if peaks is None else {
                ph: {"rank0_bytes": p.ranks[0], "largest_rank_bytes": max(p.ranks),
                     "host_rank0_bytes": None if p.host is None else p.host[0],
                     "host_largest_rank_bytes": None if p.host is None else max(p.host),
                     "lower_bound": not p.exact[p.ranks.index(max(p.ranks))], "unsized": p.record()["unsized"],
                     "rank0_terms": p.terms}
                for ph, p in (("save", peaks.save), ("load", peaks.load))}
            if peaks is None:
                r["checkpoint"][kind]["peaks_note"] = (f"no save and load peak model for {name} "
                                                       f"({layout.family.name})")


def check_headroom(value: Any, key: str) -> float:
    """``value`` as a headroom fraction in [0, 1), or a :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ConfigError(key, value, f"a fraction in [0, 1): {HEADROOM} keeps {100 * HEADROOM:.0f} % free")
    return float(value)


def usable_bytes(memory: int | None, headroom: float = HEADROOM) -> int | None:
    """The bytes a prediction may reach on a memory of ``memory`` bytes: all but its ``headroom`` (:data:`HEADROOM`);
    None where no memory is given. The one rule of ``fits`` in plan, recommend and a run's resource check."""
    return None if memory is None else int(memory * (1 - headroom))


@contextmanager
def untraced(model: Any) -> Iterator[None]:
    """Run the body; a step the planner cannot trace on fake tensors (``zeroexp._lib.fake_tensors.untraceable``)
    raised in it becomes the refusal of the model (exit 2, naming ``model``, the model option); any other exception
    passes."""
    from zeroexp._lib.fake_tensors import untraceable

    try:
        yield
    except Exception as e:  # noqa: BLE001 - only a step fake tensors cannot run is the model's: the rest re-raised
        why = untraceable(e)
        if why is None:
            raise
        raise ConfigError("model", model, "a model whose training step runs on fake tensors (the planner traces it "
                          "without data; a cell still measures it, its plan.memory n/a)", why=why) from e


def judge_fits(record: dict[str, Any]) -> None:
    """Set ``fits_on``, ``fits_bytes`` and ``fits`` of a record from the best figure it has (:data:`FITS_ON`): on a
    GPU its ``reserved_peak_bytes`` (what decides an out-of-memory error), else its ``peak_bytes`` where the peak
    model covers the row, else its model state and gather floor with the activations
    where those were traced (below fp32 the fewer of autocast's, ``activation_bytes``, and the module cast's,
    ``activation_cast_bytes``: a row without a peak model computes one way or the other), else the state and gather
    floor alone; each with the device's ``workspace_bytes`` (cuBLAS's, on CUDA); against ``usable_memory_bytes``
    (:func:`usable_bytes`: the device's memory less the record's ``headroom``). On a GPU whose NCCL buffers and
    context are known, the device's whole use (``device_total_bytes``: ``fits_on`` ``device``); where the reserved
    peak is not, what is known of the two beside the figure judged (``beside_bytes``)."""
    state = record["device_bytes"] + (record["gather_floor_bytes"] or 0) + (record.get("workspace_bytes") or 0)
    acts = [a for a in (record.get("activation_bytes"), record.get("activation_cast_bytes")) if a is not None]
    beside = (record.get("nccl_bytes") or 0) + (record.get("context_bytes") or 0)
    if record.get("device_total_bytes") is not None:
        on, judged, beside = "device", record["device_total_bytes"], 0
    elif record.get("reserved_peak_bytes") is not None:
        on, judged = "reserved", record["reserved_peak_bytes"]
    elif record.get("peak_bytes") is not None:
        on, judged = "peak", record["peak_bytes"]
    elif acts:
        on, judged = "state+activations", state + min(acts)
    else:
        on, judged = "state", state
    memory, judged = record["usable_memory_bytes"], judged + beside
    record.update(fits_on=on, fits_bytes=judged, beside_bytes=beside or None,
                  fits=None if memory is None else judged <= memory)


def recommendable(record: dict[str, Any]) -> bool:
    """Whether a record may be recommended (the fastest that fits): a row a strategy runs (not a ``reference``)
    that is not known not to fit."""
    return not record["reference"] and record["fits"] is not False


def plan(shape: ModelShape, world_sizes: Iterable[int], precision: Precision, offload: str = "none",
         strategies: Iterable[str] | None = None, knobs: PlanKnobs = PlanKnobs(), device_memory: int | None = None,
         model: str = "params", headroom: float = HEADROOM) -> tuple[list[dict[str, Any]], list[str]]:
    """Records for every strategy x world size, and a note for each strategy whose byte model does not cover the
    precision or offload (those are left out). Raises :class:`ConfigError` for an unknown strategy or offload."""
    table, world_sizes = strategy_table(), list(world_sizes)
    if offload not in OFFLOADS:
        raise ConfigError("offload", offload, ", ".join(OFFLOADS))
    names = list(table) if strategies is None else list(strategies)
    for name in names:
        if name not in table:
            raise ConfigError("strategies", name, ", ".join(table))
    records, notes = [], []
    for name in names:
        layout = table[name]
        if precision.name not in layout.precisions:
            notes.append(f"{name}: precision={precision.name} is not modelled "
                         f"(covers {', '.join(sorted(layout.precisions))})")
        elif offload not in layout.offloads:
            notes.append(f"{name}: offload={offload} is not modelled (covers {', '.join(sorted(layout.offloads))})")
        elif layout.hybrid and not knobs.shard_size:
            notes.append(f"{name}: hybrid sharding needs shard_size= (the ranks of one shard group: a node's GPUs)")
        else:
            for n in world_sizes:
                if n < layout.min_world_size:
                    notes.append(f"{name} at world_size={n}: runs at {layout.min_world_size} ranks or more "
                                 f"({layout.family.below_min_world(layout)})")
                elif layout.hybrid and not (1 < knobs.shard_size < n and n % knobs.shard_size == 0):
                    notes.append(f"{name} at world_size={n}: shard_size={knobs.shard_size} is no divisor of {n} "
                                 "strictly between 1 and it")
                else:
                    records.append(plan_record(name, layout, shape, n, precision, offload, knobs, device_memory, model,
                                               headroom))
                    if records[-1]["state_note"]:
                        notes.append(f"{name} at world_size={n}: {records[-1]['state_note']}")
    return records, notes


def _parse(value: Any, suffixes: dict[str, int], what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not {what}")
    if isinstance(value, (int, float)):
        number, scale = float(value), 1
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not m or m.group(2).upper() not in suffixes:
            raise ValueError(f"{value!r} is not {what}")
        number, scale = float(m.group(1)), suffixes[m.group(2).upper()]
    result = round(number * scale)
    if result < 1:
        raise ValueError(f"{value!r} is not {what}")
    return result


def parse_bytes(value: Any) -> int:
    """``32GB`` -> 32e9, ``80GiB`` -> 80 x 2^30 (also B, KB, MB, TB, KiB, MiB, TiB); a bare number is bytes."""
    return _parse(value, _SIZE, "a size like 32GB or 80GiB")


def parse_count(value: Any) -> int:
    """``7.5e9``, ``7.5B``, ``350M``, ``1T`` -> a number of parameters."""
    return _parse(value, _COUNT, "a parameter count like 7.5e9 or 7.5B")
