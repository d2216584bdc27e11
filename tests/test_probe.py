"""`commpipe probe`: the latency/bandwidth fit against exact synthetic timings, and a real
two-rank run writing the documented JSON schema."""

from __future__ import annotations

import json
import os
import statistics
import time

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
    assert main(["probe", "--nproc", "2", "--sizes", "4K,256K", "--iters", "2", "--calls", "20",
                 "--out", str(out)]) == 0
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
    # collectives as training makes them: after compute, no barrier; mean and median per op
    calls = res["calls"]
    assert (calls["ranks"], calls["bytes"], calls["calls"]) == ([0, 1], 8192, 20)
    assert set(calls["ops"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(0 < v["median_ms"] and 0 < v["mean_ms"] for v in calls["ops"].values())
    for v in calls["ops"].values():      # 20 calls in 5 rounds; the mean is the middle round's
        assert len(v["round_means_ms"]) == 5
        assert v["mean_ms"] == pytest.approx(statistics.median(v["round_means_ms"]))
    # what other processes used of the host's cores meanwhile: one entry for the one node
    (load,) = res["host_load"]
    assert load["node"] == 0 and load["cores"] >= 1
    assert load["other_cores"] is None or 0 <= load["other_cores"] <= load["cores"]
    table = capfd.readouterr().out
    assert "on 1 node(s)" in table and "inter_node" in table and "not measured" in table
    assert "calls after 0.5 ms of compute, 8K, ranks 0-1, mean ms: all_reduce" in table


def test_gloo_call_time_is_what_a_call_costs_beyond_its_priced_link(tmp_path):
    """Per op, the probe's mean call time less the op's latency steps and bytes on the measured
    link (gloo: an all-reduce of 2 ranks is 2 steps, an all-gather and commpipe's reduce-scatter
    1), averaged over the ops; `plan --gpu cpu --cluster` prices every gloo call with it."""
    import argparse

    from commpipe.plan.cli_inputs import cluster_from_args
    from commpipe.plan.cluster import apply_probe, default_cluster, probe_call_overhead
    from commpipe.plan.gpus import resolve_gpu

    link = {"latency_ms": 0.1, "bandwidth_gbps": 1.0}
    probe = {"ranks_per_node": 2, "backend": "gloo", "pairs": {"intra_node": link},
             "calls": {"ranks": [0, 1], "bytes": 8192, "gap_ms": 0.5, "calls": 100,
                       "ops": {"all_reduce": {"mean_ms": 1.0, "median_ms": 0.5},
                               "all_gather": {"mean_ms": 0.8, "median_ms": 0.4},
                               "reduce_scatter": {"mean_ms": 0.6, "median_ms": 0.3}}}}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    cluster = apply_probe(default_cluster(resolve_gpu("cpu"), 2, 2), path)
    ar = 1.0e-3 - (2 * (1 / 2) * 8192 / 1e9 + 2 * 1e-4)
    ag = 0.8e-3 - ((1 / 2) * 16384 / 1e9 + 1e-4)          # the gathered tensor: 2 x 8 KiB
    rs = 0.6e-3 - ((1 / 2) * 8192 / 1e9 + 1e-4)
    assert probe_call_overhead(path, cluster) == pytest.approx((ar + ag + rs) / 3)
    args = argparse.Namespace(gpus=2, gpu="cpu", gpus_per_node=2, cluster=str(path), backend=None,
                              host_cores=None, intra_node_gbps=None, inter_node_gbps=None,
                              intra_node_latency_ms=None, inter_node_latency_ms=None)
    planned, eff = cluster_from_args(args)
    assert planned.backend == "gloo" and eff.coll_overhead_s == pytest.approx((ar + ag + rs) / 3)
    # the plan's header says so, after the links
    assert planned.source.endswith(f"; a gloo call after compute {(ar + ag + rs) / 3 * 1e3:.2f} ms "
                                   "beyond its link")
    # a probe without the measurement (nccl, or written before it) leaves the per-call time alone
    del probe["calls"]
    path.write_text(json.dumps(probe))
    assert probe_call_overhead(path, cluster) is None
    assert cluster_from_args(args)[1].coll_overhead_s == 0.0


def test_gpus_per_node_given_wins_over_the_probes_ranks_per_node(tmp_path):
    """Precedence: defaults < probe < profile < flags. A probe of 8 ranks on one host with
    --gpus-per-node 2 plans nodes of 2 (the probe's 8 only when the flag is absent; 8 without
    either)."""
    import argparse

    from commpipe.plan.cli_inputs import cluster_from_args

    link = {"latency_ms": 0.1, "bandwidth_gbps": 1.0}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"ranks_per_node": 8, "backend": "gloo", "pairs": {"intra_node": link}}))

    def args(**kw):
        base = dict(gpus=8, gpu="cpu", gpus_per_node=None, cluster=str(path), backend=None,
                    host_cores=None, intra_node_gbps=None, inter_node_gbps=None,
                    intra_node_latency_ms=None, inter_node_latency_ms=None)
        return argparse.Namespace(**(base | kw))

    assert cluster_from_args(args(gpus_per_node=2))[0].gpus_per_node == 2
    assert cluster_from_args(args())[0].gpus_per_node == 8
    assert cluster_from_args(args(gpus=16, cluster=None))[0].gpus_per_node == 8


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


