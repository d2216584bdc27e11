"""The cluster the planner prices: GPUs, nodes, and two link classes (inside / across nodes).

Link model (alpha-beta, per GPU):
- inside a node every GPU pair talks over NVLink at `intra.bandwidth_gbps` per direction;
- across nodes each GPU owns one NIC (rail-optimised fabric, as in DGX A100/H100 pods), so a
  pair of GPUs on different nodes gets `inter.bandwidth_gbps`, and a collective whose group
  has k ranks on each node drives k NICs per node at once.

Collectives are priced with the ring formulas of NCCL's performance notes (nccl-tests
doc/PERFORMANCE.md, "bus bandwidth"): an all-reduce of S bytes over n ranks moves
2(n-1)/n * S per rank, an all-gather or reduce-scatter (n-1)/n * S, at the group's bus bandwidth:
the intra-node bandwidth if the group sits inside a node, else min(intra, k * inter) with k the
group's ranks per node (the ring crosses each node boundary once per channel, one channel per
NIC). Latency: 2*ceil(log2 n) steps for an all-reduce, ceil(log2 n) for AG/RS, since NCCL
switches to trees where rings would be latency-bound (large DP groups).

Defaults (fractions of the datasheet peaks in `gpus.py`): NVLink 80% (nccl-tests all-reduce bus
bandwidth on DGX A100 reaches ~230-240 of 300 GB/s), NIC 90% of line rate, latency 5 us per
step inside a node and 10 us across (NCCL LL/Simple protocol ballpark). A `commpipe probe` JSON
or a calibrated profile replaces them with measured values.

Other clusters (all optional, defaults as above):
- `nics_per_node`: scale-out NICs per node when fewer than GPUs (the emulated cluster of
  `commpipe sweep` has one per node). They carry at once every group of a dimension crossing
  from the node (gpus_per_node / k groups of k ranks there), so a group with k ranks per node
  gets nics_per_node * k / gpus_per_node links, at most k (`Cluster.node_links`): tp2 x dp2 on
  nodes of 2 runs two DP groups through each node's one link, each at half its rate; the MoE
  all-to-alls (moe_costs.all_to_all) share them the same way.
- `backend="gloo"`: gloo's all-reduce is a ring (gloo/allreduce.cc: reduce-scatter then
  all-gather around the ring), so it pays 2(n-1) latency steps and all-gather n-1, instead of
  NCCL's logarithmic trees. commpipe's reduce-scatter on gloo is one all-to-all (every chunk
  posted at once) and a local sum (`Comm.reduce_scatter`): one latency step. A probe from gloo
  sets it.
- `node_of`: the node of every rank when ranks do not fill nodes in rank order (a sweep's
  `placement`, e.g. TP across nodes); groups and pipeline links are placed by it.
- `host_cores`: all ranks share one machine with this many cores (CPU training, or the emulated
  cluster); `commpipe.plan.host` then prices the contention of more busy ranks than cores. Not
  always a whole number: what the cores deliver together, in lone ranks' worth
  (`commpipe.plan.cpu.measure_core_capacity`, `plan --host-cores auto`), as two vCPUs that
  share a physical core run less than two ranks' work at once.

Bandwidths are decimal GB/s everywhere (bandwidth_gbps), as in the probe and monitor records.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from commpipe.jsonfile import read_json_object
from commpipe.plan.gpus import GPU

NVLINK_EFFICIENCY = 0.8
NIC_EFFICIENCY = 0.9
INTRA_LATENCY_S = 5e-6
INTER_LATENCY_S = 10e-6
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float   # achievable per-GPU bandwidth, decimal GB/s
    latency_s: float        # per message (p2p) or per algorithm step (collectives)

    def to_dict(self) -> dict:
        return {"bandwidth_gbps": self.bandwidth_gbps, "latency_ms": self.latency_s * 1e3}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    num_gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link
    source: str = "defaults"
    nics_per_node: int | None = None        # None: one NIC per GPU
    backend: str = "nccl"                   # nccl | gloo: latency steps of a collective
    node_of: tuple[int, ...] | None = None  # node of each rank; None: rank // gpus_per_node
    host_cores: float | None = None         # cores shared by all ranks; None: a device per rank

    def __post_init__(self):
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("--gpus and --gpus-per-node must be positive")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is unknown; use one of {BACKENDS}")
        if self.nics_per_node is not None and self.nics_per_node < 1:
            raise ValueError("nics_per_node must be at least 1")
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError("host_cores must be at least 1")
        if self.node_of is not None and len(self.node_of) < self.num_gpus:
            raise ValueError(f"node_of names the node of {len(self.node_of)} ranks; the cluster has "
                             f"{self.num_gpus}: give one node per rank")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.num_gpus} is not a whole number of nodes of "
                             f"{self.gpus_per_node} GPUs; use a multiple of {self.gpus_per_node}")
        for name, link in (("intra-node", self.intra), ("inter-node", self.inter)):
            if link.bandwidth_gbps <= 0 or link.latency_s < 0:
                raise ValueError(f"{name} link needs a positive bandwidth and a non-negative latency")

    @property
    def nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.to_dict(), "num_gpus": self.num_gpus,
                "gpus_per_node": self.gpus_per_node, "intra_node": self.intra.to_dict(),
                "inter_node": self.inter.to_dict(), "source": self.source,
                "nics_per_node": self.nics_per_node, "backend": self.backend,
                "host_cores": self.host_cores}

    # -- where a group sits ---------------------------------------------------------------------
    def node(self, rank: int) -> int:
        return self.node_of[rank] if self.node_of is not None else rank // self.gpus_per_node

    def placement(self, size: int, stride: int) -> tuple[bool, int]:
        """(inside one node?, ranks per node) of the group {0, stride, ..., (size-1)*stride}:
        the group holding rank 0, representative when sizes are powers of two."""
        if size <= 1:
            return True, 1
        if self.node_of is not None:
            nodes = [self.node(i * stride) for i in range(size)]
            return len(set(nodes)) == 1, max(nodes.count(n) for n in set(nodes))
        g = self.gpus_per_node
        per_node = min(size, -(-g // stride))      # members i with i * stride < g
        return (size - 1) * stride < g, max(1, per_node)

    def node_counts(self, size: int, stride: int) -> list[int]:
        """Members of the group {0, stride, ..., (size-1)*stride} on each node it spans (uneven
        when the group does not fill its nodes alike: dp6's EP groups of 3 on nodes of 2)."""
        nodes = [self.node(i * stride) for i in range(size)]
        return [nodes.count(n) for n in sorted(set(nodes))]

    def bus_bandwidth(self, size: int, stride: int) -> tuple[float, Link]:
        """Bus bandwidth (bytes/s) of a group and the link class that limits it."""
        inside, per_node = self.placement(size, stride)
        if inside:
            return self.intra.bandwidth_gbps * 1e9, self.intra
        bw = min(self.intra.bandwidth_gbps, self.node_links(per_node) * self.inter.bandwidth_gbps)
        return bw * 1e9, self.inter

    def node_links(self, per_node: int) -> float:
        """Scale-out links a group with `per_node` members on each node drives across nodes, in
        whole links' worth: one per member with a NIC per GPU (rail-optimised, none shared);
        with `nics_per_node` fewer, the node's NICs carry every group of the dimension crossing
        from it at once (its ranks over the group's members there: groups_on_a_node_link), so
        the group gets nics_per_node * per_node / gpus_per_node of them."""
        if self.nics_per_node is None:
            return float(per_node)
        return min(per_node, self.nics_per_node * per_node / self.gpus_per_node)

    def latency_steps(self, size: int, op: str = "all_reduce") -> int:
        """Latency-bound steps of a collective: NCCL trees ~log2(n), gloo rings n-1 per phase,
        except commpipe's gloo reduce-scatter (one all-to-all round)."""
        if self.backend == "gloo" and op == "reduce_scatter":
            return 1
        per_phase = size - 1 if self.backend == "gloo" else math.ceil(math.log2(size))
        return 2 * per_phase if op == "all_reduce" else per_phase

    # -- prices, seconds ------------------------------------------------------------------------
    def all_reduce(self, nbytes: float, size: int, stride: int) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        bw, link = self.bus_bandwidth(size, stride)
        return 2 * (size - 1) / size * nbytes / bw + self.latency_steps(size) * link.latency_s

    def all_gather(self, nbytes: float, size: int, stride: int, op: str = "all_gather") -> float:
        """All-gather (or reduce-scatter) whose full, gathered tensor has `nbytes`."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        bw, link = self.bus_bandwidth(size, stride)
        return (size - 1) / size * nbytes / bw + self.latency_steps(size, op) * link.latency_s

    def reduce_scatter(self, nbytes: float, size: int, stride: int) -> float:
        """Reduce-scatter of a full tensor of `nbytes`: the all-gather's bytes, its own latency."""
        return self.all_gather(nbytes, size, stride, "reduce_scatter")

    def p2p_link(self, rank_a: int, rank_b: int) -> Link:
        return self.intra if self.node(rank_a) == self.node(rank_b) else self.inter

    def p2p(self, nbytes: float, rank_a: int, rank_b: int) -> float:
        link = self.p2p_link(rank_a, rank_b)
        return link.latency_s + nbytes / (link.bandwidth_gbps * 1e9)


def default_cluster(gpu: GPU, num_gpus: int, gpus_per_node: int) -> Cluster:
    return Cluster(gpu, num_gpus, gpus_per_node,
                   Link(NVLINK_EFFICIENCY * gpu.nvlink_gbps, INTRA_LATENCY_S),
                   Link(NIC_EFFICIENCY * gpu.nic_gbps, INTER_LATENCY_S))


def _link_from(entry: dict, where: str) -> Link:
    try:
        bw = float(entry["bandwidth_gbps"])
        lat = float(entry.get("latency_ms", 0.0)) / 1e3
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where} needs numeric bandwidth_gbps (decimal GB/s) and latency_ms") from None
    if not (math.isfinite(bw) and math.isfinite(lat)) or bw <= 0 or lat < 0:
        raise ValueError(f"{where}: bandwidth_gbps must be a finite positive number and latency_ms "
                         "a finite non-negative one")
    return Link(bw, lat)


