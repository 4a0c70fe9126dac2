"""What a GPU holds beside the caching allocator's segments (zeroexp.formulas.device_memory: NCCL's buffers per
communicator, the CUDA context), the allocator's expandable_segments mode (zeroexp.formulas.peak.allocator), and the
planner's device total and fits on them."""

from __future__ import annotations

import random

import pytest

from zeroexp.errors import ConfigError
from zeroexp.formulas.device_memory import (CUDA_CONTEXT_BYTES, Communicator, NcclSettings, NcclTopology,
                                            communicator_bytes, communicators, connection_bytes, group_placement)
from zeroexp.formulas.peak.allocator import (LARGE_BUFFER, SMALL_BUFFER, CachingAllocator, ExpandableAllocator,
                                             reserved_peak)

from test_plan_fits import _run

MiB = 2**20
H100 = NcclTopology(ranks_per_node=8, channels=24, p2p_channels=32, nvls=True)
A100 = NcclTopology(ranks_per_node=8, channels=24, p2p_channels=32, p2p_read=True)
TINY = ["model=gpt", "model.n_layer=2", "model.n_embd=128", "model.seq_len=64", "model.vocab_size=512"]


def test_a_connections_buffers_are_nccls_protocols_rounded_to_2_mib():
    s = NcclSettings()
    # NCCL's own products (src/init.cc, src/include/device.h): LL 8 lines x 512 threads x 8 steps x 16 B, LL128
    # 120 elements x 640 threads x 8 steps x 8 B, Simple 4 MiB
    assert (s.ll_buffsize, s.ll128_buffsize, s.buffsize) == (524_288, 4_915_200, 4 * MiB)
    assert connection_bytes(s) == (2 * MiB, 10 * MiB)  # Hopper: the receiver holds all three
    assert connection_bytes(s, p2p_read=True) == (6 * MiB, 6 * MiB)  # Ampere reads the Simple buffer from the sender
    assert connection_bytes(NcclSettings.of({"buffsize": 8 * MiB})) == (2 * MiB, 14 * MiB)


def test_a_communicators_bytes_by_algorithm_on_an_8_gpu_node():
    world = Communicator("world", 8, 8, 1, frozenset({"all_gather", "reduce_scatter"}))
    h = communicator_bytes(world, H100, NcclSettings())
    assert h["ring"] == 24 * 12 * MiB and h["tree"] == 0
    assert h["nvls"] == 8 * 16 * 2 * 8 * 128 * 1024 == 256 * MiB  # 8 heads x 16 channels x 2 x 1 MiB
    assert h["setup"] == (3 * 32 + 2 + 16) * 2 * MiB  # 32 channels' arrays, the comm's two, 16 NVLS channels'
    a = communicator_bytes(world, A100, NcclSettings())
    assert a["nvls"] == 0 and a["ring"] == h["ring"] and a["setup"] == (3 * 32 + 2) * 2 * MiB
    # NVLS off by the environment, or with 2 ranks or fewer of the communicator on the node
    assert communicator_bytes(world, H100, NcclSettings.of({"nvls_enable": False}))["nvls"] == 0
    pair = Communicator("replicate", 2, 2, 1, frozenset({"all_reduce"}))
    assert communicator_bytes(pair, H100, NcclSettings())["nvls"] == 0
    # a barrier alone (no collective NVLS has) connects the ring only
    assert communicator_bytes(Communicator("world", 8, 8, 1), H100, NcclSettings())["nvls"] == 0
    # across nodes an all_reduce connects the tree too; NCCL_MAX_NCHANNELS caps the channels
    wide = Communicator("world", 64, 8, 8, frozenset({"all_reduce"}))
    assert communicator_bytes(wide, H100, NcclSettings())["tree"] == h["ring"]
    assert communicator_bytes(wide, H100, NcclSettings.of({"max_nchannels": 8}))["ring"] == 8 * 12 * MiB
    assert set(communicator_bytes(Communicator("world", 1, 1, 1), H100, NcclSettings()).values()) == {0}


