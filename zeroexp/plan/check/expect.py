"""A cell's expectations from the one model (:mod:`zeroexp.formulas`): the row its strategy names
(``strategy.layout``), its precision, offload and byte-relevant settings, and the strategy's live groups.

The runner hands an :class:`Expectation` to the probes (``RunContext.expect``); the planner
(:mod:`zeroexp.plan.check.cell`) uses :func:`knobs_of` and :func:`itemsize_of` with groups derived from shapes.
Both sides call the same functions of :mod:`zeroexp.formulas.layout`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from zeroexp.cell.resolved import Cell
from zeroexp.formulas import ITEMSIZE, Collectives, Groups, rank_state_bytes, state_factors, step_collectives

__all__ = ["Expectation", "itemsize_of", "groups_record"]


def itemsize_of(cfg: Any) -> int:
    """Bytes per element of the cell's compute dtype (``precision.param_dtype``)."""
    return ITEMSIZE[str(cfg.precision.param_dtype)]


class Expectation:
    """What a cell should show, from its strategy's row and ``groups_of(model, optimizer)`` (the adapter's live
    groups): the closed-form state factors, the per-step collectives. Issues no collective."""

    def __init__(self, cell: Cell, groups_of: Callable[[Any, Any], Groups]) -> None:
        self.name, self.layout = cell.row_name, cell.row
        self.world_size, self.itemsize = cell.world_size, cell.itemsize
        self.precision, self.offload, self.knobs = cell.precision, cell.offload, cell.knobs
        self.groups_of = groups_of
        self.groups: Groups | None = None  # the live groups, once read

    def state_factors(self, trained: float = 1.0, buffers: float = 0.0) -> dict[str, float]:
        """Aggregate factors per kind at the optimizer boundary (sum over ranks / P) [ZeRO 5.1]; ``trained``: the
        fraction of the parameters that train; ``buffers``: the module's buffer bytes / P, which every rank holds
        whole (in fp32 cells: below it strategies differ in whether they cast them, unchecked)."""
        g = self.groups
        if g is not None and g.exact and g.grad_shards is not None:  # sharded: the ranges that hold gradients
            trained = sum(b - a for sh in g.grad_shards for a, b in sh.spans) / max(g.numel + sum(g.frozen), 1)
        elif g is not None and g.exact and g.ungraded and not g.shards:
            # replicated or owned (DDP, ZeroRedundancyOptimizer): a parameter a step gives no gradient holds no state
            # either; a sharded buffer holds a zero gradient and optimizer state for it (DeepSpeed's partitions)
            trained *= 1 - sum(g.numels[i] for i in g.ungraded) / max(g.numel, 1)
        out = state_factors(self.layout, self.world_size, self.itemsize, self.offload, self.knobs.shard_size,
                            trained)
        if buffers and self.itemsize == 4:
            out["buffers"] = self.world_size * buffers
        if g is not None and g.exact and any(u.kept for u in g.units):  # FSDP1 units never resharded (no backward)
            kept = rank_state_bytes(self.layout, g, self.itemsize, self.knobs, self.offload).get("param_unsharded")
            if kept:
                out["param_unsharded"] = sum(lo for lo, _ in kept) / (4 * (g.numel + sum(g.frozen)))
        return out

    def collectives(self, model: Any, optimizer: Any) -> Collectives:
        """One rank's per-step collectives over the live groups; ``NotImplementedError`` naming why the payload model
        does not cover this cell (the check then reads n/a)."""
        groups = self.groups = self.groups_of(model, optimizer)
        limits = self.layout.payload_limits
        reasons = [] if limits is None else limits(groups, self.knobs, self.precision, self.offload)
        if reasons:
            raise NotImplementedError("; ".join(reasons))
        return step_collectives(self.layout, groups, self.itemsize, self.knobs)

    def groups_record(self) -> dict[str, Any] | None:
        """The live groups as JSON-able data (None until :meth:`collectives` read them)."""
        return None if self.groups is None else groups_record(self.groups)


def groups_record(groups: Groups) -> dict[str, Any]:
    """``groups`` as JSON-able data: lists for tuples (the form ``summary.json["plan"]["groups"]`` shows)."""
    import json

    return json.loads(json.dumps(asdict(groups)))
