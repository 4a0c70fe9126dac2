"""Resources checked before launch: a local cell whose ranks cannot fit this machine is refused, naming world_size
and the estimate, instead of spawning hundreds of processes.

Checked for a local cell that trains (``launcher=local``, not ``dry_run``), in ``config.validate``:

- memory: ``world_size`` x (the planner's per-rank model state in host memory + the activations one forward saves
  at the cell's micro-batch, in its precision and checkpointing, on ranks of the CPU + :data:`RANK_OVERHEAD_BYTES`),
  plus the equivalence reference rank 0 trains after the steps
  (:func:`zeroexp.formulas.reference.reference_host_bytes`) and the forkserver's image once (:data:`SHARED_BYTES`),
  against ``MemAvailable`` of ``/proc/meminfo`` less ``resources.headroom`` (the planner's one rule,
  ``zeroexp.plan.core.usable_bytes``);
- processes: ``world_size`` x the threads of a rank (Linux counts threads against ``RLIMIT_NPROC``) plus the
  user's tasks now, against the soft ``RLIMIT_NPROC`` (not enforced for root);
- open files: a rank holds about one socket per peer (gloo's full mesh) and the launcher three per rank (the
  rendezvous store's connection, the rank's sentinel and status pipes), against the soft ``RLIMIT_NOFILE``.

``resources.check=false`` skips the check, for those who mean it. The model state is the planner's
(``zeroexp.plan.core.plan_record``: ``total_bytes``, the largest rank's, padding included), the activations its
traced forward's (``zeroexp.plan.row_peak.activation_bytes``, on fake tensors); buckets in flight and the
optimizer's temporaries are not counted, so a cell that passes can still run out of memory: this check refuses only
the cells that cannot fit.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Any

from zeroexp.errors import ConfigError
from zeroexp.plan.core import HEADROOM

__all__ = ["ResourcesConfig", "Estimate", "estimate", "check_resources", "prelaunch_line", "RANK_OVERHEAD_BYTES",
           "SHARED_BYTES"]

#: Memory of one rank process beyond its model state: its own (unshared) pages with torch, Lightning and gloo
#: loaded and training. Measured 2026-11-30 on the development machine (2 vCPUs, torch 2.13.0, Lightning 2.6.6,
#: gloo on the CPU, world_size=2, model.width=32): RSS 386 MiB, PSS 222 MiB, Private_Clean + Private_Dirty 156 MiB
#: per rank (/proc/<pid>/smaps_rollup); the rest is the forkserver's image, shared copy-on-write. Rounded up.
RANK_OVERHEAD_BYTES = 160 * 2**20
#: The forkserver's image (torch, Lightning, zeroexp imported once), shared by its ranks: RSS 386 - 156 MiB private.
SHARED_BYTES = 230 * 2**20
#: Threads of a training rank beyond torch's intra-op pool (measured 5 in all with a pool of 1: gloo, Python, the
#: store client); the pool is ``cpu_count // world_size`` (zeroexp.rank.worker).
RANK_THREADS = 8
#: Open files of a rank (measured 14 + world_size at N=2 and N=6) and of the launcher (17 + 3 x world_size), with room.
RANK_FILES, FILES_PER_PEER = 32, 2
LAUNCHER_FILES, LAUNCHER_FILES_PER_RANK = 64, 4


@dataclass
class ResourcesConfig:
    """``resources.check=false``: start a local cell even when it looks like it cannot fit this machine."""

    check: bool = True
    headroom: float = HEADROOM  # the fraction of MemAvailable left free (zeroexp.plan.core.HEADROOM: one rule)


@dataclass
class Estimate:
    world_size: int
    state_bytes: int  # the planner's model state of the largest rank, in host memory
    activation_bytes: int  # one forward's saved activations of a rank in host memory (0 on a GPU; unknown: 0)
    per_rank_bytes: int  # state + activations + RANK_OVERHEAD_BYTES
    reference_bytes: int  # the equivalence reference rank 0 trains (zeroexp.formulas.reference; unknown: 0)
    total_bytes: int  # world_size x per_rank + reference + SHARED_BYTES
    available_bytes: int | None  # MemAvailable; None where /proc/meminfo is not readable
    usable_bytes: int | None  # available less the headroom (zeroexp.plan.core.usable_bytes)
    source: str  # where state_bytes comes from
    activations_note: str | None = None  # why activations and the reference's are not counted, where they are not


def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _state_bytes(cfg: Any, on_gpu: bool, shape: Any = None) -> tuple[int, str]:
    """The largest rank's model state in host memory, from the planner's row of the cell (``shape``: its model's,
    read by validation; None: read here)."""
    from zeroexp.cell.resolved import knobs_of, layout_of
    from zeroexp.models import wrap_paths
    from zeroexp.plan.core import Precision, plan_record
    from zeroexp.plan.shape import model_shape

    shape = shape if shape is not None else model_shape(cfg.model, wrap_paths(cfg))
    precision = Precision(str(cfg.precision.name), str(cfg.precision.param_dtype))
    offload = str(cfg.offload.name)
    try:
        name, layout = layout_of(cfg)
    except KeyError:
        layout = None
    if layout is None or precision.name not in layout.precisions or offload not in layout.offloads:
        # no byte model for this row: the unsharded AdamW state, 16 bytes per parameter (P, G, two fp32 moments)
        return (0 if on_gpu else 16 * shape.numel), "16 bytes per parameter (no planner row for this cell)"
    record = plan_record(name, layout, shape, int(cfg.world_size), precision, offload, knobs_of(cfg))
    if on_gpu:  # the device holds the rest
        return int(record["host_bytes"]), f"the planner's {name} row: host_bytes of the largest rank"
    return int(record["total_bytes"]), f"the planner's {name} row: total_bytes of the largest rank"


def _activations(cfg: Any, shape: Any) -> tuple[int, int, str | None]:
    """(a rank's saved activations at the cell's micro-batch in its precision and checkpointing, the fp32 forward's
    the reference saves, why neither is known): the planner's traced forwards (fake tensors)."""
    from zeroexp.formulas.peak.checkpointing import NONE, checkpointing_of
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.row_peak import activation_bytes

    if shape is None or not shape.exact:
        return 0, 0, "activations not counted: the model's shapes are not known here"
    try:
        wrap = [import_class(p) for p in wrap_paths(cfg)]
        batch = int(cfg.batch_size)
        rank = activation_bytes(cfg.model, batch, wrap, str(cfg.precision.param_dtype),
                                checkpointing_of(cfg.activation_checkpointing))
        return rank, activation_bytes(cfg.model, batch, wrap, "float32", NONE), None
    except Exception as e:  # noqa: BLE001 - a model the fake-tensor trace cannot run still trains: counted without
        return 0, 0, f"activations not counted: the forward does not trace ({type(e).__name__}: {e})"


