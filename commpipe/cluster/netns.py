"""An emulated multi-node cluster on one Linux host: one network namespace per node.

    with EmulatedCluster(nodes=4, ranks_per_node=2, inter_node_mbit=200) as cluster:
        proc = cluster.popen(0, ["python", "-c", "print('hello from node 0')"])
        cluster.set_rate(1, 50)          # degrade node 1's link while a job runs

Topology: N namespaces `<prefix>n<i>`, each with a veth pair whose namespace end is renamed
`eth0` (address 10.77.0.<i+1>/24) and whose host end `<prefix>h<i>` is enslaved to a Linux
bridge `<prefix>br` in the root namespace. The root namespace gets no address on the bridge, so
several clusters (different prefixes) may reuse the subnet without routing conflicts.

Throttling: a node's link is its NIC. A `tbf` qdisc on the namespace's `eth0` shapes what the
node sends, and one on the host end of the veth shapes what it receives, both at the node's rate,
so a transfer between nodes a and b runs at min(rate_a, rate_b) in either direction.

Intra-node traffic: gloo (with GLOO_SOCKET_IFNAME=eth0) addresses every peer by its eth0
address, including peers on the same node; the kernel delivers packets for a local address over
the loopback device, so same-node pairs never cross the veth and the node's link rate does not
throttle them (a test checks the veth byte counters). `set_intra_rate(node, mbit)` shapes them
instead: a `tbf` qdisc on the namespace's own `lo` (with lo's MTU set to 1500 while it is
shaped, so every packet fits the small bucket below). Loopback has one queue for both
directions, so two ranks sending to each other at once share the rate: the node's internal
link is half duplex, unlike the full-duplex veth between nodes. Namespaces share the host's
CPUs and memory: only the network is emulated, not compute.

Needs root and iproute2 (`ip`, `tc`); `available()` says why not otherwise, and callers fall
back to one host on loopback. Everything created is removed by `teardown()`, which also runs on
exit, on an exception and on SIGINT/SIGTERM; `cleanup_stale(prefix)` removes leftovers of a
run that was killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

NS_IFNAME = "eth0"           # the node's network interface inside its namespace
MAX_IFNAME = 15              # Linux IFNAMSIZ - 1
DEFAULT_SUBNET = "10.77.0"   # a /24 from the private 10/8 range, seldom used by real networks
LO_MTU = 65536               # Linux's loopback MTU, restored when a node's loopback is unshaped

_LIVE: dict[str, EmulatedCluster] = {}     # prefix -> cluster, for the exit and signal hooks
_HOOKS_INSTALLED = False
_PREV_HANDLERS: dict[int, object] = {}


def _run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be built here, else (False, reason)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root (run as root or use --cluster local)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed; install iproute2 or use --cluster local"
    probe = f"cpprobe{os.getpid() % 100000}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def tbf_params(mbit: float) -> dict[str, str]:
    """tbf arguments for a rate in Mbit/s.

    burst: 250 us of traffic, at least two full 1514-byte frames (tbf splits larger GSO packets
    into frames itself). A bucket this small makes every message pay its serialization time, as
    on a real link: measured on a 50 Mbit/s link, an 8 KiB message takes 0.9 ms (1.3 ms on the
    wire) with this bucket, but 0.04 ms with a 16 KiB one, which would hide a slow link behind
    small pipeline and TP messages. 250 us still lets 1 Gbit/s be reached (0.95 measured);
    beyond a few Gbit/s the host's CPU, not the qdisc, sets the pace.
    latency: how long a packet may wait in the queue; enough to hold 256 KiB beyond the bucket
    (a few TCP windows), at least 50 ms, so TCP sees shaping rather than tail drops.
    """
    if not mbit or mbit <= 0:
        raise ValueError(f"link rate {mbit!r} Mbit/s must be positive (None means unthrottled)")
    bytes_per_s = mbit * 1e6 / 8
    burst = max(2 * 1514, int(bytes_per_s * 250e-6))
    latency_ms = max(50.0, 256 * 1024 / bytes_per_s * 1000)
    return {"rate": f"{mbit:g}mbit", "burst": str(burst), "latency": f"{latency_ms:.0f}ms"}


def _state_file(prefix: str) -> Path:
    return Path("/run" if os.access("/run", os.W_OK) else "/tmp") / f"commpipe-cluster-{prefix}.json"


class EmulatedCluster:
    """N namespaces on a bridge, optionally throttled; a context manager that cleans up."""

    def __init__(self, nodes: int, ranks_per_node: int = 1, inter_node_mbit=None, prefix: str = "cpn",
                 subnet: str = DEFAULT_SUBNET, keep: bool = False):
        if nodes < 1 or nodes > 250:
            raise ValueError(f"nodes={nodes} must be between 1 and 250 (one /24 subnet)")
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node} must be positive")
        if not prefix.isalnum() or len(prefix) + 1 + len(str(nodes - 1)) > MAX_IFNAME:
            raise ValueError(f"prefix {prefix!r} must be alphanumeric and short enough that "
                             f"'{prefix}h{nodes - 1}' fits {MAX_IFNAME} characters")
        rates = inter_node_mbit if isinstance(inter_node_mbit, list | tuple) else [inter_node_mbit] * nodes
        if len(rates) != nodes:
            raise ValueError(f"--inter-node-mbit lists {len(rates)} rates for {nodes} nodes; "
                             "give one rate, or one per node")
        for r in rates:
            if r is not None:
                tbf_params(r)  # validates
        self.nodes, self.ranks_per_node, self.prefix, self.subnet = nodes, ranks_per_node, prefix, subnet
        self.rates: list[float | None] = list(rates)
        self.intra_rates: list[float | None] = [None] * nodes   # set_intra_rate
        self.keep = keep                 # `commpipe cluster up`: leave it running after exit
        self.bridge = f"{prefix}br"
        self._procs: list[subprocess.Popen] = []
        self._up = False
        self._lock = threading.Lock()

    # -- names --------------------------------------------------------------------------------
    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def host_veth(self, node: int) -> str:
        return f"{self.prefix}h{node}"

    def node_ip(self, node: int) -> str:
        self._check_node(node)
        return f"{self.subnet}.{node + 1}"

    @property
    def ifname(self) -> str:
        return NS_IFNAME

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} does not exist; this cluster has nodes 0..{self.nodes - 1}")

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        if not self.keep:
            self.teardown()

    def up(self) -> EmulatedCluster:
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"cannot build an emulated cluster: {reason}")
        if self._up:
            return self
        leftovers = list_resources(self.prefix)
        if any(leftovers.values()):
            raise RuntimeError(f"namespaces or links named {self.prefix}* already exist ({leftovers}); "
                               f"run `commpipe cluster down --prefix {self.prefix}` or pick another prefix")
        _register(self)
        self._up = True   # from here on teardown() has something to undo
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for i in range(self.nodes):
                self._add_node(i)
            for i, rate in enumerate(self.rates):
                if rate is not None:
                    self.set_rate(i, rate)
        except BaseException:
            self.teardown()
            raise
        if self.keep:
            _state_file(self.prefix).write_text(json.dumps(self.describe()))
        return self

    def _add_node(self, i: int) -> None:
        ns, host, tmp = self.ns(i), self.host_veth(i), f"{self.prefix}p{i}"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", host, "type", "veth", "peer", "name", tmp])
        _run(["ip", "link", "set", tmp, "netns", ns])
        _run(["ip", "-n", ns, "link", "set", tmp, "name", NS_IFNAME])
        _run(["ip", "-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", NS_IFNAME])
        _run(["ip", "-n", ns, "link", "set", NS_IFNAME, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "link", "set", host, "master", self.bridge])
        _run(["ip", "link", "set", host, "up"])

    def set_rate(self, node: int, mbit: float | None) -> None:
        """Set (or, with None, remove) node's link rate in Mbit/s; safe while traffic flows."""
        self._check_node(node)
        for prefix_cmd, dev in ((["ip", "netns", "exec", self.ns(node)], NS_IFNAME),
                                ([], self.host_veth(node))):
            if mbit is None:
                _run(prefix_cmd + ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                p = tbf_params(mbit)
                _run(prefix_cmd + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", p["rate"],
                                   "burst", p["burst"], "latency", p["latency"]])
        self.rates[node] = mbit
        if self.keep:
            _state_file(self.prefix).write_text(json.dumps(self.describe()))

    def set_intra_rate(self, node: int, mbit: float | None) -> None:
        """Set (or, with None, remove) the rate in Mbit/s between the ranks of one node (its
        loopback, shared by both directions); safe while traffic flows."""
        self._check_node(node)
        ns = ["ip", "netns", "exec", self.ns(node)]
        if mbit is None:
            _run(ns + ["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
            _run(["ip", "-n", self.ns(node), "link", "set", "lo", "mtu", str(LO_MTU)])
        else:
            p = tbf_params(mbit)
            _run(["ip", "-n", self.ns(node), "link", "set", "lo", "mtu", "1500"])
            _run(ns + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", p["rate"],
                       "burst", p["burst"], "latency", p["latency"]])
        self.intra_rates[node] = mbit
        if self.keep:
            _state_file(self.prefix).write_text(json.dumps(self.describe()))

    def popen(self, node: int, argv: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside node's namespace (in its own process group, so it can be stopped
        with everything it spawned). `env` is the full environment, as for subprocess.Popen."""
        self._check_node(node)
        if not self._up:
            raise RuntimeError("the cluster is not up; use `with EmulatedCluster(...)` or call up()")
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def link_bytes(self, node: int) -> dict[str, int]:
        """Bytes node has sent and received over its veth (host-end counters, mirrored)."""
        base = Path("/sys/class/net") / self.host_veth(node) / "statistics"
        # the host end receives what the node sends
        return {"sent": int((base / "rx_bytes").read_text()),
                "received": int((base / "tx_bytes").read_text())}

    def describe(self) -> dict:
        return {"prefix": self.prefix, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "subnet": self.subnet, "ifname": NS_IFNAME, "rates_mbit": self.rates,
                "intra_rates_mbit": self.intra_rates,
                "namespaces": [self.ns(i) for i in range(self.nodes)],
                "ips": [self.node_ip(i) for i in range(self.nodes)]}

    @classmethod
    def attach(cls, prefix: str = "cpn") -> EmulatedCluster:
        """The cluster `commpipe cluster up` left running under `prefix`."""
        path = _state_file(prefix)
        if not path.exists():
            raise FileNotFoundError(f"no emulated cluster named {prefix!r} is up "
                                    f"(no {path}); start one with `commpipe cluster up`")
        d = json.loads(path.read_text())
        c = cls(d["nodes"], d["ranks_per_node"], d["rates_mbit"], prefix=prefix, subnet=d["subnet"],
                keep=True)
        c.intra_rates = list(d.get("intra_rates_mbit") or [None] * c.nodes)
        c._up = True
        return c

    def teardown(self) -> None:
        """Stop what was started inside, then remove namespaces, veths (and their qdiscs) and the
        bridge. Idempotent; never raises, so it is safe in exit and signal handlers."""
        with self._lock:
            if not self._up:
                return
            self._up = False
        for proc in self._procs:
            _stop(proc)
        self._procs.clear()
        cleanup_stale(self.prefix)
        _state_file(self.prefix).unlink(missing_ok=True)
        _LIVE.pop(self.prefix, None)


def _stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process group started for `proc`, then SIGKILL it after a grace period."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _ours(prefix: str):
    """Matches exactly the names a cluster with this prefix creates, not other prefixes'."""
    return re.compile(rf"^{re.escape(prefix)}(n\d+|h\d+|p\d+|br)$").match


def list_resources(prefix: str) -> dict[str, list[str]]:
    """Namespaces and links a cluster named `prefix` created (this machine, root namespace)."""
    ours = _ours(prefix)
    out = _run(["ip", "netns", "list"], check=False).stdout
    namespaces = [line.split()[0] for line in out.splitlines() if line.split() and ours(line.split()[0])]
    links = []
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and ours(parts[1].strip().split("@")[0]):
            links.append(parts[1].strip().split("@")[0])
    return {"namespaces": namespaces, "links": links}


def cleanup_stale(prefix: str, wait_s: float = 5.0) -> dict[str, list[str]]:
    """Remove every namespace and link of cluster `prefix` (leftovers of a killed run); the qdiscs
    go with their links. Processes still inside those namespaces are stopped first: they belong
    to the run being cleaned up. Returns what was removed."""
    found = list_resources(prefix)
    for ns in found["namespaces"]:
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    # deleting the host end removes the pair at once; namespace deletion alone frees its
    # veth asynchronously, which would leave the link visible for a moment
    for link in found["links"]:
        _run(["ip", "link", "del", link], check=False)
    for ns in found["namespaces"]:
        _run(["ip", "netns", "del", ns], check=False)
    deadline = time.monotonic() + wait_s
    while any(list_resources(prefix).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _register(cluster: EmulatedCluster) -> None:
    global _HOOKS_INSTALLED
    _LIVE[cluster.prefix] = cluster
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_teardown_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) != signal.SIG_IGN:   # e.g. SIGINT of a background job
                _PREV_HANDLERS[sig] = signal.signal(sig, _on_signal)


def _teardown_all() -> None:
    for cluster in list(_LIVE.values()):
        if not cluster.keep:
            cluster.teardown()


def _on_signal(signum, frame) -> None:
    _teardown_all()
    prev = _PREV_HANDLERS.get(signum)
    if callable(prev):
        prev(signum, frame)           # e.g. Python's default SIGINT -> KeyboardInterrupt
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
