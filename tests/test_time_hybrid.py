"""The step-time model times hybrid sharding's collectives over their own process groups (NCCL's cost model on a
preset, two levels on a preset without NCCL): exact on given links, no timing."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from zeroexp.formulas import LAYOUTS, PlanKnobs, derive_groups, step_collectives, two_level_seconds
from zeroexp.formulas.time.overlap import _op_seconds
from zeroexp.formulas.time.nccl_cost import nccl_seconds
from zeroexp.plan.network import nccl_topo, network_of
from zeroexp.plan.shape import model_shape

CONF = Path(__file__).resolve().parent.parent / "conf"


def test_each_group_of_an_op_is_timed_at_its_own_size():
    entry = {"count": 3, "payload_bytes": 700,
             "groups": {"shard": {"size": 8, "count": 2, "payload_bytes": 600},
                        "replicate": {"size": 16, "count": 1, "payload_bytes": 100}}}
    seen = []

    def group_seconds(dim, size):
        seen.append((dim, size))
        return lambda op, s, calls: size * 1000 + s + calls  # exact: which size, payload and calls it got

    got = _op_seconds("all_reduce", entry, 0.5, lambda op, s, calls: -1.0, group_seconds)
    assert seen == [("shard", 8), ("replicate", 16)]
    assert got == (8000 + 300 + 1) + (16000 + 50 + 0.5)
    # without groups, or without a group timer: the op over all ranks
    assert _op_seconds("all_reduce", entry, 1.0, lambda op, s, calls: s + calls, None) == 703
    assert _op_seconds("all_reduce", {"count": 1, "payload_bytes": 9}, 1.0, lambda op, s, c: s, group_seconds) == 9


def test_a_preset_places_shard_groups_in_a_node_and_replicas_across_nodes():
    """Each group of a preset is timed by NCCL's cost model at its own (ranks a node, nodes)."""
    node = OmegaConf.load(CONF / "network" / "h100_ib.yaml")
    net = network_of(node, "bf16", 1024)
    topo = nccl_topo(node)
    at = net.groups_at(512)  # 64 nodes of 8
    s = 2**30
    assert at("shard", 8)("reduce_scatter", s, 1) == nccl_seconds("reduce_scatter", s, 8, 1, topo, 1)
    # shard_size 8: the replicate group holds one rank a node, 64 nodes: the NICs alone
    assert at("replicate", 64)("all_reduce", s, 1) == nccl_seconds("all_reduce", s, 1, 64, topo, 1)
    # shard_size 4 at N=512: 128 replicas, two of each replicate group a node
    assert at("replicate", 128)("all_reduce", s, 1) == nccl_seconds("all_reduce", s, 2, 64, topo, 1)
    assert at("world", 512)("all_reduce", s, 1) == net.seconds_at(512)("all_reduce", s, 1)
    assert net.seconds_at(512)("all_reduce", s, 1) == nccl_seconds("all_reduce", s, 8, 64, topo, 1)


def test_a_preset_without_nccl_keeps_the_two_level_ring():
    """RCCL's mi300x (``nccl: null``): its groups in two levels of its intra / inter links."""
    from zeroexp.formulas import LinkFit

    node = OmegaConf.load(CONF / "network" / "mi300x.yaml")
    intra = LinkFit(node.intra.alpha_s, node.intra.busbw_Bps)
    inter = LinkFit(node.inter.alpha_s, node.inter.busbw_Bps)
    at = network_of(node, "bf16", 1024).groups_at(512)
    s = 2**30
    assert at("replicate", 64)("all_reduce", s, 1) == two_level_seconds("all_reduce", s, 1, 64, intra, inter, 1)
    assert at("shard", 8)("reduce_scatter", s, 1) == two_level_seconds("reduce_scatter", s, 8, 1, intra, inter, 1)


def test_the_hybrid_row_names_its_groups_for_the_time_model(compose):
    cfg = compose("strategy=fsdp_hybrid", "strategy.shard_size=2", "world_size=4")
    groups = derive_groups("fsdp_HYBRID_SHARD", LAYOUTS["fsdp_HYBRID_SHARD"], model_shape(cfg.model, []), 4, 4,
                           PlanKnobs(shard_size=2))
    model = step_collectives(LAYOUTS["fsdp_HYBRID_SHARD"], groups, 4, PlanKnobs(shard_size=2))
    assert {dim: g["size"] for dim, g in model["all_gather"]["groups"].items()} == {"shard": 2}
    assert {dim: g["size"] for dim, g in model["all_reduce"]["groups"].items()} == {"replicate": 2}


def test_fsdp2_reshard_to_k_times_each_backward_all_gather_over_its_k_ranks():
    """``reshard_after_forward=2`` at N=8 (4 units of 64 x 64 fp32, S = 16 KiB each): every forward all_gather is
    timed over the world (8 ranks), every backward one over its post-forward group (2 ranks), one call of S each;
    the reduce_scatters over all ranks as before."""
    from zeroexp.formulas import ComputeRate, ModelShape, predict_step

    layout, knobs = LAYOUTS["fsdp2_full"], PlanKnobs(post_forward_ranks=2)
    g = derive_groups("fsdp2_full", layout, ModelShape(((64, 64),) * 4, tuple((i,) for i in range(4)), (False,) * 4),
                      8, 4, knobs)
    seen, cost = set(), {"world": 1.0, "post_forward": 0.25, "all": 2.0}  # each group's call its own time

    def group_seconds(dim, size):
        return lambda op, s, calls: seen.add((op, dim, size, s, calls)) or cost[dim]

    t = predict_step(layout, g, step_collectives(layout, g, 4, knobs), ComputeRate(1e-9, 2e-9, 1e-9), 1,
                     lambda op, s, calls: seen.add((op, "all", 8, s, calls)) or cost["all"], False,
                     group_seconds=group_seconds)
    s = 64 * 64 * 4
    assert seen == {("all_gather", "world", 8, s, 1), ("all_gather", "post_forward", 2, s, 1),
                    ("reduce_scatter", "all", 8, s, 1)}
    assert t.comm_s == 4 * 1.0 + 4 * 0.25 + 4 * 2.0