def estimate(cfg: Any, shape: Any = None, activations: bool = True) -> Estimate:
    """What the cell's ranks will hold of this machine's memory (see the module); ``activations=False``: without the
    traced activations and the equivalence reference (a lower bound, no trace)."""
    from zeroexp.devices import ranks_get_a_gpu
    from zeroexp.formulas.reference import reference_host_bytes
    from zeroexp.plan.core import usable_bytes

    n, on_gpu = int(cfg.world_size), ranks_get_a_gpu(cfg)
    state, source = _state_bytes(cfg, on_gpu, shape)
    acts, ref_acts, note = _activations(cfg, shape) if activations else (0, 0, "activations not counted")
    per_rank = state + (0 if on_gpu else acts) + RANK_OVERHEAD_BYTES
    reference = 0
    if note is None:
        trainable = shape.numel - sum(shape.frozen)
        reference = reference_host_bytes(shape.numel, trainable, ref_acts, n)
    available = mem_available()
    headroom = float(cfg.resources.headroom)
    return Estimate(n, state, 0 if on_gpu else acts, per_rank, reference, n * per_rank + reference + SHARED_BYTES,
                    available, usable_bytes(available, headroom), source, note)


def _soft(limit: int) -> int | None:
    soft, _ = resource.getrlimit(limit)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _user_tasks() -> int:
    """Threads of every process of this user now (what RLIMIT_NPROC counts)."""
    uid, count = os.getuid(), 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid:
                    count += int(fields["Threads"])
            except (OSError, KeyError, ValueError):
                continue
    return count


