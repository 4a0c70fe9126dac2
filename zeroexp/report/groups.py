"""Collectives by process group: each hybrid cell's calls and payload per op and mesh dimension, beside the model's.

Hybrid sharding (``fsdp_hybrid``, ``fsdp2_hybrid``) runs its all_gathers and reduce_scatters in a shard group of
``strategy.shard_size`` ranks and all-reduces the gradient shards across the replicas; the collectives probe learns
each call's group (``summary.json["collectives"]["groups"]``, ``collectives.csv`` ``mesh_dim`` / ``group_size``) and
the model names the group of each call it predicts (``collectives.expected_groups``). The table has one row per cell,
op and group, for the cells of the sweep with a call outside the default group; the others' calls are all the
world's, as the collectives table says.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from zeroexp.formulas import WORLD, bus_bytes
from zeroexp.results.format import NA, fmt_int, missing
from zeroexp.results.section import OPS, Column, ReportTable

__all__ = ["GroupsSection", "groups_of", "groups_table"]

_PREFIX = "collectives.groups."
_FIELDS = ("size", "count", "payload_bytes")


def groups_of(row: pd.Series, prefix: str = _PREFIX) -> dict[tuple[str, str], dict[str, Any]]:
    """``{(op, mesh_dim): {size, count, payload_bytes}}`` of one cell (a ``load_sweep`` row), from the flattened
    ``collectives.groups`` (``prefix``: ``collectives.expected_groups.`` for the model's), ops in the ladder's order."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for key in row.index:
        if not key.startswith(prefix) or missing(row[key]):
            continue
        op, rest = key[len(prefix):].split(".", 1)
        dim, _, field = rest.rpartition(".")
        if field in _FIELDS and dim:
            found.setdefault((op, dim), {})[field] = row[key]
    order = {op: i for i, op in enumerate(OPS)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0][0], kv[0][1] != WORLD,
                                                       kv[0][1])))


def groups_table(ok: pd.DataFrame) -> ReportTable | None:
    """Per cell with a call outside the default group: per op and group, calls and payload per step (measured, rank 0),
    the model's beside them, and bus bytes at the group's size; None when every call of every cell is the world's."""
    rows = []
    for _, row in ok.iterrows():
        measured, expected = groups_of(row), groups_of(row, "collectives.expected_groups.")
        if all(dim == WORLD for _, dim in [*measured, *expected]):
            continue
        for (op, dim) in dict.fromkeys([*measured, *expected]):
            # a group one side lacks: 0 calls on that side; a side with no groups at all (not modelled): n/a
            m = measured.get((op, dim), {"count": 0, "payload_bytes": 0}) if measured else {}
            e = expected.get((op, dim), {"count": 0, "payload_bytes": 0}) if expected else {}
            size = m.get("size", e.get("size"))
            payload = m.get("payload_bytes")
            rows.append({"label": row.get("label"), "cell_name": row.get("cell_name"), "op": op, "mesh_dim": dim,
                         "group_size": size, "count": m.get("count"), "expected_count": e.get("count"),
                         "payload_bytes": payload, "expected_payload_bytes": e.get("payload_bytes"),
                         "bus_bytes": None if missing(payload) or missing(size) else bus_bytes(op, payload, int(size)),
                         "check": row.get("collectives.check")})
    if not rows:
        return None
    raw = pd.DataFrame(rows)
    cols = [Column("cell", "label", str), Column("op", "op", lambda op: f"{OPS.get(op, op)} ({op})"),
            Column("group", "mesh_dim", str), Column("ranks", "group_size", fmt_int),
            Column("calls", "count", fmt_int, "expected_count"),
            Column("payload B", "payload_bytes", fmt_bytes, "expected_payload_bytes"),
            Column("bus B", "bus_bytes", fmt_bytes), Column("check", "check")]
    note = ("Per step, rank 0, the hybrid cells (a call outside the default group): each op's calls by the process "
            "group they ran over, measured (the collectives probe marks each c10d op with its group) beside the "
            "model's (exp. X where they differ); payload S sized by the group (an all_gather's or reduce_scatter's "
            "chunk x the group's ranks) and bus bytes at the group's size, in bytes (a clipping norm's all_reduce "
            "moves 4). shard: within a shard group of strategy.shard_size ranks; replicate: across the world_size / "
            "shard_size replicas; world: all ranks. check: the cell's collectives check.")
    return ReportTable("collective_groups", "Collectives by process group", raw, cols, note)


class GroupsSection:
    """``collectives.groups`` shown as a section of its own, after the collectives table: a report table, no digest
    line (the collectives line says the calls)."""

    name = "collectives.groups"
    order = 31
    report_order = None

    @staticmethod
    def digest_line(groups: dict[str, Any]) -> None:
        return None

    @staticmethod
    def report_table(ok: pd.DataFrame) -> ReportTable | None:
        return groups_table(ok)


def fmt_bytes(value: Any) -> str:
    """Exact bytes with thousands separators (n/a when absent)."""
    return NA if missing(value) else f"{int(value):,}"
