"""Exposed communication, read off the profiler's event tree of the collectives probe's profiled steps.

A collective is *in flight* from its ``c10d::`` dispatcher op's start to the end of its backend work (``gloo:*``
events on gloo's worker threads, ``nccl:*`` on NCCL's); *compute* is every outermost ``aten::`` op on the rank's
other threads (forward, autograd's backward, the optimizer, the copies a strategy makes). Per profiled step (between
the probe's start and end marks): exposed = the time some collective is in flight and no compute op runs; in flight
and compute are reported beside it. On CUDA the CPU events say when work was issued, not when the device ran it,
so the figure is a CPU-side one there (the note says so).

By op: each collective's intervals carry its op (the ``c10d::`` name through the collectives probe's table,
``gloo:<op>`` / ``nccl:<op>`` as named); an op's exposed time is the time that op is in flight and no compute runs,
so where two ops are in flight at once the interval counts for each (the ops' figures may sum above the total).
A backend's worker events carry the algorithm it runs: gloo carries out a reduce_scatter as an all_reduce, so that
time is named all_reduce (the ``c10d::`` call's own, reduce_scatter).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["exposed_comm", "exposed_section", "merge", "measure", "subtract"]

Interval = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[list[int]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(base: list[Interval], cut: list[Interval]) -> list[Interval]:
    """``base`` minus ``cut`` (both merged)."""
    out, j = [], 0
    for a, b in base:
        while j < len(cut) and cut[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(cut) and cut[k][0] < b:
            if cut[k][0] > start:
                out.append((start, cut[k][0]))
            start = max(start, cut[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def measure(intervals: list[Interval], lo: int, hi: int) -> int:
    """Total length of (merged) ``intervals`` inside [lo, hi)."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in intervals)


def _walk(tree: Iterable[Any], mark: str, op_of: Callable[[str], str]
          ) -> tuple[dict[str, list[Interval]], list[Interval], list[tuple[int, str, int]]]:
    from zeroexp._lib.profiler import is_torch_op

    comm: dict[str, list[Interval]] = {}
    compute, marks = [], []
    stack = list(tree)
    while stack:
        e = stack.pop()
        name = e.name
        if not is_torch_op(e):
            stack.extend(e.children)
        elif name.startswith(mark):
            phase, step = name.removeprefix(mark).split(".")
            marks.append((e.start_time_ns, phase, int(step)))
        elif name.startswith(("c10d::", "gloo:", "nccl:")):
            comm.setdefault(op_of(name), []).append((e.start_time_ns, e.end_time_ns))
        elif name.startswith("aten::"):
            compute.append((e.start_time_ns, e.end_time_ns))
        else:
            stack.extend(e.children)
    return comm, compute, marks


def exposed_comm(tree: Iterable[Any], mark: str, op_of: Callable[[str], str] = lambda name: name
                 ) -> list[dict[str, Any]]:
    """Per profiled step (bounded by ``<mark>start.<step>`` / ``<mark>end.<step>`` events): milliseconds of the step,
    of collectives in flight, of compute, and of exposed communication (in flight, no compute), in all and by op
    (``op_of``: an event's name -> its op)."""
    by_op, compute, marks = _walk(tree, mark, op_of)
    compute = merge(compute)
    comm = merge(i for intervals in by_op.values() for i in intervals)
    exposed = subtract(comm, compute)
    exposed_by_op = {op: subtract(merge(intervals), compute) for op, intervals in sorted(by_op.items())}
    starts = {s: t for t, ph, s in marks if ph == "start"}
    rows = []
    for t, ph, s in sorted(marks):
        if ph != "end" or s not in starts:
            continue
        lo, hi = starts[s], t
        rows.append({"step": s, "step_ms": (hi - lo) / 1e6, "in_flight_ms": measure(comm, lo, hi) / 1e6,
                     "compute_ms": measure(compute, lo, hi) / 1e6, "exposed_comm_ms": measure(exposed, lo, hi) / 1e6,
                     "exposed_comm_ms_by_op": {op: measure(x, lo, hi) / 1e6 for op, x in exposed_by_op.items()}})
    return rows


def exposed_section(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Exposed communication per profiled step (:func:`exposed_comm`), mean over steps and ranks: measured
    on the profiled steps, which the profiler slows; per rank beside it."""
    per_rank = [res.get("exposed") or [] for res in results]
    if not all(per_rank):
        return {"exposed_comm_ms": None, "in_flight_ms": None, "exposed_comm_ms_by_rank": None,
                "exposed_comm_ms_by_op": None}

    def mean(key: str, rows: list[dict[str, Any]]) -> float:
        return sum(r[key] for r in rows) / len(rows)

    return {"exposed_comm_ms": mean("exposed_comm_ms", [r for rows in per_rank for r in rows]),
            "in_flight_ms": mean("in_flight_ms", [r for rows in per_rank for r in rows]),
            "profiled_compute_ms": mean("compute_ms", [r for rows in per_rank for r in rows]),
            "profiled_step_ms": mean("step_ms", [r for rows in per_rank for r in rows]),
            "exposed_comm_ms_by_rank": [mean("exposed_comm_ms", rows) for rows in per_rank],
            "exposed_comm_ms_by_op": {op: sum((r.get("exposed_comm_ms_by_op") or {}).get(op, 0.0) for rows in per_rank
                                              for r in rows) / sum(len(rows) for rows in per_rank)
                                      for op in sorted({op for rows in per_rank for r in rows
                                                        for op in r.get("exposed_comm_ms_by_op") or {}})}}
