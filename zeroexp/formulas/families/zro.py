"""ZeroRedundancyOptimizer on DDP: DDP's buckets, each parameter's optimizer state with one owner
(torch/distributed/optim/zero_redundancy_optimizer.py), who broadcasts it after the step; its row ``zro``."""

from __future__ import annotations

from zeroexp.formulas.families.base import Cut
from zeroexp.formulas.checkpoint_peak import CheckpointPeaks, phase
from zeroexp.formulas.families.ddp import MIXED, DdpBuckets, buffer_broadcasts, ddp_buckets, ddp_unused
from zeroexp.formulas.layout import ModelShape, PlanKnobs, StateLayout, owner_assignment, owner_tuples
from zeroexp.formulas.paper import Collectives, collectives_of
from zeroexp.formulas.shapes import Groups

__all__ = ["ZroOwners", "ZRO", "ROWS", "all_reduce_then_broadcast"]


def _zro_comm(shape: ModelShape, world_size: int, knobs: PlanKnobs) -> dict:
    """DDP's buckets, then ZeroRedundancyOptimizer's broadcasts: one per owned parameter, rank by rank, or with
    ``parameters_as_bucket_view`` one per rank's bucket (an empty one included)."""
    numels = shape.numels
    if not shape.exact:
        broadcasts = (shape.numel,)
    else:
        owned = [[numels[i] for i in o] for o in owner_assignment(numels, world_size)]
        broadcasts = tuple(sum(o) for o in owned) if knobs.parameters_as_bucket_view else \
            tuple(k for o in owned for k in o)
    return {"buckets": ddp_buckets(shape, knobs), "broadcasts": broadcasts,
            "buffer_broadcasts": buffer_broadcasts(shape.buffers), **ddp_unused(shape, knobs)}


def all_reduce_then_broadcast(g: Groups, c: int, knobs: PlanKnobs) -> Collectives:
    """ZeRO-1 as ZeroRedundancyOptimizer does it: DDP's bucket all_reduces (P) [ZeRO 7.2.1], then each owner
    broadcasts its updated parameters (``_sync_params``): one broadcast per parameter, or per owner bucket; S = P;
    and DDP's broadcast of the buffers before forward."""
    return collectives_of(all_reduce=[sum(b) * c for b in g.buckets] + ([g.used_map_bytes] if g.used_map_bytes else []),
                          broadcast=[k * c for k in g.broadcasts] + list(g.buffer_broadcasts))


class ZroOwners(DdpBuckets):
    """DDP's family, the optimizer state of each parameter on its owner alone."""

    name = "zro"

    def groups_kind(self, row):
        return "owners"

    def cut(self, row, shape, n, knobs, itemsize, narrow):
        return Cut(owners=[tuple(shape.numels[i] for i in o) for o in owner_assignment(shape.numels, n)])

    def sharded_written(self, row, groups, itemsize, knobs, state, again):
        """Its own files: rank 0 the module's state dict (``model.pt``: a tied parameter once), each rank the AdamW
        state of the parameters it owns (``optim_rank<r>.pt``: moments and a step for each it gave a gradient)."""
        from zeroexp.formulas.layout import MOMENT_BYTES, STEP_BYTES, _ungraded_per_rank

        n = groups.world_size
        owners, idle = owner_assignment(groups.numels, n), _ungraded_per_rank(groups, n)
        owned = [sum(groups.numels[i] for i in o) - e for o, (e, _) in zip(owners, idle)]
        counts = [len(o) - c for o, (_, c) in zip(owners, idle)]
        module = state.params + state.frozen + state.buffers
        ranks = [MOMENT_BYTES * e + STEP_BYTES * c + (module if r == 0 else 0)
                 for r, (e, c) in enumerate(zip(owned, counts))]
        return {"layout": "owners", "total": sum(ranks), "ranks": ranks, "state": state.record(), "aliases": 0}

    def checkpoint_peaks(self, row, groups, shape, itemsize, kind, device, full_file, state, knobs):
        """zeroexp.strategies.zro: a full save consolidates on rank 0 (``consolidate_state_dict``: each owner's AdamW
        state broadcast as a pickled object, so rank 0 holds every other owner's, each owner its own pickled; a lower
        bound: the pickles' structure is not sized); a full load reads the file on every rank and keeps its owned
        state from it; a sharded save writes each rank's own files from its tensors (nothing copied); a sharded load
        reads the module's file, then the rank's optimizer file (the larger of the two)."""
        n, cpu = groups.world_size, device.name == "cpu"
        module = state.params + state.frozen + state.buffers
        files = self.sharded_written(row, groups, itemsize, knobs, state, 0)["ranks"]
        owned = [b - (module if r == 0 else 0) for r, b in enumerate(files)]  # each owner's optimizer state
        if kind == "full":
            save = phase([{"others_received": sum(owned[1:])}] + [{"own_pickled": b} for b in owned[1:]],
                         [False] * n, None if cpu else [full_file] + [0] * (n - 1), unsized=("objects",))
            load = phase([{"file": full_file if cpu else 0, "owned": 0 if cpu else b} for b in owned], [True] * n,
                         None if cpu else [full_file] * n)
            return CheckpointPeaks(kind, save, load)
        save = phase([{"copied": 0}] * n, [True] * n)
        if cpu:
            return CheckpointPeaks(kind, save, phase([{"largest_file": max(module, b)} for b in owned], [True] * n))
        # read to the host; the owned state moved to the device
        return CheckpointPeaks(kind, save, phase([{"owned": b} for b in owned], [True] * n,
                                                 [max(module, b) for b in owned]))

    def stepped(self, groups: Groups, rank: int) -> list[int]:
        """The parameters rank ``rank`` owns."""
        return list(owner_tuples(tuple(groups.numels), groups.world_size)[rank])

    def worst_rank(self, row, groups, trace, itemsize, *, micro_batches, in_place, bucket_cap_bytes, foreach,
                   knobs=PlanKnobs()):
        """The ranks differ only by the sizes of the parameters each steps (:meth:`stepped_numels`, AdamW's
        temporaries in :meth:`phase_peaks`): the first rank of each distinct list of them, each evaluated (a 512-rank
        Llama row has a handful, not 512)."""
        first: dict[tuple[int, ...], int] = {}
        for r in range(groups.world_size):
            first.setdefault(self.stepped_numels(groups, r), r)
        return tuple(first.values())


ZRO = ZroOwners()

ROWS = {
    "zro": StateLayout("DDP + ZeroRedundancyOptimizer", 1, frozenset({"optim"}), "never", ZRO,
                       all_reduce_then_broadcast, fp32_at_rest=True, fp32_on_the_wire=True, precisions=MIXED,
                       comm=_zro_comm, source="zeroexp.strategies.zro", ranks_differ=True, init_modelled=True),
}
