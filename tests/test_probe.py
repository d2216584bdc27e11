"""`commpipe probe`: the latency/bandwidth fit against exact synthetic timings, and a real
two-rank run writing the documented JSON schema."""

from __future__ import annotations

import json

import pytest


def test_probe_fit_recovers_latency_and_bandwidth():
    from commpipe.monitor.probe import fit_latency_bandwidth, parse_sizes

    sizes = parse_sizes("4K,64K,1M,16M")
    assert sizes == [4096, 65536, 1 << 20, 16 << 20]
    # t = 50 us + bytes / 10 GB/s exactly: the fit returns both back
    lat, bw, how = fit_latency_bandwidth(sizes, [50e-6 + n / 10e9 for n in sizes])
    assert how == "fit" and lat == pytest.approx(50e-6) and bw == pytest.approx(10e9)
    # flat times (noise): the largest message's bytes / time, flagged
    lat, bw, how = fit_latency_bandwidth(sizes, [1e-3] * 4)
    assert how.startswith("largest") and bw == pytest.approx((16 << 20) / 1e-3)
    with pytest.raises(ValueError, match="4K,1M"):
        parse_sizes("4K,lots")


def test_probe_cli_writes_schema(tmp_path, capfd):
    """Two ranks spawned on this host are one node: the pair is intra_node, none is inter_node."""
    from commpipe.cli import main

    out = tmp_path / "probe.json"
    assert main(["probe", "--nproc", "2", "--sizes", "4K,256K", "--iters", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["world_size"], res["ranks_per_node"], res["nodes"]) == (2, 2, 1)
    assert res["node_of_rank"] == [0, 0]
    assert res["pairs"]["inter_node"] is None                     # one host, one node
    intra = res["pairs"]["intra_node"]
    assert intra["ranks"] == [0, 1] and intra["latency_ms"] >= 0 and intra["bandwidth_gbps"] > 0
    assert [s["bytes"] for s in intra["sizes"]] == [4096, 262144]
    (ar,) = res["allreduce"]
    big = ar["sizes"][1]
    assert ar["group_size"] == 2 and big["busbw_gbps"] == pytest.approx(big["algbw_gbps"])  # 2(n-1)/n = 1
    table = capfd.readouterr().out
    assert "on 1 node(s)" in table and "inter_node" in table and "not measured" in table


def test_pairs_follow_the_nodes_the_ranks_run_on():
    from commpipe.monitor.probe import node_numbers, probe_pairs

    # two hosts, ranks in blocks (torchrun's order) and round robin
    assert node_numbers(["a", "a", "b", "b"]) == [0, 0, 1, 1]
    assert probe_pairs([0, 0, 1, 1]) == {"intra_node": (0, 1), "inter_node": (0, 2)}
    assert probe_pairs(node_numbers(["b", "a", "b", "a"])) == {"intra_node": (0, 2), "inter_node": (0, 1)}
    assert probe_pairs([0, 0, 0, 0]) == {"intra_node": (0, 1), "inter_node": None}   # one host
    assert probe_pairs([0, 1]) == {"intra_node": None, "inter_node": (0, 1)}          # one rank per node


def test_declared_nodes_that_do_not_exist_are_refused(capsys):
    """--ranks-per-node 2 on 4 ranks spawned here would label a loopback pair inter_node: refused
    before any process starts, saying where the ranks run."""
    from commpipe.cli import main

    assert main(["probe", "--nproc", "4", "--ranks-per-node", "2", "--sizes", "4K,8K"]) == 2
    err = capsys.readouterr().err
    assert "--ranks-per-node 2 does not match where the ranks run: all 4 ranks run on one node" in err
    from commpipe.monitor.probe import check_ranks_per_node

    check_ranks_per_node(2, [0, 0, 1, 1])                    # matches: accepted
    check_ranks_per_node(None, [0, 0, 0, 1])                 # nothing declared
    with pytest.raises(ValueError, match="2 nodes holding 3, 1 ranks"):
        check_ranks_per_node(2, [0, 0, 0, 1])


def test_rendezvous_port_is_free_and_below_the_ephemeral_range():
    """probe and the test harness rendezvous on `free_port`: a port no outgoing connection can be
    handed (below the kernel's ephemeral range) and free, so rank 0 can bind it."""
    import socket

    from commpipe.cluster.ports import ephemeral_low, free_port

    low = ephemeral_low()
    if low <= 12000:
        pytest.skip(f"ephemeral range starts at {low}: no room below it")
    ports = {free_port() for _ in range(5)}
    assert all(10000 <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
