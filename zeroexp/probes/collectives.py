"""Which collectives each rank issues per steady step, counted by the torch profiler, against the payload model.

Over ``schedule.profiled`` (the steps right after warm-up) every rank runs ``torch.profiler`` (CPU activity,
``record_shapes=True``) and keeps each outermost ``c10d::*`` dispatcher op: the one layer that every caller
goes through, whatever the backend (gloo, NCCL) and whoever calls it: DDP's C++ Reducer, FSDP,
ZeroRedundancyOptimizer, DeepSpeed, functional collectives. Backend events (``gloo:all_reduce``) are not
used: they run on worker threads, may finish after the window, and gloo emulates reduce_scatter with an
all_reduce. Shapes and dtypes come from the profiler's event tree (``kineto_results.experimental_event_tree``),
which, unlike the chrome trace's ``Input type``, keeps the dtype of the tensors inside a ``Tensor[]`` argument.

Each call's process group: the profiler records no group on gloo (its ``c10d::*`` events carry the tensors only;
the ``record_param_comms`` events with "Process Group Ranks" and "Group size" come from NCCL, not gloo, torch
2.13), so over the profiled steps a ``TorchDispatchMode`` (:class:`GroupMarks`), which sees every ``c10d::*`` op with
its ProcessGroup argument, wraps each in a zero-work ``record_function`` naming the group and its size; the event
tree then holds that mark under the op. The mesh dimension is the adapter's (``StrategyAdapter.mesh_dims``:
``shard``, ``replicate``), ``world`` for a group of every rank.

Payload S follows nccl-tests (doc/PERFORMANCE.md): the full array, so for all_gather and reduce_scatter one
rank's chunk x the size of the call's group (N for the default group; shard_size within a hybrid shard group).
Bus bytes = S x ``zeroexp.formulas.bus_factor`` at that group's size. The adapter derives the expected
collectives from the model's structure (``RunContext.expect``: the adapter's live groups in zeroexp.formulas)
after the window; this probe issues no collective at all.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd
import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile, record_function

from zeroexp._lib.dispatch import dispatch_mode_base, op_argument_names, process_group_named
from zeroexp._lib.profiler import is_torch_op
from zeroexp.formulas import WORLD, bus_bytes, op_bus_bytes, step_collectives
from zeroexp.probes.base import Probe, ProbeReport
from zeroexp.probes.exposed import exposed_comm, exposed_section
from zeroexp.results.cells import column
from zeroexp.results.format import NA, byte_unit, fmt_int, fmt_number, missing
from zeroexp.results.section import OPS, Column, ReportTable, raw_rows
from zeroexp.results.verdict import Check, Code, Reason, Verdict
from zeroexp.cell.schedule import PROBE_STEPS

__all__ = ["CollectivesProbe", "GroupMarks", "SOURCE"]

SOURCE = ("torch.profiler: outermost c10d:: dispatcher ops (kineto event tree, record_shapes=True), each op's "
          "process group marked by a TorchDispatchMode")
COLUMNS = ["rank", "op", "count", "dtype", "payload_bytes", "bus_bytes", "mesh_dim", "group_size"]
_MARK = "zeroexp.collectives."  # + "start.<step>" / "end.<step>"
_GROUP = "zeroexp.group."  # + "<group name>.<group size>", under each c10d op


class GroupMarks(dispatch_mode_base()):  # torch's TorchDispatchMode (zeroexp._lib.dispatch)
    """While active, runs each ``c10d::*`` op inside ``record_function("zeroexp.group.<name>.<size>")`` of the
    ProcessGroup it was called with, and each functional collective (``_c10d_functional::*``: DTensor's
    ``full_tensor()`` / ``redistribute``, FSDP2's norm for clipping and the fp16 inf check) inside the mark of the group
    its ``group_name`` names (the ``c10d::*`` op it issues runs under it); every other op passes through untouched.
    An op on DTensors is left to DTensor (``NotImplemented``), so that the collectives DTensor issues for it (the
    redistribution of a Partial norm) reach this mode; a mode that handled it would be inactive inside it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):  # to DTensor's dispatch, whose local ops (its collectives)
            return NotImplemented                          # then come here, this mode still active
        if func.namespace in ("c10d", "_c10d_functional"):
            group = _group_of(args) if func.namespace == "c10d" else _named_group(func, args, kwargs)
            if group is not None:
                with _mark(group):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def _mark(group: Any) -> Any:
    """The zero-work ``record_function`` that names ``group`` (a ProcessGroup) to :func:`extract` for the collective
    issued inside it."""
    return record_function(f"{_GROUP}{group.group_name}.{group.size()}")