def prelaunch_line(cfg: Any, shape: Any = None) -> str:
    """What a cell will hold, said before its ranks start: the model's parameters (trainable ones where some are
    frozen), the planned model state of its largest rank (the planner's row) and what the ranks need of this
    machine's memory (:func:`estimate`). Computed, not measured."""
    e = estimate(cfg, shape)
    numel = shape.numel if shape is not None else None
    trainable = shape.numel - sum(shape.frozen) \
        if shape is not None and shape.exact else numel
    model = f"{cfg.model.get('name')}: " + (f"{numel:,} parameters" if numel is not None else "parameters unknown") + (
        f" ({trainable:,} trainable)" if trainable is not None and numel is not None and trainable != numel else "")
    have = f" of {_gib(e.usable_bytes)} usable" if e.usable_bytes is not None else ""
    acts = f" + {_gib(e.activation_bytes)} activations" if e.activation_bytes else ""
    ref = f" with the equivalence reference on rank 0 ({_gib(e.reference_bytes)})" if e.reference_bytes else ""
    note = f"; {e.activations_note}" if e.activations_note else ""
    return (f"{model}; planned per rank: {_gib(e.state_bytes)} model state ({e.source}){acts}; {e.world_size} ranks "
            f"need ~{_gib(e.total_bytes)}{ref}{have} (computed{note})")


def check_resources(cfg: Any, shape: Any = None) -> None:
    """Refuse (ConfigError naming ``world_size``) a local training cell that cannot fit this machine (``shape``: its
    model's, read by validation)."""
    from zeroexp.plan.core import check_headroom

    check_headroom(cfg.resources.headroom, "resources.headroom")
    if cfg.launcher.name != "local" or cfg.dry_run or not cfg.resources.check:
        return
    n = int(cfg.world_size)
    override = "resources.check=false to start it anyway"
    e = estimate(cfg, shape, activations=False)  # a cell its state alone refuses traces nothing
    if e.usable_bytes is None or e.total_bytes <= e.usable_bytes:
        e = estimate(cfg, shape)
    if e.usable_bytes is not None and e.total_bytes > e.usable_bytes:
        fit = max(0, (e.usable_bytes - SHARED_BYTES - e.reference_bytes) // e.per_rank_bytes)
        acts = f" + {_gib(e.activation_bytes)} activations" if e.activation_bytes else ""
        ref = f" + {_gib(e.reference_bytes)} equivalence reference on rank 0" if e.reference_bytes else ""
        raise ConfigError("world_size", n, f"at most {fit} ranks of this cell here; or {override}",
                          why=f"{n} ranks need an estimated {_gib(e.total_bytes)} ({n} x ({_gib(e.state_bytes)} "
                              f"model state, {e.source}{acts}, + {_gib(RANK_OVERHEAD_BYTES)} per process){ref} + "
                              f"{_gib(SHARED_BYTES)} shared), this machine has {_gib(e.usable_bytes)} usable "
                              f"({_gib(e.available_bytes)} available less resources.headroom="
                              f"{cfg.resources.headroom})")
    nproc = _soft(resource.RLIMIT_NPROC)
    if nproc is not None and os.geteuid() != 0:
        threads = n * (RANK_THREADS + max(1, (os.cpu_count() or 1) // n))
        now = _user_tasks()
        if now + threads > nproc:
            raise ConfigError("world_size", n, f"at most {nproc} tasks (RLIMIT_NPROC) in all; or {override}",
                              why=f"{n} ranks need about {threads} threads, this user runs {now} and may run {nproc}")
    nofile = _soft(resource.RLIMIT_NOFILE)
    if nofile is not None:
        need = max(RANK_FILES + FILES_PER_PEER * n, LAUNCHER_FILES + LAUNCHER_FILES_PER_RANK * n)
        if need > nofile:
            raise ConfigError("world_size", n, f"open files (RLIMIT_NOFILE, ulimit -n) of at least {need}; or "
                              f"{override}", why=f"{n} ranks need about {need} open files in one process, the "
                                                 f"limit is {nofile}")
