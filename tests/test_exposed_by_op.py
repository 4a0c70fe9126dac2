"""Exposed communication by op (zeroexp.probes.exposed) on a given event tree: exact milliseconds."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch._C._profiler import _EventType

from zeroexp.probes.collectives import op_of_event
from zeroexp.probes.exposed import exposed_comm

MS = 1_000_000  # ns


@dataclass
class Ev:
    name: str
    start_time_ns: int
    end_time_ns: int
    children: list = field(default_factory=list)
    tag: object = _EventType.TorchOp


def test_op_names():
    assert op_of_event("c10d::allreduce_") == "all_reduce"
    assert op_of_event("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert op_of_event("c10d::_allgather_base_") == "all_gather"
    assert op_of_event("gloo:all_gather") == "all_gather"
    assert op_of_event("nccl:broadcast") == "broadcast"
    assert op_of_event("c10d::something_new_") == "something_new_"


def test_exposed_by_op_on_a_given_step():
    # step 0..100 ms: compute 0-40 and 60-80; a reduce_scatter in flight 30-50 (c10d op) and its all_reduce-like
    # gloo work none; an all_gather issued 45 (c10d 45-46, gloo work on its thread 46-70); a broadcast 90-95.
    tree = [Ev("zx:start.3", 0, 0), Ev("zx:end.3", 100 * MS, 100 * MS),
            Ev("aten::mm", 0, 40 * MS), Ev("aten::add_", 60 * MS, 80 * MS),
            Ev("c10d::_reduce_scatter_base_", 30 * MS, 50 * MS),
            Ev("c10d::_allgather_base_", 45 * MS, 46 * MS), Ev("gloo:all_gather", 46 * MS, 70 * MS),
            Ev("c10d::broadcast_", 90 * MS, 95 * MS),
            Ev("optimizer step", 0, 0, children=[Ev("aten::copy_", 85 * MS, 86 * MS)], tag=None)]
    (row,) = exposed_comm(tree, "zx:", op_of_event)
    assert row["step"] == 3 and row["step_ms"] == 100
    assert row["compute_ms"] == 61  # 0-40, 60-80, 85-86
    assert row["in_flight_ms"] == 45  # 30-70, 90-95
    assert row["exposed_comm_ms"] == 25  # 40-60, 90-95
    # reduce_scatter exposed 40-50; all_gather 45-60 (overlapping the reduce_scatter's 45-50 counts for both)
    assert row["exposed_comm_ms_by_op"] == {"all_gather": 15, "broadcast": 5, "reduce_scatter": 10}