@pytest.mark.parametrize("bad", [{"buffsize": 0}, {"nvls_enable": 1}, {"channels": 4}])
def test_nccl_settings_refuse_what_nccl_would_not_read(bad):
    with pytest.raises(ValueError):
        NcclSettings.of(bad)


def test_hybrid_groups_are_placed_as_the_time_model_places_them():
    assert group_placement("shard", 4, 64, 8) == (4, 1)  # a shard group within a node
    assert group_placement("replicate", 16, 64, 8) == (2, 8)  # one rank of each shard group: 2 a node
    assert group_placement("shard", 16, 64, 8) == (8, 2)
    assert group_placement("replicate", 4, 64, 8) == (1, 4)  # shard groups of a node or more: one a node
    assert group_placement("world", 64, 64, 8) == (8, 8)


def test_a_rows_communicators_are_the_groups_its_collectives_name():
    from zeroexp.formulas import LAYOUTS, ModelShape, PlanKnobs, derive_groups, step_collectives

    shape = ModelShape.from_count(10**6)
    comms, ops = {}, {}
    for name, knobs in (("ddp", PlanKnobs()), ("fsdp2_hybrid", PlanKnobs(shard_size=4)),
                        ("deepspeed_stage2", PlanKnobs())):
        row = LAYOUTS[name]
        collectives = step_collectives(row, derive_groups(name, row, shape, 16, 2, knobs), 2, knobs)
        ops[name] = frozenset(collectives)
        comms[name] = {(c.name, c.size, c.per_node, c.nodes): c.ops for c in
                       communicators(collectives, 16, 8, row.family.clones_world)}
    assert comms["ddp"] == {("world", 16, 8, 2): frozenset({"all_reduce"})}
    assert set(comms["fsdp2_hybrid"]) == {("world", 16, 8, 2), ("shard", 4, 4, 1), ("replicate", 4, 2, 2)}
    assert comms["fsdp2_hybrid"][("shard", 4, 4, 1)] == {"all_gather", "reduce_scatter"}
    # DeepSpeed runs its collectives on a clone of the world: the default group's communicator is a barrier's
    assert comms["deepspeed_stage2"][("world", 16, 8, 2)] == frozenset()
    assert comms["deepspeed_stage2"][("deepspeed_world", 16, 8, 2)] == ops["deepspeed_stage2"] != frozenset()


def test_expandable_segments_map_pages_where_the_default_takes_segments():
    """12 MiB freed, then 14 MiB: the default allocator's 12 MiB segment cannot hold it (a second segment, 26 MiB
    reserved); expandable segments map one 20 MiB page and reuse it."""
    for cls, want in ((CachingAllocator, 26 * MiB), (ExpandableAllocator, 20 * MiB)):
        a = cls()
        a.free(a.malloc(12 * MiB))
        a.malloc(14 * MiB)
        assert a.reserved == want, cls.__name__
    e = ExpandableAllocator()
    e.malloc(300)  # the small pool maps 2 MiB pages
    assert e.reserved == SMALL_BUFFER
    big = e.malloc(30 * MiB)  # the large pool: whole 20 MiB pages, the free end grown, not a new segment
    assert e.reserved == SMALL_BUFFER + 2 * LARGE_BUFFER
    e.free(big)
    e.malloc(25 * MiB)
    e.malloc(15 * MiB)  # the 15 MiB left at the mapped end holds it
    assert e.reserved == SMALL_BUFFER + 2 * LARGE_BUFFER
    e.free(e.malloc(20 * MiB))  # nothing free: one page more, mapped at the end
    assert e.reserved == SMALL_BUFFER + 3 * LARGE_BUFFER


def test_expandable_segments_keep_reserved_whole_pages_above_allocated():
    rng = random.Random(0)
    for _ in range(20):
        a, live = ExpandableAllocator(), []
        for _ in range(60):
            if live and rng.random() < 0.4:
                a.free(live.pop(rng.randrange(len(live))))
            else:
                live.append(a.malloc(rng.choice([100, 4096, 700_000, 3 * MiB, 17 * MiB, 45 * MiB])))
            assert a.allocated <= a.reserved and a.peak_allocated <= a.peak_reserved
            small, large = a.mapped
            assert small % SMALL_BUFFER == 0 and large % LARGE_BUFFER == 0 and a.reserved == small + large
    steady = {"p": 100 * MiB, "g": 3 * MiB}
    phases = [{"a": 50 * MiB, "b": (1000, 2000)}, {"g": -2 * MiB, "d": 70 * MiB}]
    assert reserved_peak(steady, phases, expandable=True)[1] == reserved_peak(steady, phases)[1]