def _named_group(func: Any, args: tuple, kwargs: dict) -> Any:
    """The ProcessGroup a functional collective names by its ``group_name`` argument, or None."""
    names = op_argument_names(func)
    if "group_name" not in names:
        return None
    i = names.index("group_name")
    name = args[i] if i < len(args) else kwargs.get("group_name")
    try:
        return process_group_named(name) if isinstance(name, str) else None
    except (RuntimeError, ValueError, KeyError):
        return None


def _group_of(args: tuple) -> Any:
    """The ProcessGroup among a c10d op's arguments (a ScriptObject the dispatcher passes), or None."""
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # another ScriptObject (the ReduceOp)
                continue
    return None

#: c10d op -> (op name, index of the argument holding the payload, whether that argument is one rank's chunk).
#: An op not listed is reported under its own name with the bytes of all its tensor arguments.
_C10D = {
    "allreduce_": ("all_reduce", 0, False), "allreduce_coalesced_": ("all_reduce", 0, False),
    "broadcast_": ("broadcast", 0, False),
    "allgather_": ("all_gather", 1, True), "_allgather_base_": ("all_gather", 1, True),
    "allgather_coalesced_": ("all_gather", 1, True), "allgather_into_tensor_coalesced_": ("all_gather", 1, True),
    "reduce_scatter_": ("reduce_scatter", 0, True), "_reduce_scatter_base_": ("reduce_scatter", 0, True),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 0, True),
    "reduce_": ("reduce", 0, False), "alltoall_": ("all_to_all", 1, False), "alltoall_base_": ("all_to_all", 1, False),
    "barrier": ("barrier", None, False), "monitored_barrier_": ("barrier", None, False),
}


def op_of_event(name: str) -> str:
    """The op of a profiler event: ``c10d::<name>`` through :data:`_C10D` (unlisted: its own name), ``gloo:<op>`` /
    ``nccl:<op>`` as named."""
    backend, _, rest = name.partition(":")
    if backend == "c10d":
        rest = rest.lstrip(":")
        return _C10D.get(rest, (rest,))[0]
    return rest


def _tensors(arg: Any) -> list[Any]:
    """The tensor metadata in one recorded argument (a tensor, a ``Tensor[]`` or a ``Tensor[][]``)."""
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return [arg] if hasattr(arg, "dtype") and hasattr(arg, "sizes") else []


def classify(name: str, inputs: list[Any], world_size: int) -> tuple[str, str, int]:
    """``(op, dtype, payload S in bytes)`` of one ``c10d::<name>`` call from its recorded inputs; ``world_size``: the
    size of the call's group."""
    op, index, chunk = _C10D.get(name, (name.strip("_"), -1, False))
    tensors = [] if index is None else _tensors(inputs if index == -1 else inputs[index] if index < len(inputs) else [])
    nbytes = sum(torch.Size(t.sizes).numel() * t.dtype.itemsize for t in tensors)
    dtype = "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})) or "-"
    return op, dtype, nbytes * (world_size if chunk else 1)


def _group_mark(event: Any) -> tuple[str, int] | None:
    """``(group name, size)`` from the :class:`GroupMarks` mark under a c10d event, or None when unmarked."""
    stack = list(event.children)
    while stack:
        child = stack.pop()
        if child.name.startswith(_GROUP):
            return _parse_mark(child.name)
        stack.extend(child.children)
    return None


def _parse_mark(name: str) -> tuple[str, int]:
    """``(group name, size)`` of a :func:`_mark` event's name."""
    group, size = name.removeprefix(_GROUP).rsplit(".", 1)
    return group, int(size)


