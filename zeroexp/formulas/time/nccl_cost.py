"""NCCL's own cost model of a collective: the time NCCL predicts for one call and the algorithm and protocol it picks.

NCCL times every (algorithm, protocol) of a call as ``latency x pipelined ops + bytes / bandwidth`` and runs the one
of least time. Every constant here is NCCL's, NVIDIA/nccl 2.30.7 (``makefiles/version.mk``; mirror commit 5067397c):

[TUNE] src/graph/tuning.cc ``ncclTopoTuneModel``: per (collective, algorithm, protocol) a latency in us
(``baseLatencies`` + the link's ``hwLatencies`` x the steps on it) and a bandwidth in GB/s (the topology graph's
``nChannels`` x its per-channel bandwidth, refined per protocol: LL half of it up to ``llMaxBws``, LL128 0.92 of it
up to ``perChMaxRingLL128Bws``, the tree 0.92 up to ``perChMaxTreeBws``, NVLS by ``nvlsEfficiency``), then turned
from bus into algorithm bandwidth (ring and NVLS: x nRanks / nsteps; tree: x 0.5).
[TIME] src/graph/tuning.cc ``ncclTopoGetAlgoTime``: ``time = lat x latCount + nBytes / (1000 x bw)`` (us), the tree's
``treeCorrectionFactor`` by message size, the multi-node ring's plateau (Simple latency x 1.4 from compute capability
8.0); src/enqueue.cc ``topoGetAlgoInfo``: the least time wins, first in NCCL's order on a tie (tree, ring, NVLS,
NVLS tree, PAT; LL, LL128, Simple); ``updateCollCostTable``: NVLS needs NVLS support, NVLS alone (not NVLS tree)
needs one node without CollNet. nBytes is ``ncclFuncMaxSendRecvCount`` (src/include/enqueue.h): all_gather's output,
reduce_scatter's input, the buffer otherwise, zeroexp's S (:func:`~zeroexp.formulas.paper.bus_factor`).
[SEARCH] src/graph/search.cc ``ncclTopoCompute``: the graph's per-channel bandwidth is a speed of
``speedArrayIntra`` / ``sm90SpeedArrayIntra`` (one node) or the ``Inter`` arrays (across nodes) at which the search
fits channels; it keeps the graph of most channels x bandwidth, trying slower speeds while above 0.49 of the best's;
``ncclTopoDupChannels`` doubles a fast graph's channels at half the bandwidth; pass 2 raises a ring's speed while its
channels still fit. src/graph/topo.h: a GPU's NVLink bandwidth is its links x ``SMxx_NVLINK_BW``.
[CONNECT] src/graph/connect.cc ``ncclTopoPostset``: the communicator runs twice the ring graph's channels
(``nChannels * 2``), what the ring's plateau rule divides by.

Modelled as NCCL's search would find it, not traced: each rank its own NIC (the presets' "one NIC per GPU"); the
tree graph is the ring graph (init.cc searches it at the ring's channels); the NVLS graph one channel per rank on the
node (search.cc: ``maxChannels`` = the node's GPUs, all of them within a node); a balanced tree (no 0.85 for
``NCCL_TOPO_PATTERN_TREE``); rings on the same channels (``sameChannels``); the network's ``latencyInter`` 0 (NCCL's
IB transport reports none); no CollNet (SHARP) and no tuner plugin; a call alone (``numPipeOps`` 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NcclTopo", "NcclChoice", "Graph", "nccl_call", "nccl_seconds", "ring_graph", "nvls_graph",
           "algo_bandwidth", "algo_latency", "algo_time", "communicator_channels", "NCCL_OPS", "NCCL_VERSION",
           "NVLINK_GBPS"]

#: The NCCL whose model this is (makefiles/version.mk of the mirror's commit 5067397c).
NCCL_VERSION = "2.30.7"
#: The collectives NCCL's tuning models (ncclFunc_t; send/recv and all_to_all are not tuned by it: p2p).
NCCL_OPS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")
ALGOS = ("tree", "ring", "nvls", "nvls_tree", "pat")  # NCCL's order: ties go to the first (enqueue.cc)
PROTOS = ("LL", "LL128", "Simple")

#: [TUNE] ``baseLatencies`` (us) by algorithm, (LL, LL128, Simple)
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0),
            "nvls_tree": (0.0, 0.0, 0.0), "pat": (8.0, 8.0, 8.0)}
#: [TUNE] ``hwLatencies`` (us) by link (NVLINK, PCI, NET) and algorithm, (LL, LL128, Simple)
HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
               "nvls_tree": (0.0, 0.0, 25.0), "pat": (0.0, 0.0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0),
            "nvls_tree": (0.0, 0.0, 0.0), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
            "nvls_tree": (0.0, 0.0, 20.9), "pat": (0.0, 0.0, 14.0)},
}
#: [TUNE] ``llMaxBws`` (GB/s): rows Volta / Ampere / Hopper / Blackwell on one node (by the GPU), Intel / AMD across
#: nodes (by the CPU); columns 1, 2, more than 2 nodes
LL_MAX_BWS = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (141.0, 45.0, 35.0), (282.0, 90.0, 70.0))
#: [TUNE] per-channel caps (GB/s) by architecture (Volta, Ampere, Hopper, Blackwell) and 1, 2, more than 2 nodes
PER_CH_MAX_RING_LL128 = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 36.7), (40.0, 40.0, 40.0))
PER_CH_MAX_TREE_LL128 = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0), (55.6, 31.67, 20.0))
PER_CH_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0), (70.0, 42.8, 24.0))
PER_CH_MAX_NVLS_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (0.0, 57.7, 45.5), (0.0, 96.0, 80.0))
#: [TUNE] ``nvlsEfficiency`` by architecture
NVLS_EFFICIENCY = (0.0, 0.0, 0.85, 0.74)
#: [TIME] ``treeCorrectionFactor`` by protocol, at log2(nBytes / 64) = 0..23
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
#: [SEARCH] src/graph/topo.h: one NVLink's bandwidth (GB/s) by compute capability (x10), the first at or below it
NVLINK_GBPS = ((100, 40.1), (90, 20.6), (86, 12.0), (80, 20.0), (70, 20.0), (60, 18.0))
#: [SEARCH] the speeds (GB/s a channel) the search tries, one node / across nodes, by architecture
SPEEDS_INTRA = {0: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
                90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
                100: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0)}
SPEEDS_INTER = {0: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.4, 1.2,
                    0.24, 0.12),
                90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0, 2.4, 1.2, 0.24,
                     0.12),
                100: (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0,
                      2.4, 1.2, 0.24, 0.12)}
#: [SEARCH] a ring graph's most channels (``MAXCHANNELS / 2``, src/include/device.h MAXCHANNELS 64)
MAX_RING_CHANNELS = 32
#: [SEARCH] src/graph/topo.h ``PCI_BW``: a PCIe Gen3 x16 link (GB/s), a GPU's bandwidth without NVLink
PCI_GBPS = 12.0
#: [TUNE] ``getNetOverhead`` (us a network step) by CPU vendor
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}


@dataclass(frozen=True)
class NcclTopo:
    """What NCCL's topology detection sees on a node: ``compute_capability`` x10 (90: Hopper), ``nvlink_GBps`` a GPU's
    NVLink bandwidth as NCCL counts it (links x ``SMxx_NVLINK_BW``, :func:`nvlink_of`; 0: PCIe only), ``nic_GBps`` each
    rank's NIC, ``nvls`` NVSwitch multicast usable (NVLS), ``cpu`` the host's vendor (``intel`` | ``amd``: the LL
    cap and network overhead across nodes [TUNE]), ``max_channels`` ``NCCL_MAX_NCHANNELS`` (None: NCCL's)."""

    compute_capability: int
    nvlink_GBps: float
    nic_GBps: float
    nvls: bool = False
    cpu: str = "intel"
    max_channels: int | None = None

    @property
    def arch(self) -> int:
        """[TUNE] ``compCapIndex``: 0 Volta, 1 Ampere, 2 Hopper, 3 Blackwell."""
        cc = self.compute_capability
        return 3 if cc >= 100 else 2 if cc >= 90 else 1 if cc >= 80 else 0


@dataclass(frozen=True)
class Graph:
    """A topology graph as NCCL's search leaves it [SEARCH]: ``channels`` at ``bw_intra`` / ``bw_inter`` GB/s each."""

    channels: int
    bw_intra: float
    bw_inter: float


@dataclass(frozen=True)
class NcclChoice:
    """One call as NCCL would run it: ``seconds``, ``algo`` (tree | ring | nvls | nvls_tree | pat), ``proto`` (LL |
    LL128 | Simple), the ``latency_us`` and algorithm bandwidth ``bandwidth_GBps`` it was timed by [TIME]."""

    seconds: float
    algo: str
    proto: str
    latency_us: float
    bandwidth_GBps: float


def nvlink_of(compute_capability: int, links: int) -> float:
    """A GPU's NVLink bandwidth in NCCL's units (GB/s): ``links`` x ``SMxx_NVLINK_BW`` [SEARCH] (src/graph/topo.h)."""
    return links * next(bw for cc, bw in NVLINK_GBPS if compute_capability >= cc) if links else 0.0


def _speeds(cc: int, across: bool) -> tuple[float, ...]:
    """[SEARCH] the speed array ``ncclTopoCompute`` walks for compute capability ``cc`` (x10)."""
    table = SPEEDS_INTER if across else SPEEDS_INTRA
    return table[100 if cc >= 100 else 90 if cc >= 90 else 0]


def _fit(speeds: tuple[float, ...], fits, max_bw: float, most: int) -> tuple[int, float]:
    """[SEARCH] pass 1: from the first speed at most ``max_bw`` down while above 0.49 of the best's, the graph of most
    channels x speed (``fits(speed)`` channels, at most ``most``; the first on a tie, ``ncclTopoCompareGraphs``)."""
    best = (0, 0.0)
    for s in (s for s in speeds if s <= max_bw):
        if best[0] and s / best[1] <= 0.49:
            break
        c = min(fits(s), most)
        if c * s > best[0] * best[1]:
            best = (c, s)
    return best


def _dup(cc: int, channels: int, bw: float) -> tuple[int, float]:
    """[SEARCH] ``ncclTopoDupChannels``: twice the channels at half the bandwidth where it is 25 GB/s or more (on
    compute capability above 8.0 not below 50 GB/s with more than 4 channels)."""
    if bw < 25.0 or (cc > 80 and bw < 50.0 and channels > 4):
        return channels, bw
    dup = min(2 * channels, MAX_RING_CHANNELS)
    return dup, bw / math.ceil(dup / channels)


def ring_graph(topo: NcclTopo, per_node: int, nodes: int) -> Graph:
    """The ring graph [SEARCH] of ``nodes`` x ``per_node`` ranks: within a node each channel takes its speed on every
    GPU's NVLink; across nodes also on one NIC (each rank its own, ``crossNic`` 0), then duplicated and raised
    (pass 2) as ``ncclTopoCompute`` does. The tree's graph is taken as this one (init.cc searches it at its
    channels)."""
    across = nodes > 1
    speeds = _speeds(topo.compute_capability, across)

    link = topo.nvlink_GBps or PCI_GBPS

    def fits(s: float) -> int:
        nvl = int(link // s) if per_node > 1 else MAX_RING_CHANNELS
        return min(nvl, per_node * int(topo.nic_GBps // s)) if across else nvl

    max_bw = topo.nic_GBps if across else link
    channels, bw = _fit(speeds, fits, max_bw, MAX_RING_CHANNELS)
    if channels == 0:  # search.cc: no path found, "falling back to simple order" at 0.1 GB/s
        return Graph(1, 0.1, 0.1)
    channels, bw = _dup(topo.compute_capability, channels, bw)
    for s in sorted(x for x in speeds if bw < x <= max_bw):  # pass 2: raise the ring's speed at its channels
        if fits(s) < channels:
            break
        bw = s
    return Graph(channels, bw, bw)


def nvls_graph(topo: NcclTopo, per_node: int, nodes: int) -> Graph:
    """The NVLS graph [SEARCH]: one channel a GPU of the node (``maxChannels``, all of them within a node), at the
    fastest intra speed whose channels fit the NVLink bandwidth x n / (n - 1) (``totalBw`` of a pattern other than
    the ring); across nodes the inter speed fitting the node's NICs too."""
    channels = min(per_node, 32)  # NCCL_MAX_NVLS_ARITY
    total = topo.nvlink_GBps * per_node / max(per_node - 1, 1)
    intra = next((s for s in _speeds(topo.compute_capability, False) if s * channels <= total and s <= total), 0.0)
    if nodes <= 1:
        return Graph(channels, intra, intra)
    inter = next((s for s in _speeds(topo.compute_capability, True)
                  if s <= topo.nic_GBps and s * channels <= min(total, per_node * topo.nic_GBps)), 0.0)
    return Graph(channels, intra, inter)


def _nvls_on(topo: NcclTopo, op: str, per_node: int) -> bool:
    """NVLS support: multicast on compute capability 9.0 or later (src/transport/nvls.cc), more than 2 ranks on the
    node (the rule zeroexp.formulas.device_memory counts NVLS buffers by), and an op it has kernels for."""
    return topo.nvls and topo.compute_capability >= 90 and per_node > 2 and op in (
        "all_reduce", "all_gather", "reduce_scatter")


def _usable(op: str, algo: str, proto: str, topo: NcclTopo, per_node: int, nodes: int) -> bool:
    """Which (algorithm, protocol) NCCL times for ``op`` [TUNE] [TIME]: broadcast and reduce only on the ring;
    all_gather and reduce_scatter on ring, NVLS (one node) and PAT (one rank a node, Simple); all_reduce on ring,
    tree, NVLS (one node) and NVLS tree (across nodes); NVLS Simple only; LL128 only over NVLink."""
    if proto == "LL128" and not topo.nvlink_GBps:
        return False
    if algo in ("nvls", "nvls_tree"):
        single = algo == "nvls"
        return (proto == "Simple" and _nvls_on(topo, op, per_node) and single == (nodes == 1)
                and (single or op == "all_reduce"))
    if algo == "pat":
        return proto == "Simple" and op in ("all_gather", "reduce_scatter") and per_node == 1 and nodes > 1
    if algo == "tree":
        return op == "all_reduce"
    return True


def _steps(op: str, n: int) -> int:
    """[TUNE] ``nsteps``: all_reduce 2(n - 1), all_gather and reduce_scatter n - 1, broadcast and reduce n."""
    return 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n


def algo_bandwidth(op: str, algo: str, proto: str, topo: NcclTopo, per_node: int, nodes: int) -> float:
    """NCCL's algorithm bandwidth (GB/s) of ``op`` by ``algo`` / ``proto`` on ``nodes`` x ``per_node`` ranks [TUNE]:
    the graph's channels x its per-channel bandwidth, the protocol's refinements, bus to algorithm bandwidth; 0 where
    NCCL does not run it."""
    if not _usable(op, algo, proto, topo, per_node, nodes):
        return 0.0
    n, a, col = per_node * nodes, topo.arch, min(nodes, 3) - 1
    nvls = algo in ("nvls", "nvls_tree")
    g = nvls_graph(topo, per_node, nodes) if nvls else ring_graph(topo, per_node, nodes)
    bw = g.bw_intra if nodes <= 2 else g.bw_inter
    if nvls:
        bw = _nvls_channel_bw(op, algo, g, a, per_node, nodes)
    bus = g.channels * bw
    ll_cap = LL_MAX_BWS[a if nodes == 1 else int(topo.cpu == "amd")][col]
    if algo == "ring" and proto == "LL":
        bus = min(ll_cap, bus * 0.5)
    if algo == "ring" and proto == "LL128":
        bus = min(bus * 0.92, g.channels * PER_CH_MAX_RING_LL128[a][col])
    if algo == "tree":
        bus = min(bus * 0.92, g.channels * PER_CH_MAX_TREE[a][col])
        if proto == "LL":
            bus = min(bus / 3.8, ll_cap)
        if proto == "LL128":
            bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0), g.channels * PER_CH_MAX_TREE_LL128[a][col])
    if algo == "pat":
        bus *= 0.75
    if algo != "ring" and op in ("all_gather", "reduce_scatter"):
        return bus
    return bus * (n / _steps(op, n) if algo in ("ring", "nvls", "nvls_tree") else 0.5)


def _nvls_channel_bw(op: str, algo: str, g: Graph, arch: int, per_node: int, nodes: int) -> float:
    """[TUNE] an NVLS channel's bus bandwidth: the graph's intra bandwidth x ``nvlsEfficiency`` x (channels - 1) /
    channels, x 2 for all_reduce (two operations pipelined) else x (ppn - 1) / ppn, capped by the inter bandwidth
    (x 2 for NVLS tree on 2 nodes) and NVLS tree's ``perChMaxNVLSTreeBws``."""
    if g.channels < 2:
        return 0.0
    intra = g.bw_intra * NVLS_EFFICIENCY[arch] * (g.channels - 1) / g.channels
    intra *= 2.0 if op == "all_reduce" else (per_node - 1) / per_node
    inter = g.bw_inter * (2 if nodes <= 2 and algo == "nvls_tree" else 1)
    cap = PER_CH_MAX_NVLS_TREE[arch][min(nodes, 3) - 1] if algo == "nvls_tree" else math.inf
    return min(intra, inter, cap)


def algo_latency(op: str, algo: str, proto: str, topo: NcclTopo, per_node: int, nodes: int) -> float:
    """NCCL's latency (us) of one call [TUNE]: ``baseLatencies`` plus, for the ring, the intra link's latency on each
    step within a node (at least the network's post overhead across nodes) and the network's on each step across;
    for the tree, twice the chain within the node and log2(nodes) network hops; NVLS the NVLink's (plus the network's
    across nodes); PAT log2(nodes) x the network's / 3.5 + 2.8 a rank."""
    p = PROTOS.index(proto)
    n, hw = per_node * nodes, "nvlink" if topo.nvlink_GBps else "pci"
    intra = HW_LAT[hw][algo][p]
    inter = HW_LAT["net"]["tree" if per_node == 1 else algo][p]  # ppn 1: the tree's network latency, fully exposed
    base, steps = BASE_LAT[algo][p], _steps(op, n)
    if algo == "ring":
        if op in ("broadcast", "reduce"):  # the same channels: one link latency
            return base + HW_LAT[hw if nodes == 1 else "net"][algo][p]
        overhead = NET_OVERHEAD_US.get(topo.cpu, 1.0) * (3 if proto == "Simple" else 1) if nodes > 1 else 0.0
        across = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
        return base + (steps - across) * max(intra, overhead) + across * inter
    if algo == "tree":
        return base + 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)
    if algo == "nvls":
        return intra + (inter if nodes > 1 else 0.0)
    if algo == "nvls_tree":
        return base + intra + 2 * _log2i(nodes) * inter
    return base + _log2i(nodes) * inter / 3.5 + n * 2.8


def _log2i(n: int) -> int:
    """src/include/utils.h ``log2i``: floor(log2(n)), -1 for n < 1."""
    return n.bit_length() - 1 if n > 0 else -1


def algo_time(op: str, algo: str, proto: str, nbytes: float, topo: NcclTopo, per_node: int, nodes: int
              ) -> NcclChoice | None:
    """One call of ``nbytes`` (S) by ``algo`` / ``proto`` as ``ncclTopoGetAlgoTime`` times it [TIME]; None where NCCL
    does not run it."""
    bw = algo_bandwidth(op, algo, proto, topo, per_node, nodes)
    if bw <= 0:
        return None
    lat = algo_latency(op, algo, proto, topo, per_node, nodes)
    log_size = _log2i(int(nbytes) >> 6)
    if algo == "tree" and op == "all_reduce" and 0 <= log_size < 23:
        bw *= TREE_CORRECTION[proto][log_size]
    comm_channels = communicator_channels(topo, per_node, nodes)
    if (algo == "ring" and proto == "Simple" and nodes > 1 and op == "all_reduce"
            and nbytes / (comm_channels * per_node * nodes) >= 64):
        lat *= 1.9 if topo.compute_capability < 80 else 1.4
    return NcclChoice((lat + nbytes / (1000.0 * bw)) * 1e-6, algo, proto, lat, bw)


def communicator_channels(topo: NcclTopo, per_node: int, nodes: int) -> int:
    """[CONNECT] the communicator's channels: twice the ring graph's, capped by ``NCCL_MAX_NCHANNELS`` (which caps
    only these: the tuning's bandwidth keeps the graph's channels)."""
    channels = 2 * ring_graph(topo, per_node, nodes).channels
    return channels if topo.max_channels is None else max(1, min(channels, topo.max_channels))


def nccl_call(op: str, nbytes: float, topo: NcclTopo, per_node: int, nodes: int) -> NcclChoice | None:
    """The (algorithm, protocol) of least time for one call of ``op`` on ``nbytes`` (S) over ``nodes`` x
    ``per_node`` ranks, as ``topoGetAlgoInfo`` picks it [TIME]; None on one rank (no call)."""
    if op not in NCCL_OPS:
        raise ValueError(f"{op}: NCCL's tuning models {', '.join(NCCL_OPS)}")
    if per_node * nodes <= 1:
        return None
    best = None
    for algo in ALGOS:
        for proto in PROTOS:
            c = algo_time(op, algo, proto, nbytes, topo, per_node, nodes)
            if c is not None and (best is None or c.seconds < best.seconds):
                best = c
    return best


def nccl_seconds(op: str, payload_bytes: float, per_node: int, nodes: int, topo: NcclTopo, calls: float = 1) -> float:
    """``calls`` calls of ``payload_bytes / calls`` each (S summed over the calls), each timed as NCCL picks it
    (:func:`nccl_call`); 0 on one rank or for no call [TIME]."""
    if calls <= 0 or per_node * nodes <= 1:
        return 0.0
    one = nccl_call(op, payload_bytes / calls, topo, per_node, nodes)
    return calls * one.seconds if one is not None else 0.0
