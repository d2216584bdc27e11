"""Pure pieces of the monitor: sampling decisions, nccl-tests bandwidth accounting, and the
per-step records built from counts and timed samples (no torch, no process groups).

Timing model (all times on the clock of rank 0, seconds; done = when the data had arrived,
observed by the comm however late the consumer waited; ready = the peer's post time for
point-to-point, or the end of this rank's previous message on the same link if that was later
(one connection carries a rank pair's messages one after the other); the group's last post
time for a collective):
  wait     = max(0, ready - my_post), at most the call's raw interval (done - my_post)
  transfer = raw interval - wait  (= my_done - max(my_post, ready) when ready < my_done)
so wait + transfer is the call's post-to-arrival time. Every record and link summary says
whether its link is intra_node (every rank on one node) or inter_node.
Bandwidth is bytes moved / transfer time in decimal GB/s (1e9 bytes/s). For collectives the
algorithm and bus bandwidths follow nccl-tests (doc/PERFORMANCE.md): algbw = S / t and
busbw = algbw * factor with factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather,
reduce-scatter and all-to-all, 1 for broadcast and send/recv; S is the all-reduce / broadcast
buffer, the *output* of all-gather and the *input* of reduce-scatter and all-to-all (the full
tensor in every case; of an all-to-all, the 1/n that a rank keeps never crosses a link).
"""

from __future__ import annotations

import math
import random

MASK64 = (1 << 64) - 1
P2P_OPS = ("send", "recv")


# -- sampling ----------------------------------------------------------------------------------
def splitmix64(x: int) -> int:
    """SplitMix64 finaliser (Steele, Lea, Flood 2014): a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_base(seed: int, dim: str, op: str, rank: int, peer, group) -> int:
    """A 64-bit key shared by every rank taking part in the same stream of calls.

    A send from a to b and the matching recv on b derive the same key from (seed, dim, a, b),
    and every member of a collective the same key from (seed, dim, op, group), so decisions
    derived from (key, seq) agree on both sides without any exchange. The key comes from the
    monitor's own `random.Random` seeded with a string (hashed with SHA-512, so stable across
    processes, unlike Python's salted hash()); no global RNG is touched.
    """
    if op in P2P_OPS:
        src, dst = (rank, peer) if op == "send" else (peer, rank)
        text = f"{seed}|{dim}|p2p|{src}|{dst}"
    else:
        text = f"{seed}|{dim}|{op}|{','.join(map(str, group))}"
    return random.Random(text).getrandbits(64)


def class_base(base: int, size_class: int) -> int:
    """The key of one size class (CommCall.size_class) of a stream: its own chain of samples."""
    return splitmix64((base + size_class) & MASK64)


def next_sampled(base: int, seq: int, fraction: float) -> int:
    """The first sampled sequence number after `seq` (seq = -1: the first) in one size class of
    a stream (`base` from class_base, seq = CommCall.size_seq).

    Jittered systematic sampling: the class's calls are cut into windows of 1/fraction calls
    and one call per window, at a position hashed from (key, window), is timed. Every size
    class of a stream is then timed at `fraction` of its calls, fewer than 2/fraction + 1 calls
    apart, whatever order the classes interleave in. A stream that issues a 4 MB gradient
    all-reduce and an 8-byte loss all-reduce each step has both timed, each in one step out of
    1/fraction; one Bernoulli draw per position of the mixed stream could fall on the 8-byte
    call every time (a fixed two-call pattern, and positions restarting with every relaunch).
    The windows start at seq 0 for every rank, so both ends of a stream find the same sampled
    calls whenever they start looking (see `sampled_seqs`).
    """
    return next_window(base, seq, fraction, int(max(seq, 0) * fraction))[1]


def next_window(base: int, seq: int, fraction: float, window: int) -> tuple[int, int]:
    """(window, position) of the first sampled position after `seq`, looking from `window` on
    (no earlier window may hold one): after sampling window w's position, window w + 1 holds
    the next, so a sampled call costs one hash."""
    if fraction >= 1.0:
        return seq + 1, seq + 1
    if fraction <= 0.0:
        return 0, 1 << 62
    # window w holds the positions [ceil(w/f), ceil((w+1)/f)): disjoint, none empty (f < 1);
    # the epsilon keeps 1/f = 10 windows exactly 10 long despite 3/0.1 = 30.000000000000004
    lo = math.ceil(window / fraction - 1e-9)
    while True:
        hi = math.ceil((window + 1) / fraction - 1e-9)
        u = (splitmix64((base + window) & MASK64) >> 11) / (1 << 53)   # uniform in [0, 1)
        pick = lo + int(u * (hi - lo))
        if pick > seq:
            return window, pick
        window, lo = window + 1, hi


def tagged_sampled(base: int, tag: int, seq: int, fraction: float) -> bool:
    """Decision for a tagged point-to-point message (CommCall.tag != 0): such messages may be
    posted in different orders on the two sides (gloo matches them by tag), so the decision is
    a plain hash of (key, tag, seq-within-tag) that both sides compute alike."""
    if fraction >= 1.0 or fraction <= 0.0:
        return fraction >= 1.0
    return splitmix64((splitmix64(base ^ tag) + seq) & MASK64) < int(fraction * (1 << 64))


def sampled_seqs(base: int, fraction: float, upto: int) -> list[int]:
    """Every sampled sequence number below `upto` (for checks and catching up)."""
    out, s = [], next_sampled(base, -1, fraction)
    while s < upto:
        out.append(s)
        s = next_sampled(base, s, fraction)
    return out


# -- nccl-tests accounting --------------------------------------------------------------------
def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    # nccl-tests src/alltoall.cu; all_to_all_counts: the MoE row counts (parallel.expert)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_counts"):
        return (n - 1) / n
    return 1.0  # broadcast, send, recv


def algbw_bytes(op: str, nbytes: int, n: int) -> int:
    """The size S nccl-tests divides by time: CommCall.nbytes is this rank's *input*, which
    for all-gather is one shard of the n-times larger output."""
    return nbytes * n if op == "all_gather" else nbytes


def wire_bytes(op: str, nbytes: int, n: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by this rank, ring-algorithm accounting for collectives
    (each rank moves busbw_factor * S each way)."""
    if op == "send":
        return nbytes, 0
    if op == "recv":
        return 0, nbytes
    moved = round(algbw_bytes(op, nbytes, n) * busbw_factor(op, n))
    return moved, moved


