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
    from commpipe.cli import main

    out = tmp_path / "probe.json"
    assert main(["probe", "--nproc", "2", "--ranks-per-node", "1", "--sizes", "4K,256K",
                 "--iters", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["world_size"], res["ranks_per_node"]) == (2, 1)
    assert res["pairs"]["intra_node"] is None                     # one rank per node
    inter = res["pairs"]["inter_node"]
    assert inter["ranks"] == [0, 1] and inter["latency_ms"] >= 0 and inter["bandwidth_gbps"] > 0
    assert [s["bytes"] for s in inter["sizes"]] == [4096, 262144]
    (ar,) = res["allreduce"]
    big = ar["sizes"][1]
    assert ar["group_size"] == 2 and big["busbw_gbps"] == pytest.approx(big["algbw_gbps"])  # 2(n-1)/n = 1
    assert "inter_node" in capfd.readouterr().out


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