def test_the_planner_adds_nccl_and_the_context_and_fits_on_the_devices_total():
    records, notes = _run(*TINY, "world_size=16", "batch_size=2", "network=h100_ib", "device_memory=80GiB",
                          "strategies=[ddp,fsdp2_full,fsdp2_hybrid,deepspeed_stage3]", "shard_size=4",
                          "precision=bf16")
    rows = {r["strategy"]: r for r in records}
    for r in records:
        assert r["context_bytes"] == CUDA_CONTEXT_BYTES
        assert r["nccl_bytes"] == sum(c["bytes"] for c in r["nccl"]["by_communicator"])
        assert r["device_total_bytes"] == r["reserved_peak_bytes"] + r["nccl_bytes"] + r["context_bytes"]
        assert r["fits_on"] == "device" and r["fits_bytes"] == r["device_total_bytes"] and r["fits"]
        assert r["nccl"]["settings"]["NCCL_BUFFSIZE"] == 4 * MiB
    # two nodes of 8: the world's ring, tree (all_reduce across nodes) and NVLS (8 on a node)
    (world,) = rows["ddp"]["nccl"]["by_communicator"]
    assert (world["size"], world["per_node"], world["nodes"]) == (16, 8, 2)
    assert world["ring_bytes"] == world["tree_bytes"] == 288 * MiB and world["nvls_bytes"] == 256 * MiB
    assert len(rows["fsdp2_hybrid"]["nccl"]["by_communicator"]) == 3
    assert len(rows["deepspeed_stage3"]["nccl"]["by_communicator"]) == 2
    # NCCL's environment through the preset's nccl node: NVLS off takes its buffers and channel arrays away
    off, _ = _run(*TINY, "world_size=16", "batch_size=2", "network=h100_ib", "strategies=[ddp]", "precision=bf16",
                  "network.nccl.nvls_enable=false")
    assert rows["ddp"]["nccl_bytes"] - off[0]["nccl_bytes"] == 256 * MiB + 16 * 2 * MiB


def test_expandable_segments_is_a_key_of_the_planner_on_cuda_alone():
    base = [*TINY, "world_size=8", "batch_size=2", "network=h100_ib", "strategies=[fsdp2_full]", "precision=bf16"]
    (default,), _ = _run(*base)
    (expandable,), _ = _run(*base, "allocator.expandable_segments=true")
    assert default["peak_bytes"] == expandable["peak_bytes"]
    assert expandable["reserved_peak_bytes"] >= expandable["peak_bytes"]
    assert expandable["reserved_peak_bytes"] != default["reserved_peak_bytes"]
    with pytest.raises(ConfigError) as e:
        _run(*TINY, "device=cpu", "allocator.expandable_segments=true")
    assert e.value.key == "allocator.expandable_segments"
    with pytest.raises(ConfigError) as e:
        _run(*TINY, "network=h100_ib", "batch_size=2", "network.nccl.buffsize=-1")
    assert e.value.key == "network.nccl.buffsize"


def test_a_cells_allocator_key_sets_the_ranks_environment_and_is_refused_on_the_cpu(compose):
    from zeroexp.cell.identity import cell_id
    from zeroexp.config.allocator import check_allocator
    from zeroexp.devices import cuda_alloc_conf

    assert cuda_alloc_conf(True, None) == "expandable_segments:True"
    assert cuda_alloc_conf(True, "max_split_size_mb:128,expandable_segments:False") == \
        "max_split_size_mb:128,expandable_segments:True"
    assert cuda_alloc_conf(False, "expandable_segments:True") == "expandable_segments:False"
    assert cuda_alloc_conf(False, None) is None
    cfg = compose("device=cpu", "allocator.expandable_segments=true")
    with pytest.raises(ConfigError) as e:
        check_allocator(cfg)
    assert e.value.key == "allocator.expandable_segments"
    assert cell_id(compose("device=cpu")) == cell_id(compose("device=cpu", "allocator.expandable_segments=false"))
    assert cell_id(compose("device=cuda", "allocator.expandable_segments=true")) != cell_id(compose("device=cuda"))