def extract(prof: profile, steps: list[int], world_size: int,
            mesh_dims: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per step, op, dtype and group: ``count`` and ``payload_bytes`` of the outermost c10d ops in ``prof``.

    A call between a step's start and end marks belongs to that step (``phase`` "step"); one between a
    step's end and the next step's start (the trainer's own traffic, e.g. Lightning's per-step SIGTERM flag
    broadcast) to phase "between". Each call's group is its :class:`GroupMarks` mark: ``mesh_dim`` from
    ``mesh_dims`` (group name -> dimension), ``world`` for a group of ``world_size`` ranks (an unmarked call too); the
    c10d op a functional collective issues (DTensor's) takes the mark of that functional op.
    """
    marks, calls = [], []
    # (event, the group of the closest enclosing functional collective's mark): its c10d op inherits it
    stack = [(e, None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, outer = stack.pop()
        if not is_torch_op(event):
            stack.extend((c, outer) for c in event.children)
        elif event.name.startswith(_MARK):
            phase, step = event.name.removeprefix(_MARK).split(".")
            marks.append((event.start_time_ns, phase, int(step)))
        elif event.name.startswith("c10d::"):  # outermost: its children are the backend's own work
            name, size = _group_mark(event) or outer or ("", world_size)
            dim = (mesh_dims or {}).get(name) or (WORLD if size == world_size else f"group {name}")
            calls.append((event.start_time_ns,
                          (*classify(event.name[6:], event.extra_fields.inputs, size), dim, size)))
        else:
            # a functional collective: GroupMarks marked it (the mark lies in its subtree, under the
            # record_function op); the c10d op it issues below it belongs to that group
            mark = _group_mark(event) if event.name.startswith("_c10d_functional::") else None
            stack.extend((c, mark or outer) for c in event.children)
    marks.sort()
    totals: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for t, (op, dtype, nbytes, dim, size) in calls:  # a call belongs to the last mark before it
        _, mark, step = next((m for m in reversed(marks) if m[0] <= t), (0, "start", steps[0]))
        key = ("step" if mark == "start" else "between", step, op, dtype, dim, size)
        totals[key][0] += 1
        totals[key][1] += nbytes
    return [{"phase": ph, "step": s, "op": op, "dtype": d, "count": c, "payload_bytes": b, "mesh_dim": dim,
             "group_size": size} for (ph, s, op, d, dim, size), (c, b) in sorted(totals.items())]


def collectives_table(ok: pd.DataFrame) -> ReportTable:
    """Calls and payload per step by op (rank 0's), the expected fingerprint, and the check."""
    ops = _ops(ok)
    raw = raw_rows(ok, [f"collectives.{f}.{op}" for f in ("counts", "payload_bytes", "expected_counts",
                                                     "expected_payload_bytes") for op in ops]
               + ["collectives.payload_total_bytes", "collectives.param_bytes", "collectives.check"])
    has = column(ok, "collectives.check").reset_index(drop=True).map(lambda v: not missing(v))
    for f in ("counts", "payload_bytes"):  # an op a profiled cell never issued is 0, not unknown
        for op in ops:
            raw[f"collectives.{f}.{op}"] = [0 if h and missing(v) else v
                                            for h, v in zip(has, raw[f"collectives.{f}.{op}"])]
    raw["payload / P"] = [None if missing(t) or missing(p) or not p else t / p
                          for t, p in zip(raw["collectives.payload_total_bytes"], raw["collectives.param_bytes"])]
    raw["expected"] = [_expected_text(row, ops) for _, row in raw.iterrows()]
    raw["groups"] = _groups_text(ok, ops)
    unit = byte_unit(v for op in ops for v in raw[f"collectives.payload_bytes.{op}"])
    cols = [Column("cell", "label", str)]
    for op in ops:
        name = OPS.get(op, op)
        cols += [Column(f"{name} calls", f"collectives.counts.{op}", fmt_int, f"collectives.expected_counts.{op}"),
                 Column(f"{name} {unit}", f"collectives.payload_bytes.{op}", unit,
                        f"collectives.expected_payload_bytes.{op}")]
    cols += [Column("payload / P", "payload / P", fmt_number), Column("expected calls", "expected", str),
             Column("groups", "groups", str), Column("check", "collectives.check")]
    legend = ", ".join(f"{short} = {op}" for op, short in OPS.items() if op in ops)
    note = (f"Per step, rank 0 (ranks that differ make the check FAIL). {legend}. Payload is the nccl-tests S "
            f"(the full array) in {unit}, input bytes, not link bytes; a measured value that differs from the "
            "expected one shows it as (exp. X). groups: the process groups (mesh dimension x ranks) of each op's calls "
            "where not all N ranks (hybrid sharding); payloads are sized by them.")
    return ReportTable("collectives", "Collectives per step", raw, cols, note)


def collectives_line(c: dict[str, Any]) -> str:
    counts, payload = c.get("counts", {}), c.get("payload_bytes", {})
    ops = ", ".join(f"{n} {OPS.get(op, op)} ({_human_bytes(payload.get(op))})" for op, n in counts.items() if n)
    return f"per step: {ops or 'none'} (payload S)"


class CollectivesProbe(Probe):
    """Records every collective of the profiled steps on each rank; checks it against the adapter's model."""

    name = "collectives"
    order = 30
    steps = PROBE_STEPS["collectives"]  # declared in zeroexp.cell.schedule

    digest_line = staticmethod(collectives_line)
    report_table = staticmethod(collectives_table)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.steps = list(ctx.schedule.profiled)
        self.prof: profile | None = None
        self.marks: GroupMarks | None = None
        self.records: list[dict[str, Any]] = []
        self.expected: dict[str, dict[str, int]] | None = None
        self.expected_error: str | None = None
        self.param_bytes = 0
        self.exposed: list[dict[str, Any]] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        # P before the strategy wraps (and shards) the model: the model's logical parameter bytes.
        self.param_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx not in self.steps:
            return
        if batch_idx == self.steps[0]:
            # Nothing in flight when the profiler starts: a rank once died of heap corruption ("malloc(): unsorted
            # double linked list corrupted") right at profiler_start in a CI run, with gloo's worker possibly still
            # finishing the last step's work. The barrier (outside the window, not recorded) drains the group.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.prof.start()
            self.marks = GroupMarks()
            self.marks.__enter__()
        with record_function(f"{_MARK}start.{batch_idx}"):  # zero-length marks bound each step
            pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx not in self.steps or self.prof is None:
            return
        with record_function(f"{_MARK}end.{batch_idx}"):
            pass
        if batch_idx != self.steps[-1]:
            return
        self.marks.__exit__(None, None, None)
        self.prof.stop()
        self.records = extract(self.prof, self.steps, self.ctx.world_size, self.ctx.adapter.mesh_dims())
        self.exposed = exposed_comm(self.prof.profiler.kineto_results.experimental_event_tree(), _MARK, op_of_event)
        self.prof = self.marks = None
        try:  # after the window: reads the wrapped model and the optimizer, issues no collective
            self.expected = self.ctx.expect.collectives(trainer.strategy.model, trainer.optimizers[0])
        except NotImplementedError as e:
            self.expected_error = str(e)

    def rank_result(self) -> dict[str, Any]:
        return {"records": self.records, "steps": self.steps, "expected": self.expected,
                "expected_error": self.expected_error, "param_bytes": self.param_bytes, "source": SOURCE,
                "exposed": self.exposed}

    @classmethod
    def aggregate(cls, results: list[dict[str, Any]], cell) -> ProbeReport:
        """Per-step fingerprint of every rank -> ``collectives.csv`` and the checked ``collectives`` section."""
        n, first = cell.world_size, results[0]
        per_rank, reasons = [], []
        for rank, res in enumerate(results):
            mean, unsteady = _per_step_mean([r for r in res["records"] if r["phase"] == "step"], res["steps"], n)
            per_rank.append(mean)
            reasons += [Reason(Code.COLLECTIVES_UNSTEADY, f"rank {rank}: {u}") for u in unsteady]
        rows = [{"rank": r, "op": op, "count": c, "dtype": d, "payload_bytes": b, "bus_bytes": bus_bytes(op, b, size),
                 "mesh_dim": dim, "group_size": size}
                for r, mean in enumerate(per_rank) for (op, d, dim, size), (c, b) in mean.items()]
        disagreements = [{"op": op, "dtype": d, "mesh_dim": dim, "group_size": size,
                          "counts": [m.get(k, (0, 0))[0] for m in per_rank],
                          "payload_bytes": [m.get(k, (0, 0))[1] for m in per_rank]}
                         for k in sorted(set().union(*per_rank)) for op, d, dim, size in [k]
                         if len({m.get(k) for m in per_rank}) > 1]
        reasons += [Reason(Code.COLLECTIVES_RANKS_DISAGREE, f"ranks disagree on {x['op']} ({x['dtype']}, "
                           f"{x['mesh_dim']} group of {x['group_size']}): counts {x['counts']}, payload bytes "
                           f"{x['payload_bytes']}") for x in disagreements]
        counts, payload, dtypes = defaultdict(int), defaultdict(int), defaultdict(set)
        groups: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
        for (op, d, dim, size), (c, b) in per_rank[0].items():  # rank 0 speaks for all; disagreements are listed
            counts[op] += c
            payload[op] += b
            dtypes[op].add(d)
            g = groups[op].setdefault(dim, {"size": size, "count": 0, "payload_bytes": 0})
            g["count"] += c
            g["payload_bytes"] += b
        expected = first["expected"]
        unmodelled = expected is None  # measured and reported, but there is nothing to check them against
        if unmodelled:
            expected = {}
        want_counts = {op: e["count"] for op, e in expected.items()}
        want_payload = {op: e["payload_bytes"] for op, e in expected.items()}
        want_groups = {op: e["groups"] for op, e in expected.items() if e.get("groups")}
        for op, want in want_groups.items():  # where the model names each call's group (hybrid sharding)
            if groups.get(op, {}) != want:
                reasons.append(Reason(Code.COLLECTIVES_GROUPS_DIFFER,
                                      f"{op}: by group {dict(groups.get(op, {}))} per step measured, {want} expected"))
        for op in () if unmodelled else sorted(set(counts) | set(expected)):  # unmodelled: nothing to compare
            if counts.get(op, 0) != want_counts.get(op, 0):
                reasons.append(Reason(Code.COLLECTIVES_COUNT_DIFFERS, f"{op}: {counts.get(op, 0)} per step measured, "
                                      f"{want_counts.get(op, 0)} expected"))
            if payload.get(op, 0) != want_payload.get(op, 0):
                reasons.append(Reason(Code.COLLECTIVES_PAYLOAD_DIFFERS, f"{op}: {payload.get(op, 0)} payload bytes per "
                                      f"step measured, {want_payload.get(op, 0)} expected"))
        p_bytes = int(first["param_bytes"])
        section = {
            "source": first["source"],
            "profiled_steps": list(first["steps"]),
            "world_size": n,
            "counts": dict(counts),
            "dtypes": {op: "+".join(sorted(d)) for op, d in dtypes.items()},
            "payload_bytes": dict(payload),
            "bus_bytes": {op: op_bus_bytes(op, {"payload_bytes": b, "groups": groups[op]}, n)
                          for op, b in payload.items()},
            "groups": {op: dict(g) for op, g in groups.items()},
            "payload_total_bytes": sum(payload.values()),
            "param_bytes": p_bytes,
            "payload_over_param_bytes": {op: b / p_bytes for op, b in payload.items()} if p_bytes else {},
            "expected_counts": want_counts,
            "expected_payload_bytes": want_payload,
            "expected_bus_bytes": {op: op_bus_bytes(op, e, n) for op, e in expected.items()},
            "expected_groups": want_groups,
            "rank_disagreements": disagreements,
            "between_steps": _between(first),
            **exposed_section(results),
            **_check(reasons, first["expected_error"] if unmodelled else None),
        }
        if unmodelled:  # ranks that disagree or an unsteady fingerprint still fail; the rest is not checked
            section.update(expected_counts=None, expected_payload_bytes=None, expected_bus_bytes=None,
                           expected_groups=None)
        return ProbeReport(section=section, tables={"collectives.csv": pd.DataFrame(rows, columns=COLUMNS)})


    @classmethod
    def derived(cls, ctx, groups) -> list[dict[str, Any]]:
        """Rank 0's collectives of each profiled step, :func:`zeroexp.formulas.step_collectives` over ``groups``."""
        e, row, cfg = ctx.expect, ctx.expect.layout, ctx.cfg
        steps, dtype = list(ctx.schedule.profiled), str(cfg.precision.param_dtype)
        limits = row.payload_limits(groups, e.knobs, e.precision, str(cfg.offload.name)) if row.payload_limits else []
        how = (f"zeroexp.formulas.step_collectives over the groups the row {e.name} ({row.label}) derives from the "
               "model's shapes" + ("; not exact here: " + "; ".join(limits) if limits else ""))
        expected = step_collectives(row, groups, e.itemsize, e.knobs)
        records = [{"phase": "step", "step": s, "op": op, "dtype": dtype, "count": c["count"],
                    "payload_bytes": c["payload_bytes"]} for s in steps for op, c in expected.items()]
        return [{"records": records, "steps": steps, "expected": expected, "expected_error": None,
                 "param_bytes": 4 * (groups.numel + sum(groups.frozen)), "source": f"derived, not traced: {how}",
                 "derived_from": SOURCE}]

    @classmethod
    def dry_report(cls, results: list[dict[str, Any]], cell, source: str) -> ProbeReport:
        """Rank 0's table; derived: nothing measured to check (measured equals expected by construction)."""
        report = cls.aggregate(results, cell)
        why = {"source": results[0]["source"], **Check(Verdict.NA, (Reason(
            Code.DERIVED, "derived from the model's structure, not traced: nothing measured to check"),)).fields()
               } if source == "derived" else {}
        return ProbeReport({**report.section, **why, "ranks_in_table": "rank 0"}, report.tables)


def _check(reasons: list[Reason], not_modelled: str | None) -> dict[str, Any]:
    """The section's verdict fields, its one writer: FAIL with ``reasons``; else PASS, or n/a where there is nothing
    to check against (``not_modelled``: why, its reason last)."""
    if not_modelled is None:
        return Check.failed_if(reasons).fields()
    return Check(Verdict.FAIL if reasons else Verdict.NA,
                 (*reasons, Reason(Code.COLLECTIVES_NOT_MODELLED, f"not checked: {not_modelled}"))).fields()


def _per_step_mean(records: list[dict[str, Any]], steps: list[int], world_size: int) -> tuple[dict, list[str]]:
    """``{(op, dtype, mesh_dim, group_size): (count, payload bytes)}`` per step (mean over ``steps``), and how the
    steps differ. A record without a group (a derived dry run's) is the world's."""
    by_step: dict[int, dict[tuple, tuple[int, int]]] = {s: {} for s in steps}
    for r in records:
        key = (r["op"], r["dtype"], r.get("mesh_dim", WORLD), r.get("group_size", world_size))
        by_step[r["step"]][key] = (r["count"], r["payload_bytes"])
    unsteady = [f"step {s} issued {by_step[s]}, step {steps[0]} {by_step[steps[0]]}"
                for s in steps[1:] if by_step[s] != by_step[steps[0]]]
    keys = sorted(set().union(*by_step.values()))
    k = len(steps)
    mean = {key: tuple(_exact(sum(by_step[s].get(key, (0, 0))[i] for s in steps) / k) for i in (0, 1))
            for key in keys}
    return mean, unsteady


def _between(res: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rank 0's collectives between two profiled steps (outside the step hooks), per gap; not checked."""
    gaps = max(len(res["steps"]) - 1, 1)
    out: dict[str, dict[str, Any]] = {}
    for r in res["records"]:
        if r["phase"] == "between":
            e = out.setdefault(r["op"], {"count": 0, "payload_bytes": 0, "dtype": r["dtype"]})
            e["count"] += r["count"] / gaps
            e["payload_bytes"] += r["payload_bytes"] / gaps
    return {op: {**e, "count": _exact(e["count"]), "payload_bytes": _exact(e["payload_bytes"])}
            for op, e in out.items()}


def _exact(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


# The digest line and the report section (Probe.digest_line, Probe.report_table).


def _ops(ok: pd.DataFrame) -> list[str]:
    found = {k.split(".")[-1] for k in ok.columns
             if k.startswith(("collectives.counts.", "collectives.expected_counts."))}
    return [op for op in OPS if op in found] + sorted(found - set(OPS))


def _expected_text(row: pd.Series, ops: list[str]) -> str:
    parts = [f"{OPS.get(op, op)} {fmt_int(row[f'collectives.expected_counts.{op}'])}" for op in ops
             if not missing(row[f"collectives.expected_counts.{op}"])
             and float(row[f"collectives.expected_counts.{op}"])]
    return ", ".join(parts) or (NA if all(missing(row[f"collectives.expected_counts.{op}"]) for op in ops) else "none")

def _groups_text(ok: pd.DataFrame, ops: list[str]) -> list[str]:
    """Per cell, each op's process groups other than the world (``AG shard x2, AR replicate x2``), else ``world``;
    n/a for a cell without the measurement (a run before the groups were recorded)."""
    sizes = [k for k in ok.columns if k.startswith("collectives.groups.") and k.endswith(".size")]
    out = []
    for i in range(len(ok)):
        row = ok.iloc[i]
        parts = [f"{OPS.get(op, op)} {dim} x{int(row[k])}" for op in ops for k in sizes
                 if k.startswith(f"collectives.groups.{op}.") and not missing(row[k])
                 for dim in [k.removeprefix(f"collectives.groups.{op}.").removesuffix(".size")] if dim != WORLD]
        out.append(", ".join(parts) or ("world" if any(not missing(row[k]) for k in sizes) else NA))
    return out


def _human_bytes(nbytes: Any) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB)."""
    if missing(nbytes):
        return "n/a"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


