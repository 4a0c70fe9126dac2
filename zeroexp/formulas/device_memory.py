"""What a GPU holds beyond the caching allocator's segments: NCCL's communicator buffers and the CUDA context.

``nvidia-smi`` (NVML's used memory) counts every byte the process holds on the device: the caching allocator's
reserved segments (``torch.cuda.max_memory_reserved``, :mod:`zeroexp.formulas.peak.allocator`), NCCL's buffers (which
NCCL takes with ``cuMemCreate`` or ``cudaMalloc`` itself: src/include/alloc.h ``ncclCudaCalloc``, never through
torch's allocator) and the CUDA context (the driver's per-process state and the kernels' code). A job fits when all
three fit. The terms, each from NCCL's source (NVIDIA/nccl, 2.23 to 2.30; the buffers' sizes unchanged since 2.12):

[NCCL-BUF] src/init.cc ``computeBuffSizes``: each connection of a channel carries the three protocols' buffers, LL
``NCCL_LL_LINES_PER_THREAD`` 8 x ``NCCL_LL_MAX_NTHREADS`` 512 x ``NCCL_STEPS`` 8 x 16 B = 512 KiB, LL128
``NCCL_LL128_ELEMS_PER_THREAD`` 120 x ``NCCL_LL128_MAX_NTHREADS`` 640 x 8 steps x 8 B = 4,915,200 B, Simple
``DEFAULT_BUFFSIZE`` 4 MiB (env ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE``, ``NCCL_BUFFSIZE``).
[NCCL-P2P] src/transport/p2p.cc ``p2pSendSetup`` / ``p2pRecvSetup``: over NVLink the receiver holds its
``ncclRecvMem`` (4 KiB, ``MEM_ALIGN``) and the protocols' buffers, the sender its ``ncclSendMem`` (4 KiB), each
rounded up to ``CUDA_IPC_MIN`` = 2 MiB; with P2P read (compute capability 8.0 pairs over NVLink, src/graph/paths.cc)
the Simple buffer moves to the sender. Defaults: 2 + 10 MiB a channel (Hopper), 6 + 6 MiB (Ampere).
[NCCL-RING] src/graph/connect.cc, src/graph/search.cc: a ring channel connects each rank to its next (send) and its
previous (recv); an 8-GPU NVSwitch node's search gives 12 channels, duplicated to 24 (``nChannels * 2``) on A100 and
H100 (NCCL's INFO log: "24 coll channels", NVIDIA/nccl#1781), capped by ``NCCL_MAX_NCHANNELS``.
[NCCL-TREE] src/transport.cc ``ncclTransportTreeConnect``: the tree (all_reduce across nodes) connects up to 3 peers a
channel; counted as the ring's connections again for a communicator across nodes that all-reduces.
[NCCL-NVLS] src/transport/nvls.cc (2.23 on): NVLink SHARP (NVSwitch multicast, compute capability 9.0 and later) binds
``nHeads`` (the node's ranks, up to ``NCCL_MAX_NVLS_ARITY``) x ``NVLS_NCHANNELS_SM90`` 16 (env
``NCCL_NVLS_NCHANNELS``) x 2 (reduce and broadcast) x a buffer of 8 x ``NCCL_NVLS_CHUNKSIZE`` 128 KiB to each rank:
256 MiB on an 8-GPU node; none where ``NCCL_NVLS_ENABLE=0`` or the communicator has 2 ranks or fewer on the node
(``ncclNvlsInit``: ``gpuCount <= 2`` from 2.23 to 2.27; from 2.28 ``gpuCount < 2``, so a 2-rank one gets NVLS there:
not modelled, the 2.23-2.27 rule taken).
[NCCL-SETUP] src/channel.cc ``initChannel``: three device arrays a channel (its peers, its ring's ranks), for each of
the communicator's collective and send/recv channels (``p2pnChannels``: 32 on an 8-GPU NVSwitch node,
src/graph/paths.cc), each rounded up to cuMem's 2 MiB granularity (src/include/alloc.h ``ncclCuMemAlloc``; cuMem is
NCCL's default since 2.19); ``initNvlsChannel`` one more an NVLS channel; ``devCommSetup`` two (init.cc): 6 MiB a
channel, about 0.2 GiB a communicator on an 8-GPU node. With ring channels after a barrier and a CUDA context this is
the 1.06 GB NVIDIA/nccl#1685 measured on 8 x H100 before its first all-to-all.
[NCCL-LAZY] src/init.cc ``NCCL_RUNTIME_CONNECT`` (default 1 since 2.22): an algorithm's buffers are connected at its
first use, not at init (``NCCL_RUNTIME_CONNECT=0``: ring, tree and NVLS all at init).
[TORCH-PG] torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: one NCCL communicator per process group and device, made
at its first collective. One of a single rank has no peer to connect: counted as none (its structures are not).
[CTX] the CUDA context with lazy module loading (``CUDA_MODULE_LOADING=LAZY``: torch sets it since 1.13, CUDA makes it
the default since 12.2): 287,047,680 B, torch's own measurement when it turned lazy loading on (pytorch/pytorch#86509:
``cudaMemGetInfo``'s total - free after one 6.4 MB tensor; 666,632,192 B loading every module eagerly); "around 400MB"
(pytorch/pytorch#109888, NVIDIA's ptrblck). The kernels a step loads on first use (cuBLAS's, attention's) add to it
and are not counted: a cell on a GPU measures the whole.

An upper bound for a communicator that is not a node's ranks: its channels are the node's ring channels (24 on an
8-GPU NVSwitch node), where NCCL's search across nodes with one or two ranks a node finds its channels by the NICs
(fewer, on most systems); and a default group that only runs a barrier is counted its ring and setup (under
``NCCL_RUNTIME_CONNECT`` the barrier's small all_reduce connects the algorithm NCCL picks for it, on all channels).

Not modelled: NCCL's host-side state (the work FIFO, 1 MiB, is pinned host memory); send/recv's per-peer buffers (no
strategy here sends point to point); across nodes the network transport's buffers (``net.cc``: about 8.7 MiB a send
and 9.2 MiB a receive connection with GPUDirect RDMA, in host memory without it) are counted as NVLink's; NCCL before
2.23 (NVLS took 1.1 to 2.3 GiB an 8-GPU node in 2.20 and 2.21).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

__all__ = ["NcclSettings", "NcclTopology", "Communicator", "connection_bytes", "communicator_bytes",
           "communicators", "nccl_bytes", "group_placement", "CUDA_CONTEXT_BYTES", "context_bytes", "NCCL_ENV"]

MiB = 1 << 20
#: [NCCL-BUF] the three protocols' buffer bytes a connection carries by default
LL_BUFFSIZE = 8 * 512 * 8 * 16
LL128_BUFFSIZE = 120 * 640 * 8 * 8
SIMPLE_BUFFSIZE = 4 * MiB
#: [NCCL-P2P] a connection's control structure (``ncclSendMem`` / ``ncclRecvMem``, ``MEM_ALIGN``) and the rounding of
#: each side's allocation (``CUDA_IPC_MIN``)
CONN_MEM = 4096
CUDA_IPC_MIN = 2 * MiB
#: [NCCL-SETUP] cuMem's allocation granularity, the device arrays ``initChannel`` makes a channel and ``devCommSetup`` a
#: communicator
CUMEM_GRANULARITY = 2 * MiB
CHANNEL_ARRAYS = 3
COMM_ARRAYS = 2
#: [NCCL-NVLS] NVLS channels on compute capability 9.x, the chunk of a channel's buffer, the most ranks it reduces over
NVLS_NCHANNELS_SM90 = 16
NVLS_CHUNKSIZE = 128 * 1024
NCCL_MAX_NVLS_ARITY = 32
#: The collectives NCCL has NVLS algorithms for (all_reduce; reduce_scatter and all_gather since 2.19)
NVLS_OPS = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
#: The NCCL environment variables :class:`NcclSettings` reads (``network.nccl.<key>`` of a planner's network, the env
#: var a job sets: the same value).
NCCL_ENV = {"buffsize": "NCCL_BUFFSIZE", "ll_buffsize": "NCCL_LL_BUFFSIZE", "ll128_buffsize": "NCCL_LL128_BUFFSIZE",
            "max_nchannels": "NCCL_MAX_NCHANNELS", "nvls_enable": "NCCL_NVLS_ENABLE",
            "nvls_nchannels": "NCCL_NVLS_NCHANNELS", "nvls_chunksize": "NCCL_NVLS_CHUNKSIZE"}


#: [CTX] the CUDA context of one process on its GPU, lazy loading
CUDA_CONTEXT_BYTES = 287_047_680


def context_bytes(value: Any = None) -> int:
    """The CUDA context's bytes: ``value`` (a preset's ``context_bytes``, bytes) where given, else
    :data:`CUDA_CONTEXT_BYTES` [CTX]."""
    return CUDA_CONTEXT_BYTES if value is None else int(value)


def _align(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class NcclSettings:
    """NCCL's settings that size its buffers (:data:`NCCL_ENV`; each default NCCL's own, [NCCL-BUF] [NCCL-NVLS]):
    ``max_nchannels`` None keeps the topology's channels; ``nvls_enable`` None: NCCL's auto (where the node has it)."""

    buffsize: int = SIMPLE_BUFFSIZE
    ll_buffsize: int = LL_BUFFSIZE
    ll128_buffsize: int = LL128_BUFFSIZE
    max_nchannels: int | None = None
    nvls_enable: bool | None = None
    nvls_nchannels: int = NVLS_NCHANNELS_SM90
    nvls_chunksize: int = NVLS_CHUNKSIZE

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> NcclSettings:
        """Settings from ``{key: value}`` (keys of :data:`NCCL_ENV`; None: NCCL's default); :class:`ValueError`
        naming a key that is none of them or a value that is no positive integer (``nvls_enable``: a boolean)."""
        out: dict[str, Any] = {}
        for key, value in (values or {}).items():
            if key not in NCCL_ENV:
                raise ValueError(f"{key}: none of {', '.join(NCCL_ENV)}")
            if value is None:
                continue
            if key == "nvls_enable":
                if not isinstance(value, bool):
                    raise ValueError(f"{key}={value!r}: true or false (NCCL_NVLS_ENABLE=1 or 0), or null (auto)")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r}: a positive integer ({NCCL_ENV[key]})")
            out[key] = value
        return replace(cls(), **out)

    def record(self) -> dict[str, Any]:
        """Each setting by its environment variable, as the planner's JSON states what it assumed."""
        return {NCCL_ENV[k]: getattr(self, k) for k in NCCL_ENV}


@dataclass(frozen=True)
class NcclTopology:
    """What NCCL's topology search finds on the machine (a network preset's ``nccl`` node): ``channels``, the ring
    channels of a communicator within a node [NCCL-RING]; ``p2p_channels``, its send/recv channels [NCCL-SETUP];
    ``nvls``, NVSwitch with multicast (NVLink SHARP) [NCCL-NVLS]; ``p2p_read``, NVLink P2P read (compute capability
    8.0) [NCCL-P2P]; ``ranks_per_node``."""

    ranks_per_node: int
    channels: int
    p2p_channels: int = 0
    nvls: bool = False
    p2p_read: bool = False


@dataclass(frozen=True)
class Communicator:
    """A process group's NCCL communicator as a rank sees it: its ``name`` (``world``, a mesh dimension, DeepSpeed's
    clone of the world), ``size`` ranks, ``per_node`` of them on this rank's node, over ``nodes`` nodes, and the
    collectives it runs (``ops``)."""

    name: str
    size: int
    per_node: int
    nodes: int
    ops: frozenset[str] = field(default_factory=frozenset)


def connection_bytes(settings: NcclSettings, p2p_read: bool = False) -> tuple[int, int]:
    """The (send, recv) bytes one channel's connection takes on NVLink [NCCL-P2P]: each side's structure and its
    protocols' buffers, rounded up to 2 MiB."""
    protocols = settings.ll_buffsize + settings.ll128_buffsize + settings.buffsize
    send = CONN_MEM + (settings.buffsize if p2p_read else 0)
    recv = CONN_MEM + protocols - (settings.buffsize if p2p_read else 0)
    return _align(send, CUDA_IPC_MIN), _align(recv, CUDA_IPC_MIN)


def communicator_bytes(comm: Communicator, topology: NcclTopology, settings: NcclSettings) -> dict[str, int]:
    """The bytes one rank's share of ``comm`` takes on the device: ``setup`` (its channels' structures
    [NCCL-SETUP]) and by algorithm ``ring`` (every communicator of two
    ranks or more: one send and one receive connection a channel), ``tree`` (across nodes, where it all-reduces),
    ``nvls`` (NVLink SHARP where the node has it, enabled, more than 2 of the communicator's ranks share the node and
    it runs a collective NVLS has an algorithm for, :data:`NVLS_OPS`);
    nothing for a communicator of one rank [TORCH-PG]."""
    if comm.size <= 1:
        return {"setup": 0, "ring": 0, "tree": 0, "nvls": 0}
    channels = topology.channels if settings.max_nchannels is None else min(topology.channels, settings.max_nchannels)
    send, recv = connection_bytes(settings, topology.p2p_read)
    ring = channels * (send + recv)
    tree = ring if comm.nodes > 1 and "all_reduce" in comm.ops else 0
    nvls_on = topology.nvls if settings.nvls_enable is None else settings.nvls_enable and topology.nvls
    heads = min(comm.per_node, NCCL_MAX_NVLS_ARITY)
    reduces = bool(comm.ops & NVLS_OPS)  # a barrier alone (the world's, under DeepSpeed) is one small ring call
    nvls = (heads * settings.nvls_nchannels * 2 * 8 * settings.nvls_chunksize
            if nvls_on and reduces and comm.per_node > 2 else 0)
    setup = (CHANNEL_ARRAYS * max(channels, topology.p2p_channels) + COMM_ARRAYS
             + (settings.nvls_nchannels if nvls else 0)) * CUMEM_GRANULARITY
    return {"setup": setup, "ring": ring, "tree": tree, "nvls": nvls}


def group_placement(dim: str, size: int, world_size: int, ranks_per_node: int) -> tuple[int, int]:
    """(ranks on a node, nodes) of a process group of ``size`` ranks of an N-rank job placed ``ranks_per_node`` a
    node, rank r on node r // ranks_per_node: the world and a shard group of hybrid sharding (consecutive ranks) fill
    nodes; a replicate group (one rank of each shard group, the mesh's outer dimension ``replicate``) holds
    ``g // (N / size)`` ranks a node where shard groups are smaller than a node, else one a node."""
    g, n = ranks_per_node, world_size
    if dim == "replicate" and size < n:
        per_node = max(1, min(size, g // max(n // size, 1)))
    else:
        per_node = min(size, g)
    return per_node, -(-size // per_node)


def communicators(collectives: Mapping[str, Mapping[str, Any]], world_size: int, ranks_per_node: int,
                  clones_world: bool = False) -> list[Communicator]:
    """The communicators a rank of a row holds: the default group's (``world``; torch's first barrier makes it, and
    a model naming no groups runs every call on it), each process group its collectives name (``groups`` of a
    collectives model: a mesh dimension and its size), and where the strategy runs its collectives on a copy of the
    world (``clones_world``: DeepSpeed's ``groups._clone_world_group``) that copy, with the world's ops."""
    ops: dict[tuple[str, int], set[str]] = {("world", world_size): set()}
    for op, entry in collectives.items():
        for dim, g in (entry.get("groups") or {"world": {"size": world_size}}).items():
            ops.setdefault((dim, int(g["size"])), set()).add(op)
    if clones_world:
        ops[("deepspeed_world", world_size)] = set(ops[("world", world_size)])
        ops[("world", world_size)] = set()
    out = []
    for (name, size), used in ops.items():
        per_node, nodes = group_placement(name, size, world_size, ranks_per_node)
        out.append(Communicator(name, size, per_node, nodes, frozenset(used)))
    return out


def nccl_bytes(comms: Iterable[Communicator], topology: NcclTopology, settings: NcclSettings) -> dict[str, Any]:
    """A rank's NCCL bytes over its communicators: ``total_bytes``, ``by_communicator`` (each one's name, size,
    ranks on the node, nodes and bytes by algorithm) and the ``settings`` assumed."""
    rows = []
    for comm in comms:
        parts = communicator_bytes(comm, topology, settings)
        rows.append({"name": comm.name, "size": comm.size, "per_node": comm.per_node, "nodes": comm.nodes,
                     "ops": sorted(comm.ops), **{f"{k}_bytes": v for k, v in parts.items()},
                     "bytes": sum(parts.values())})
    return {"total_bytes": sum(r["bytes"] for r in rows), "by_communicator": rows, "settings": settings.record()}