GOOD_LINK = {"latency_ms": 0.02, "bandwidth_gbps": 100.0}


@pytest.mark.parametrize("pairs, message", [
    ({"intra_node": {}, "inter_node": None},
     "pairs.intra_node = {}: expected an object with bandwidth_gbps and latency_ms"),
    ({"intra_node": GOOD_LINK, "inter_node": [1, 2]}, "pairs.inter_node = [1, 2]: expected an object"),
    ({"intra_node": {"latency_ms": 0.02, "bandwidth_gbps": float("inf")}},
     "pairs.intra_node.bandwidth_gbps = Infinity: expected a finite positive number (decimal GB/s"),
    ({"intra_node": {"latency_ms": 0.02, "bandwidth_gbps": 0}},
     "pairs.intra_node.bandwidth_gbps = 0: expected a finite positive number"),
    ({"intra_node": {"latency_ms": 0.02, "bandwidth_gbps": "100"}},
     'pairs.intra_node.bandwidth_gbps = "100": expected a finite positive number'),
    ({"intra_node": {"latency_ms": float("nan"), "bandwidth_gbps": 100.0}},
     "pairs.intra_node.latency_ms = NaN: expected a finite non-negative number (milliseconds"),
    ({"intra_node": {"latency_ms": -1, "bandwidth_gbps": 100.0}}, "pairs.intra_node.latency_ms = -1"),
    ({"intra_node": {"bandwidth_gbps": 100.0}}, "pairs.intra_node.latency_ms = missing"),
    ({"intra_node": {"latency_ms": 0.02, "bandwidth_gbps": True}}, "bandwidth_gbps = true"),
    ({"intra_node": None, "inter_node": None}, "measured no link"),
    ({"intra": GOOD_LINK}, "pairs has intra; the link classes are intra_node and inter_node"),
])
def test_probe_file_is_checked_when_read(tmp_path, pairs, message):
    from commpipe.plan.cluster import apply_probe, default_cluster
    from commpipe.plan.gpus import resolve_gpu

    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"schema": "commpipe-probe/1", "world_size": 2, "ranks_per_node": 2,
                                "backend": "gloo", "pairs": pairs}))
    with pytest.raises(ValueError) as err:
        apply_probe(default_cluster(resolve_gpu("h100"), 8, 8), path)
    assert f"probe file {path}" in str(err.value) and message in str(err.value)


def test_probe_file_with_1e400_is_refused_by_plan(tmp_path, capsys):
    """1e400 is valid JSON that Python reads as infinity: refused, naming file and key."""
    from commpipe.cli import main

    path = tmp_path / "probe.json"
    path.write_text('{"ranks_per_node": 2, "pairs": {"intra_node": {"latency_ms": 0.01, '
                    '"bandwidth_gbps": 1e400}, "inter_node": null}}')
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"probe file {path}: pairs.intra_node.bandwidth_gbps = Infinity" in err


def test_unmeasured_class_is_reported_with_its_default(tmp_path, capsys):
    """A probe of one node measures intra_node only: the plan says inter_node is the default and
    which numbers that default is, not that both were measured."""
    from commpipe.cli import main
    from commpipe.plan.cluster import INTER_LATENCY_S, NIC_EFFICIENCY
    from commpipe.plan.gpus import resolve_gpu

    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"ranks_per_node": 8, "pairs": {"intra_node": GOOD_LINK}}))
    assert main(["plan", "--model", "tiny", "--gpus", "16", "--gpu", "h100", "--global-batch", "64",
                 "--seq-len", "128", "--cluster", str(path)]) == 0
    out = capsys.readouterr().out
    default_inter = NIC_EFFICIENCY * resolve_gpu("h100").nic_gbps
    assert (f"from probe:{path} (intra_node measured; inter_node not measured, default "
            f"{default_inter:g} GB/s and {INTER_LATENCY_S * 1e3:g} ms used)") in out
    assert "intra 100 GB/s" in out