def _probe_number(entry: dict, key: str, where: str, what: str, positive: bool) -> float:
    value = entry.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > 0 if positive else value >= 0)
    if not ok:
        shown = "missing" if key not in entry else json.dumps(value)
        raise ValueError(f"{where}.{key} = {shown}: expected a finite "
                         f"{'positive' if positive else 'non-negative'} number ({what}; a JSON number "
                         "beyond ~1e308, e.g. 1e400, reads as infinite)")
    return float(value)


def _probe_link(pairs: dict, key: str, path, default: Link) -> tuple[Link, str]:
    """The measured link of one class, or the default when the probe had no such pair (the key
    absent or null), with a note saying which."""
    entry = pairs.get(key)
    if entry is None:
        return default, (f"{key} not measured, default {default.bandwidth_gbps:g} GB/s and "
                         f"{default.latency_s * 1e3:g} ms used")
    where = f"probe file {path}: pairs.{key}"
    if not isinstance(entry, dict) or not entry:
        raise ValueError(f"{where} = {json.dumps(entry)}: expected an object with bandwidth_gbps "
                         "and latency_ms as `commpipe probe` writes it, or null when the probe "
                         "measured no such pair")
    bw = _probe_number(entry, "bandwidth_gbps", where, "decimal GB/s", positive=True)
    lat = _probe_number(entry, "latency_ms", where, "milliseconds", positive=False)
    return Link(bw, lat / 1e3), f"{key} measured"