# -- per-step records -------------------------------------------------------------------------
def _ema(prev, value, alpha):
    if value is None:
        return prev
    return value if prev is None else alpha * value + (1.0 - alpha) * prev


def _ms(x):
    return None if x is None else x * 1e3


def split_times(op: str, post: float, done: float, peer_posts, after: float | None = None) -> tuple:
    """(wait_s, transfer_s) of one timed call, or (None, None) when the peers' posts are not
    known. `peer_posts`: the counterpart's post time (p2p) or every member's (collective);
    `after`: when this rank's previous message on the same link completed, if the call was
    posted while it was still in flight (messages of a rank pair share one connection)."""
    if peer_posts is None:
        return None, None
    ready = peer_posts if op in P2P_OPS else max(peer_posts)
    if after is not None:
        ready = max(ready, after)
    # a call cannot wait longer than it lasted: a send that completed before its receiver
    # posted (buffered by the transport) waited for nobody
    raw = max(0.0, done - post)
    wait = min(max(0.0, ready - post), raw)
    return wait, raw - wait


def link_class(rank: int, peer, group, nodes) -> str | None:
    """`intra_node` when every rank of the call (the pair, or the group) is on one node,
    else `inter_node`; None when the nodes are not known. nodes[r]: node number of rank r."""
    members = group if group else (rank, peer)
    if nodes is None or any(r is None or not 0 <= r < len(nodes) for r in members):
        return None
    return "inter_node" if len({nodes[r] for r in members}) > 1 else "intra_node"


def build_records(rank: int, step: int, counts, samples, lookup, ema: dict, alpha: float,
                  nodes=None) -> list[dict]:
    """One record per (dim, op, peer or group) of `rank` at `step`.

    counts:  [(key, calls, bytes[, blocked seconds])] for every stream this rank has used,
             calls possibly 0
    samples: [(key, mid, post, done, nbytes[, after])] timed calls completed in this step; mid
             is the message id, CommCall.seq, or (tag, seq) for tagged point-to-point
             messages; after: see split_times
    lookup(key, mid) -> counterpart post (p2p), all members' posts (collective) or None
    ema:     {key: (ema_bandwidth_gbps, ema_latency_ms)} updated in place
    nodes:   node number of every rank (link_class of each record), or None
    key = (dim, op, peer, group).
    """
    agg: dict = {}
    for key, mid, post, done, nbytes, *after in samples:
        op = key[1]
        a = agg.setdefault(key, [0, 0, 0, 0.0, 0.0, 0.0, 0])  # n, matched, bytes, wait, xfer, raw, mbytes
        a[0] += 1
        a[2] += nbytes
        a[5] += max(0.0, done - post)
        wait, xfer = split_times(op, post, done, lookup(key, mid), *after)
        if xfer is not None:
            a[1] += 1
            a[3] += wait
            a[4] += xfer
            a[6] += nbytes
    out = []
    for key, calls, nbytes, *blocked in counts:
        dim, op, peer, group = key
        n = len(group) if group else 2
        sent, recv = wire_bytes(op, nbytes, n)
        s_n, m_n, s_bytes, w_sum, x_sum, r_sum, m_bytes = agg.get(key, (0, 0, 0, 0.0, 0.0, 0.0, 0))
        bw = (algbw_bytes(op, m_bytes, n) / x_sum / 1e9) if m_n and x_sum > 0 else None
        raw_bw = (algbw_bytes(op, s_bytes, n) / r_sum / 1e9) if s_n and r_sum > 0 else None
        latency = x_sum / m_n * 1e3 if m_n else None
        prev_bw, prev_lat = ema.get(key, (None, None))
        ema[key] = (_ema(prev_bw, bw, alpha), _ema(prev_lat, latency, alpha))
        out.append({
            "step": step, "rank": rank, "dim": dim, "op": op,
            "peer": peer, "group": list(group) if group else None, "group_size": n,
            "link_class": link_class(rank, peer, group, nodes),
            "calls": calls, "sampled": s_n, "matched": m_n,
            "bytes": nbytes, "bytes_sent": sent, "bytes_recv": recv,
            "wait_ms": _ms(w_sum / m_n) if m_n else None,
            "wait_ms_total": _ms(w_sum) if m_n else None,
            "transfer_ms": latency,
            "transfer_ms_total": _ms(x_sum) if m_n else None,
            "raw_ms": _ms(r_sum / s_n) if s_n else None,
            "raw_ms_total": _ms(r_sum) if s_n else None,
            # every call, not only sampled ones: host time the caller spent in wait() (on CPU
            # the exposed part of the communication; CUDA waits do not block the host)
            "blocked_ms_total": _ms(blocked[0]) if blocked else None,
            "latency_ms": latency,
            "bandwidth_gbps": bw,
            "busbw_gbps": bw * busbw_factor(op, n) if bw is not None else None,
            "raw_bandwidth_gbps": raw_bw,
            "ema_bandwidth_gbps": ema[key][0],
            "ema_latency_ms": ema[key][1],
        })
    return out


