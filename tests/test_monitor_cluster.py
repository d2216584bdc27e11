"""The monitor's link bandwidths in real training on the emulated cluster (root + iproute2).

    python -m pytest -q tests/test_monitor_cluster.py

`commpipe train` with pp=4 runs as one torchrun per node on 2 namespaced nodes x 2 ranks; the
link between the nodes is shaped with tbf to a known rate, the links inside a node are loopback.
With receive prefetch on (the runtime's default on gloo) and one call in ten timed, the
monitor must read the shaped rate on the inter-node boundary (ranks 1 <-> 2) and far more on
every intra-node direction, each record saying which class its link is.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from commpipe.cluster import netns
from commpipe.cluster.grids import Layout
from commpipe.cluster.launch import plan_commands, run_commands

NS_OK, NS_WHY = netns.available()
MBIT = 10                      # inter-node rate: 1.25 MB/s, 52 ms per message
SEQ, HIDDEN = 256, 64          # tiny preset: one activation or gradient = 256 x 64 fp32 = 64 KiB
MSG = SEQ * HIDDEN * 4
STEPS, WARMUP = 13, 1          # 8 micro-batches: 96 messages per direction after warm-up
# reference: the shaped rate itself (a message's 64 KiB take 52.4 ms at 10 Mbit/s; measured on
# an idle host: 52.7-53.5 ms per message, the headers' share of the rate included)


@pytest.fixture(scope="module")
def run_pp4(tmp_path_factory):
    if not NS_OK:
        pytest.skip(f"emulated cluster unavailable: {NS_WHY}")
    out = tmp_path_factory.mktemp("mon_cluster")
    train = {"preset": "tiny", "seq_len": SEQ, "microbatches": 8, "steps": STEPS,
             "comm_monitor": "sample=0.1"}
    prefix = f"tm{os.getpid() % 100000}"
    with netns.EmulatedCluster(2, 2, MBIT, prefix=prefix) as c:
        cmds = plan_commands(Layout(pp=4), train, out.resolve(), nodes=2, ranks_per_node=2,
                             master_addr=c.node_ip(0), master_port=29400 + os.getpid() % 500,
                             ifname=c.ifname)
        result = run_commands(cmds, out, cluster=c, timeout_s=300)   # measured: 25 s loaded
    assert result.ok, (result.reason, [Path(p).read_text()[-3000:] for p in result.logs])
    return out


def _links(out):
    return [json.loads(line) for line in (out / "monitor" / "links.jsonl").read_text().splitlines()]


def _bandwidth(links, src, dst):
    """The link's bandwidth as the report reads it: the median, over the steps after warm-up
    with a timed message src -> dst, of the step's bandwidth (receiver's view, the link's
    headline); also the number of timed messages, and the records."""
    timed = [lk for lk in links if lk["kind"] == "p2p" and lk["dim"] == "pp" and lk["src"] == src
             and lk["dst"] == dst and lk["step"] >= WARMUP and lk["matched"]]
    n = sum(lk["matched"] for lk in timed)
    return (statistics.median(lk["bandwidth_gbps"] for lk in timed) if timed else None), n, timed


def test_link_bandwidths_in_real_training(run_pp4):
    links = _links(run_pp4)
    assert json.loads((run_pp4 / "monitor" / "nodes.json").read_text())["node_of_rank"] == [0, 0, 1, 1]
    shaped = MBIT * 1e6 / 8 / 1e9                       # GB/s
    found = {}
    for src, dst in ((1, 2), (2, 1)):                  # the boundary between the nodes
        bw, n, timed = _bandwidth(links, src, dst)
        assert n >= 4, f"only {n} timed messages {src}->{dst}"
        assert {lk["link_class"] for lk in timed} == {"inter_node"}
        found[(src, dst)] = bw
        # the shaper lets no message through faster than the rate (10% for the bucket's burst
        # and rounding); a busy host only lengthens what the monitor measures (stamps taken
        # late: 4% below the rate with other tests and a busy loop on the two cores), so the
        # bound below is wider; it still fails a transfer that counts the wait for the peer
        # (2->1 measured at 0.59 of the rate with that bug planted)
        assert 0.8 <= bw / shaped <= 1.10, (src, dst, bw, shaped)
    for src, dst in ((0, 1), (1, 0), (2, 3), (3, 2)):  # loopback inside a node
        bw, n, timed = _bandwidth(links, src, dst)
        assert n >= 4, f"only {n} timed messages {src}->{dst}"
        assert {lk["link_class"] for lk in timed} == {"intra_node"}
        found[(src, dst)] = bw
        # not throttled (a shaped link reads at most 1.1x the rate); loopback medians measured
        # 0.03-0.35 GB/s on a loaded host, 26x-280x the rate
        assert bw >= 2 * shaped, (src, dst, bw, shaped)
    # bytes over time of all timed messages, for the record (CPU contention on a shared host can
    # stall a sender's I/O thread now and then, which a mean weighs and a median does not)
    total = {f"{s}->{d}": round(MSG * _bandwidth(links, s, d)[1] / 1e9
                                / sum(lk["transfer_ms"] * lk["matched"] / 1e3
                                      for lk in _bandwidth(links, s, d)[2]), 5) for s, d in found}
    print("median GB/s:", {f"{s}->{d}": round(v, 5) for (s, d), v in found.items()},
          "all calls GB/s:", total, "shaped", shaped)
    # every per-rank record carries its class too; pp collectives span both nodes
    for rank in range(4):
        for line in (run_pp4 / "monitor" / f"rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec["op"] in ("send", "recv"):
                cross = {rank, rec["peer"]} == {1, 2}
                assert rec["link_class"] == ("inter_node" if cross else "intra_node"), rec
            else:
                assert rec["link_class"] == "inter_node", rec