def apply_probe(cluster: Cluster, path: str | Path) -> Cluster:
    """Replace link numbers with a `commpipe probe` JSON:
    {"pairs": {"intra_node": {"latency_ms", "bandwidth_gbps"}, "inter_node": {...}},
     "allreduce": [...], "ranks_per_node", "world_size", "backend"}.
    A pair bandwidth is what one GPU pair achieves, which is what `Link` holds. A class that is
    null or absent keeps the default, and the cluster's source says so; anything else that is not
    what the probe writes is an error naming the file and the key."""
    data = read_json_object(path, "probe")
    pairs = data.get("pairs")
    if not isinstance(pairs, dict):
        raise ValueError(f"probe file {path} has no 'pairs' object with intra_node/inter_node entries")
    unknown = sorted(set(pairs) - {"intra_node", "inter_node"})
    if unknown:
        raise ValueError(f"probe file {path}: pairs has {', '.join(unknown)}; the link classes are "
                         "intra_node and inter_node")
    intra, intra_note = _probe_link(pairs, "intra_node", path, cluster.intra)
    inter, inter_note = _probe_link(pairs, "inter_node", path, cluster.inter)
    if intra is cluster.intra and inter is cluster.inter:
        raise ValueError(f"probe file {path} measured no link (pairs.intra_node and pairs.inter_node "
                         "are both null or absent); probe with at least two ranks on one node or "
                         "on two nodes")
    gpn = data.get("ranks_per_node", cluster.gpus_per_node)
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"probe file {path}: ranks_per_node = {json.dumps(gpn)}: expected a "
                         "positive integer (the ranks per node the probe ran with)")
    backend = data.get("backend", cluster.backend)
    if backend not in BACKENDS:
        raise ValueError(f"probe file {path}: backend = {json.dumps(backend)}: expected one of "
                         f"{', '.join(BACKENDS)}")
    return replace(cluster, intra=intra, inter=inter, gpus_per_node=gpn, backend=backend,
                   source=f"probe:{path} ({intra_note}; {inter_note})")