def test_a_calls_mean_is_the_median_of_its_rounds_means():
    """One round slowed 10x by other work on the host (a process starting or exiting) leaves the
    call's price at the usual rounds' mean; a slowdown every round pays moves it."""
    from commpipe.monitor.probe import robust_mean_ms

    usual = [[1e-3, 1.2e-3]] * 4
    assert robust_mean_ms(usual + [[11e-3, 11e-3]]) == pytest.approx(1.1)    # plain mean: 3.08
    assert robust_mean_ms([[2e-3, 2.4e-3]] * 5) == pytest.approx(2.2)
    assert robust_mean_ms([[1e-3], [3e-3], [], [2e-3]]) == pytest.approx(2.0)  # an empty round


def test_other_cores_counts_other_processes_work_and_not_the_measurers_own(monkeypatch):
    """On a clock and /proc/stat played by hand: over 2 s the host was busy 3 CPU-s. If the
    measuring process itself used 2 of them, others kept (3 - 2) / 2 = 0.5 cores busy; if it
    slept, all 3 were others' work, 1.5 cores. Without /proc/stat: None. A live span on this
    host reads a value between none and every core."""
    import types

    from commpipe.monitor import host_load
    from commpipe.monitor.host_load import Span, busy_warning, other_cores

    now = {"wall": 10.0, "busy": 100.0, "own": 5.0}
    monkeypatch.setattr(host_load, "host_busy_s", lambda: now["busy"])
    monkeypatch.setattr(host_load, "time", types.SimpleNamespace(
        time=lambda: now["wall"], process_time=lambda: now["own"]))

    def span_over(wall: float, busy: float, own: float) -> float | None:
        span = Span.start()
        now["wall"] += wall
        now["busy"] += busy
        now["own"] += own
        return other_cores([span.stop().to_dict()])

    assert span_over(2.0, 3.0, 2.0) == pytest.approx(0.5)      # the measurer spun
    assert span_over(2.0, 3.0, 0.0) == pytest.approx(1.5)      # it slept: all others'
    assert span_over(2.0, 1.0, 1.5) == 0.0                     # never below none
    monkeypatch.setattr(host_load, "host_busy_s", lambda: None)
    assert span_over(1.0, 0.0, 0.0) is None
    assert busy_warning(1.5, 2, "the probe ran").startswith("warning: other processes kept 1.5")
    assert busy_warning(0.1, 2, "the probe ran") is None
    monkeypatch.undo()
    live = Span.start()
    time.sleep(0.2)
    value = other_cores([live.stop().to_dict()])
    assert value is None or 0.0 <= value <= (os.cpu_count() or 1) + 0.1


def test_other_cores_of_ranks_on_one_host_subtracts_each_ranks_own_time():
    """Two ranks on one host, hand-written spans: the host was busy 3.0 CPU-s over 2 s, the ranks
    used 1.2 and 0.8 s themselves, so others kept (3.0 - 2.0) / 2 = 0.5 cores busy."""
    from commpipe.monitor.host_load import other_cores
    from commpipe.monitor.probe_result import host_load

    a = {"wall0": 10.0, "wall1": 12.0, "busy0": 100.0, "busy1": 102.9, "own0": 1.0, "own1": 2.2,
         "cores": 4}
    b = {"wall0": 10.0, "wall1": 11.9, "busy0": 100.1, "busy1": 103.0, "own0": 5.0, "own1": 5.8,
         "cores": 4}
    assert other_cores([a, b]) == pytest.approx(0.5)
    assert other_cores([a | {"busy1": None}, b]) is None
    c = {"wall0": 10.0, "wall1": 12.0, "busy0": 50.0, "busy1": 54.0, "own0": 0.0, "own1": 2.0,
         "cores": 2}
    loads = host_load([a, c, b], [0, 1, 0])
    assert loads == [{"node": 0, "cores": 4, "other_cores": pytest.approx(0.5)},
                     {"node": 1, "cores": 2, "other_cores": pytest.approx(1.0)}]
    # the table warns where others took over a tenth of the cores: node 1 (1.0 of 2), not
    # node 2 (0.5 of 8)
    from commpipe.monitor.probe_result import format_table

    table = format_table({"world_size": 3, "nodes": 2, "ranks_per_node": 2, "backend": "gloo",
                          "device": "cpu", "fit": "", "pairs": {}, "allreduce": [],
                          "host_load": loads[1:] + [{"node": 2, "cores": 8, "other_cores": 0.5}]})
    assert "node 1: warning: other processes kept 1.0 of this host's 2 cores" in table
    assert "node 2" not in table
