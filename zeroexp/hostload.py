"""What else ran on the host while zeroexp measured: the host's busy CPU seconds (``/proc/stat``) less the measuring
ranks' own (``getrusage``), per second of wall time. One definition for the calibration (``host_activity`` of its
file) and for a cell's timed steps (``timing.host_activity``): 0 cores on a quiet host, 1 when another job kept a
core busy throughout."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["busy_cpu_s", "own_cpu_s", "activity", "resolution_cores", "busy_beyond"]


def busy_cpu_s() -> float | None:
    """The host's CPU seconds spent busy since boot, every core and process (``/proc/stat``'s first line: user, nice,
    system, irq, softirq; not idle, iowait or steal); None where there is no ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """This process's CPU seconds, every thread (gloo's workers too)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def resolution_cores(wall_s: float) -> float:
    """How far ``other_cores`` over a window of ``wall_s`` can be off from the counters' granularity alone: each
    core's busy time in ``/proc/stat`` is counted in clock ticks (1 / ``SC_CLK_TCK`` s), up to one off at each end
    of the window."""
    return 2 * (os.cpu_count() or 1) / os.sysconf("SC_CLK_TCK") / wall_s


def activity(wall_s: float, busy_s: float | None, ranks_cpu_s: float) -> dict[str, Any] | None:
    """Over a window of ``wall_s`` seconds in which the host was busy ``busy_s`` CPU seconds and the measuring ranks
    used ``ranks_cpu_s`` of them: ``{wall_s, busy_cpu_s, ranks_cpu_s, other_cpu_s, other_cores, resolution_cores}``
    (other: the rest, at least 0; per second of wall; :func:`resolution_cores`). None where the host's counters
    could not be read or the window is empty."""
    if busy_s is None or wall_s <= 0:
        return None
    other = max(0.0, busy_s - ranks_cpu_s)
    return {"wall_s": wall_s, "busy_cpu_s": busy_s, "ranks_cpu_s": ranks_cpu_s, "other_cpu_s": other,
            "other_cores": other / wall_s, "resolution_cores": resolution_cores(wall_s)}


def busy_beyond(host: dict[str, Any] | None, limit: float) -> float | None:
    """``host``'s ``other_cores`` where it exceeds ``limit`` by more than its resolution (older files: none
    recorded, 0), else None."""
    if not host or host.get("other_cores") is None:
        return None
    busy = float(host["other_cores"])
    return busy if busy - float(host.get("resolution_cores", 0.0)) > limit else None