_SIDE = ("calls", "sampled", "matched", "bytes", "wait_ms", "transfer_ms", "raw_ms",
         "bandwidth_gbps", "raw_bandwidth_gbps", "ema_bandwidth_gbps", "ema_latency_ms")


def build_links(step: int, per_rank: dict[int, list[dict]]) -> list[dict]:
    """Join every rank's records of one step into one record per link and per collective group.

    A p2p link (dim, src, dst) carries the sender's and the receiver's view side by side; its
    headline timing is the receiver's (data has arrived when the recv completes), falling back
    to the sender's. A collective group carries each member's view; its time is the slowest
    member's transfer, so its bus bandwidth is the group's effective one.
    """
    links: dict = {}
    groups: dict = {}
    for rank in sorted(per_rank):
        for r in per_rank[rank]:
            if r["op"] in P2P_OPS:
                src, dst = (rank, r["peer"]) if r["op"] == "send" else (r["peer"], rank)
                side = "send" if r["op"] == "send" else "recv"
                links.setdefault((r["dim"], src, dst), {})[side] = r
            else:
                groups.setdefault((r["dim"], r["op"], tuple(r["group"])), {})[rank] = r
    out = []
    for (dim, src, dst), sides in sorted(links.items()):
        s, v = sides.get("send"), sides.get("recv")
        head = v if v is not None and v["matched"] else (s if s is not None and s["matched"] else v or s)
        out.append({
            "step": step, "kind": "p2p", "dim": dim, "src": src, "dst": dst,
            "link_class": (v or s).get("link_class"),
            "calls_sent": s["calls"] if s else 0, "calls_recv": v["calls"] if v else 0,
            "bytes_sent": s["bytes"] if s else 0, "bytes_recv": v["bytes"] if v else 0,
            "sampled": head["sampled"], "matched": head["matched"],
            "wait_ms": v["wait_ms"] if v else None,            # receiver idle, waiting for src
            "send_wait_ms": s["wait_ms"] if s else None,       # sender idle, waiting for dst
            "transfer_ms": head["transfer_ms"], "bandwidth_gbps": head["bandwidth_gbps"],
            "ema_bandwidth_gbps": head["ema_bandwidth_gbps"], "ema_latency_ms": head["ema_latency_ms"],
            "send": {k: s[k] for k in _SIDE} if s else None,
            "recv": {k: v[k] for k in _SIDE} if v else None,
        })
    for (dim, op, group), members in sorted(groups.items()):
        timed = [m for m in members.values() if m["matched"]]
        slow = max(timed, key=lambda m: m["transfer_ms"]) if timed else None
        out.append({
            "step": step, "kind": "collective", "dim": dim, "op": op, "group": list(group),
            "link_class": next(iter(members.values())).get("link_class"),
            "calls": max(m["calls"] for m in members.values()),
            "bytes": sum(m["bytes"] for m in members.values()),
            "sampled": max(m["sampled"] for m in members.values()),
            "wait_ms": max(m["wait_ms"] for m in timed) if timed else None,
            "transfer_ms": slow["transfer_ms"] if slow else None,
            "bandwidth_gbps": slow["bandwidth_gbps"] if slow else None,
            "busbw_gbps": slow["busbw_gbps"] if slow else None,
            "members": {str(rank): {k: m[k] for k in ("calls", "sampled", "wait_ms", "transfer_ms",
                                                      "busbw_gbps", "ema_bandwidth_gbps")}
                        for rank, m in sorted(members.items())},
        })
    return out