@pytest.mark.parametrize("nvml", [True, False])
def test_a_cuda_cells_device_reading_is_judged_against_reserved_and_the_context(compose, nvml):
    """The check a GPU cell's plan.memory runs on the probe's device reading (NVML's used bytes, else
    cudaMemGetInfo's): at least the allocator's reserved model and the CUDA context; what the device holds beyond the
    measured reserved bytes laid beside."""
    from zeroexp.cell.resolved import Cell, layout_of
    from zeroexp.models import import_class, wrap_paths
    from zeroexp.plan.check.cell import cell_groups
    from zeroexp.plan.check.memory import memory_section
    from zeroexp.plan.shape import model_shape
    from zeroexp.results.verdict import Code

    from test_plan_cuda import _cuda_measurement

    cfg = compose("strategy=fsdp2_full", "world_size=2", "model=mlp", "batch_size=4")
    args = (layout_of(cfg)[0], cell_groups(Cell.of(cfg)), 4, [import_class(p) for p in wrap_paths(cfg)],
            model_shape(cfg.model, wrap_paths(cfg)))
    first = memory_section(Cell.of(cfg), _cuda_measurement(None, 2, 10**8, 10**10), *args)
    reserved = first["phases"]["forward"]["predicted_reserved_bytes"]

    def judged(used: int) -> dict:
        measured = _cuda_measurement(first, 2, 10**8, reserved)
        reading = {"cudamem_used_bytes": used, "total_bytes": 80 * 2**30, "nvml_used_bytes": used if nvml else None}
        measured["memory"]["device_by_rank"] = [reading, reading]
        return memory_section(Cell.of(cfg), measured, *args)

    floor = reserved + CUDA_CONTEXT_BYTES
    ok = judged(floor + 300 * MiB)
    steady = ok["phases"]["steady"]
    assert ok["check"] == "PASS" and steady["device_check"] == "PASS"
    assert steady["predicted_device_floor_bytes"] == floor
    assert steady["beyond_allocator_bytes"] == floor + 300 * MiB - reserved
    assert steady["device_used_source"] == ("nvml" if nvml else "cudaMemGetInfo")
    low = judged(floor - 512)
    assert low["check"] == "FAIL" and set(low["reason_codes"]) == {Code.MEMORY_DEVICE_BELOW_PREDICTION}
    # a rank that ran with expandable_segments is judged on that allocator's model of reserved
    measured = _cuda_measurement(first, 2, 10**8, 10**10)
    measured["memory"]["device_by_rank"] = [{"cudamem_used_bytes": 2**40, "expandable_segments": True}] * 2
    pages = memory_section(Cell.of(cfg), measured, *args)["phases"]["forward"]["predicted_reserved_bytes"]
    assert pages % (2 * MiB) == 0 and pages != reserved


def test_the_probes_device_reading_takes_nvml_and_cudas_figures(monkeypatch):
    import torch

    from zeroexp.probes.memory import ALLOCATOR_STATS, device_reading

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {k: 7 for k in ALLOCATOR_STATS} | {"other": 1})
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda d=None: 51 * 2**30)
    got = device_reading(torch.device("cuda", 0))
    assert (got["cudamem_used_bytes"], got["nvml_used_bytes"], got["total_bytes"]) == (50 * 2**30, 51 * 2**30,
                                                                                        80 * 2**30)
    assert got["allocator_stats"] == {k: 7 for k in ALLOCATOR_STATS} and got["nccl_bytes"] is None

    def no_nvml(d=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    got = device_reading(torch.device("cuda", 0))
    assert got["nvml_used_bytes"] is None and "pynvml" in got["nvml_why"]