def call_overhead(ops: dict, nbytes: float, cluster: Cluster, size: int = 2) -> float | None:
    """Host time of one gloo collective call (`Efficiency.coll_overhead_s`, seconds) from calls
    timed as training makes them ({op: {"mean_ms", ...}}, `nbytes` each, over a group of `size`
    ranks on `cluster`'s links; commpipe.monitor.probe.calls_after_compute): per op, its mean time
    less what the cluster already prices for it (its latency steps and bytes, gloo's
    algorithms), averaged over the ops measured (all-reduce; all-gather and reduce-scatter, which
    sequence and context parallelism make in equal numbers). None when none was."""
    gloo = replace(cluster, backend="gloo")
    priced = {"all_reduce": gloo.all_reduce(nbytes, size, 1),
              "all_gather": gloo.all_gather(size * nbytes, size, 1),   # every rank's input
              "reduce_scatter": gloo.reduce_scatter(nbytes, size, 1)}
    extra = [max(0.0, ops[op]["mean_ms"] / 1e3 - price) for op, price in priced.items() if op in ops]
    return sum(extra) / len(extra) if extra else None


def probe_call_overhead(path: str | Path, cluster: Cluster) -> float | None:
    """`call_overhead` of a probe's calls after compute (commpipe.monitor.probe; ranks 0 and 1);
    None when the probe has no such measurement (nccl, an odd world, or a probe from before it)."""
    calls = read_json_object(path, "probe").get("calls")
    if not isinstance(calls, dict) or not isinstance(calls.get("ops"), dict):
        return None
    where = f"probe file {path}: calls"
    nbytes = _probe_number(calls, "bytes", where, "bytes per call", positive=True)
    for op, entry in calls["ops"].items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where}.ops.{op} = {json.dumps(entry)}: expected an object with mean_ms")
        _probe_number(entry, "mean_ms", f"{where}.ops.{op}", "milliseconds", positive=True)
    return call_overhead(calls["ops"], nbytes, cluster)


def groups_on_a_node_link(groups, node_of, group) -> int:
    """How many of `groups` (the groups of one dimension whose collectives run at the same time,
    e.g. every DP group of a layout, every pipeline stage's among them) cross nodes through a
    node that `group` crosses from, counted on its busiest node. A node with one scale-out link
    (`nics_per_node` 1: the emulated cluster, one veth per node) carries them together, each at
    its share: two DP groups of tp2 x dp2 across two nodes each get half the link a dp4 ring
    gets whole. 1 when `group` stays inside one node."""
    return _on_a_node_link(groups, node_of, group, lambda g, n: any(node_of(r) == n for r in g))


def ranks_on_a_node_link(groups, node_of, group) -> int:
    """How many ranks send across nodes at once through the busiest node `group` crosses from,
    when every one of `groups` makes an all-to-all together (the EP groups of a layout, every
    pipeline stage's among them, as groups_on_a_node_link counts them): the members there of
    every group crossing nodes, each sending its share for the other nodes through the node's
    one link. 1 when `group` stays inside one node."""
    return _on_a_node_link(groups, node_of, group, lambda g, n: sum(node_of(r) == n for r in g))


def _on_a_node_link(groups, node_of, group, count) -> int:
    """The largest, over the nodes `group` spans, of `count(g, node)` summed over the groups
    crossing nodes; 1 when `group` stays inside one node."""
    nodes = {node_of(r) for r in group}
    if len(nodes) < 2:
        return 1
    crossing = [g for g in groups if len({node_of(r) for r in g}) > 1]
    return max(sum(count(g, n) for g in crossing) for n in nodes)


def apply_links(cluster: Cluster, links: dict, source: str) -> Cluster:
    """Apply {"intra_node": {...}, "inter_node": {...}} (a profile's "links")."""
    intra = _link_from(links["intra_node"], f"{source} intra_node") if "intra_node" in links \
        else cluster.intra
    inter = _link_from(links["inter_node"], f"{source} inter_node") if "inter_node" in links \
        else cluster.inter
    return replace(cluster, intra=intra, inter=inter, source=source)


def override_links(cluster: Cluster, intra_gbps=None, inter_gbps=None, intra_ms=None,
                   inter_ms=None) -> Cluster:
    """Explicit command-line numbers win over defaults, probes and profiles."""
    intra, inter = cluster.intra, cluster.inter
    if intra_gbps is not None:
        intra = replace(intra, bandwidth_gbps=float(intra_gbps))
    if intra_ms is not None:
        intra = replace(intra, latency_s=float(intra_ms) / 1e3)
    if inter_gbps is not None:
        inter = replace(inter, bandwidth_gbps=float(inter_gbps))
    if inter_ms is not None:
        inter = replace(inter, latency_s=float(inter_ms) / 1e3)
    if (intra, inter) == (cluster.intra, cluster.inter):
        return cluster
    return replace(cluster, intra=intra, inter=inter, source=cluster.source + "+flags")


def read_json(path: str | Path, what: str) -> dict:
    return read_json_object(path, what)
