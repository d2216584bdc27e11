"""The simulator against hand-derived and published timings and memory peaks.

    python -m pytest tests/test_sim.py -q

Unless a test says otherwise: zero communication cost, and one micro-batch through one rank's
share of the model costs f=1 forward and b=2 backward (split I=W=1), so one rank's ideal
(bubble-free) time for a step is 3m. A chunk of an interleaved/V schedule costs 1/v of that.
"""

from __future__ import annotations

import json
import math

import pytest

from commpipe.cli import main as cli_main
from commpipe.schedules import (
    ScheduleDeadlock,
    generate,
    gpipe,
    interleaved,
    load_csv,
    lower,
    one_f_one_b,
    zb_h1,
    zbv,
)
from commpipe.sim import CostTable, simulate, to_chrome_trace
from commpipe.sim.costs import parse_costs
from commpipe.sim.export import gantt_png


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_gpipe_and_1f1b_bubble(gen, p, m):
    # Each micro-batch must cross p-1 other ranks on the way down and back up, so the step
    # takes (m + p - 1)(f + b) and every rank is busy m(f + b):
    # bubble fraction = (p-1)(f+b) / ((m+p-1)(f+b)) = (p-1)/(m+p-1)  (Huang et al. 2019;
    # Narayanan et al. 2021, Section 2.2).
    res = simulate(gen(p, m), CostTable.uniform(p, f=1.0, b=2.0))
    assert res.makespan == approx(3 * (m + p - 1))
    assert res.busy == [3.0 * m] * p
    assert res.bubble_fraction == approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (8, 16, 2)])
def test_interleaved_divides_the_bubble_by_v(p, m, v):
    # Narayanan et al. 2021, Section 2.2.2: with v chunks per rank the bubble time is
    # (p-1)(t_f + t_b)/v, where t_f + t_b = 3 is a whole rank's share. Ideal time 3m, so
    # makespan = 3m + 3(p-1)/v and bubble fraction = ((p-1)/v) / (m + (p-1)/v).
    # Example p=4, m=8, v=2: makespan 24 + 4.5 = 28.5, fraction 1.5/9.5 = 0.158 (1F1B: 0.273).
    res = simulate(interleaved(p, m, v), CostTable.uniform(p * v, f=1 / v, b=2 / v))
    assert res.makespan == approx(3 * m + 3 * (p - 1) / v)
    assert res.bubble_fraction == approx(((p - 1) / v) / (m + (p - 1) / v))
    one = simulate(one_f_one_b(p, m))
    assert (res.makespan - 3 * m) == approx((one.makespan - 3 * m) / v)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (4, 16), (8, 8), (8, 24)])
def test_zbh1_bubble_is_a_third_of_1f1b(p, m):
    # Qi et al. 2024, Section 2.1, with T_F = T_I = T_W = 1: ZB-H1's bubble is
    # (p-1)(T_F + T_I - T_W) = p-1 per rank, 1F1B's (T_B = T_I + T_W) is (p-1)(T_F+T_I+T_W)
    # = 3(p-1). Makespan 3m + (p-1); fraction (p-1)/(3m+p-1).
    zb = simulate(zb_h1(p, m), CostTable.uniform(p, f=1.0, b=2.0, i=1.0, w=1.0))
    ref = simulate(one_f_one_b(p, m), CostTable.uniform(p, f=1.0, b=2.0))
    assert zb.makespan == approx(3 * m + (p - 1))
    assert zb.bubble_fraction == approx((p - 1) / (3 * m + p - 1))
    assert (zb.makespan - 3 * m) * 3 == approx(ref.makespan - 3 * m)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (4, 7), (4, 8), (4, 32), (8, 16)])
def test_zbv_bubble_is_near_zero(p, m):
    # ZB-V with a chunk's F = I = W = 1/2 (each rank holds 2 chunks: 3m of work per rank).
    # Lower bound: rank p-1 cannot start before chunk 0 of micro-batch 0 has passed ranks
    # 0..p-2, i.e. (p-1)/2, and then has 3m of work: makespan >= 3m + (p-1)/2. The schedule
    # meets that bound exactly, so the bubble fraction is ((p-1)/2)/(3m + (p-1)/2), which
    # vanishes as m grows ("about zero", Qi et al. 2024, Section 6): 0.0588 at p=4, m=8.
    res = simulate(zbv(p, m), CostTable.uniform(2 * p, f=0.5, b=1.0, i=0.5, w=0.5))
    assert res.makespan == approx(3 * m + (p - 1) / 2)
    assert res.bubble_fraction == approx(((p - 1) / 2) / (3 * m + (p - 1) / 2))
    assert res.busy == [3.0 * m] * p


def test_peak_activations():
    p, m = 4, 8
    # GPipe: every forward before any backward -> m on every rank
    assert simulate(gpipe(p, m)).peak_activations == [m] * p
    # 1F1B: rank r runs p-r-1 warm-up forwards plus one -> p - r (Narayanan et al. 2021)
    assert simulate(one_f_one_b(p, m)).peak_activations == [p - r for r in range(p)]
    # ZB-H1: W deferred by r on rank r keeps p in flight on every rank (Qi et al. 2024, 2.1)
    assert simulate(zb_h1(p, m)).peak_activations == [p] * p
    # ZB-V: at most 2p chunk-activations = p micro-batch units on every rank (Qi et al. 2024,
    # Section 6; STP's table: 2p M_a per chunk)
    assert simulate(zbv(p, m)).peak_activations == [p] * p
    for v in (2, 4):
        # interleaved, Megatron warm-up 2(p-r-1) + (v-1)p chunks plus one in flight, each 1/v:
        # rank 0 holds p + (p-1)/v = p(1 + (p-1)/(pv)) (Korthikanti et al. 2022, Sec. 4.2.3)
        res = simulate(interleaved(p, m, v))
        assert res.peak_activations[0] == approx(p + (p - 1) / v)
        assert res.peak_activations == [approx((2 * (p - r - 1) + (v - 1) * p + 1) / v)
                                        for r in range(p)]


def test_point_to_point_latency_and_bandwidth():
    # p=2, m=1: F on rank 0 (1), transfer, F (1) and B (2) on rank 1, transfer back, B (2) on
    # rank 0. One transfer = latency + bytes/bandwidth = 0.5 + 2e6 B / (1 GB/s = 1e6 B/ms) = 2.5
    costs = CostTable.uniform(2, f=1.0, b=2.0, latency_ms=0.5, bandwidth_gbps=1.0,
                              activation_bytes=2e6)
    res = simulate(gpipe(2, 1), costs)
    assert res.makespan == approx(1 + 2.5 + 1 + 2 + 2.5 + 2)
    # rank 1 posts its receive at 0, waits 1 for the send to start, then 2.5 of transfer
    recv = [e for e in res.events if e.name == "1RECV_F0"][0]
    assert (recv.start_ms, recv.end_ms) == (0.0, approx(3.5))
    assert (recv.args["wait_ms"], recv.args["transfer_ms"]) == (approx(1.0), approx(2.5))
    # per-link values, looked up either way round, with a default
    costs = CostTable.uniform(2, f=1.0, b=2.0, latency_ms={"0-1": 0.25},
                              bandwidth_gbps={"default": 1.0}, activation_bytes=2e6)
    assert simulate(gpipe(2, 1), costs).makespan == approx(6 + 2 * 2.25)


def test_a_link_carries_one_message_at_a_time():
    # zero compute, 1 ms per transfer: rank 0's two sends to rank 1 go out back to back, so
    # micro-batch 1 arrives at 2, not 1
    costs = CostTable.uniform(2, f=0.0, b=0.0, bandwidth_gbps=1.0, activation_bytes=1e6)
    res = simulate(gpipe(2, 2), costs)
    sends = sorted((e.start_ms, e.end_ms) for e in res.events if "SEND_F" in e.name)
    assert sends == [(0.0, 1.0), (1.0, 2.0)]


@pytest.mark.parametrize("mode,makespan", [("exposed", 12.0), ("overlapped", 9.0)])
def test_tp_collectives_exposed_or_overlapped(mode, makespan):
    # 1F1B p=2, m=2: (m+p-1) = 3 (F, B) pairs on the critical path. A 0.5 TP all-reduce on F
    # and on B makes a pair cost 1 + 2 + 2*0.5 = 4 when exposed (makespan 3*4 = 12); when
    # overlapped it hides behind the compute (0.5 <= f), leaving 3*3 = 9.
    costs = CostTable.uniform(2, f=1.0, b=2.0, tp_comm=[0.5, 0.5], tp_mode=mode)
    res = simulate(one_f_one_b(2, 2), costs)
    assert res.makespan == approx(makespan)
    assert sum(e.stream == "tp" for e in res.events) == 8         # 2 F + 2 B on each of 2 ranks


def test_events_cover_the_program_once():
    prog = lower(zbv(3, 6))
    res = simulate(prog, CostTable.for_program(prog, latency_ms=0.1))
    compute = [e for e in res.events if e.stream == "compute"]
    assert sorted(e.name for e in compute) == sorted(str(a) for r in prog.actions for a in r
                                                     if a.is_compute)
    pp = [e for e in res.events if e.stream == "pp"]
    assert len(pp) == sum(not a.is_compute for r in prog.actions for a in r)
    for r in range(prog.pp):                      # one compute stream: no overlap, sums to busy
        ev = sorted((e for e in compute if e.rank == r), key=lambda e: e.start_ms)
        assert all(a.end_ms <= b.start_ms + 1e-12 for a, b in zip(ev, ev[1:]))
        assert sum(e.dur_ms for e in ev) == approx(res.busy[r])
        assert res.busy[r] + res.idle[r] == approx(res.makespan)


def test_activation_bytes_peak():
    # 1F1B: rank r peaks at p - r micro-batches; 10 bytes per stage-micro-batch
    prog = one_f_one_b(4, 8)
    costs = CostTable.uniform(4, activation_memory_bytes=[10.0] * 4)
    assert simulate(prog, costs).peak_activation_bytes == [40.0, 30.0, 20.0, 10.0]
    assert simulate(prog).peak_activation_bytes is None


def test_simulate_reports_deadlock():
    prog = load_csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(ScheduleDeadlock, match=r"\[1RECV_F1\]"):
        simulate(prog)


def test_cost_table_defaults_and_errors():
    c = CostTable.uniform(3, f=1.0, b=4.0)
    assert c.i == c.w == [2.0] * 3                              # b/2 split when absent
    assert CostTable.uniform(2, b=4.0, w=1.0).i == [3.0, 3.0]   # i = b - w
    prog = interleaved(2, 4, 2)
    c = parse_costs("f=1,b=2,w=0.5", prog)                      # per rank share, split over v=2
    assert (c.f, c.b, c.w, c.i) == ([0.5] * 4, [1.0] * 4, [0.25] * 4, [0.75] * 4)
    with pytest.raises(ValueError, match="unknown cost keys"):
        parse_costs("f=1,q=2", prog)
    with pytest.raises(ValueError, match="not key=value"):
        parse_costs("f", prog)
    with pytest.raises(ValueError, match=r"CostTable.uniform\(4"):
        simulate(prog, CostTable.uniform(2))
    with pytest.raises(ValueError, match="no entry for link"):
        simulate(one_f_one_b(2, 2), CostTable.uniform(2, latency_ms={"5-6": 1.0}))


def test_cost_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"f": [1, 1, 2], "b": [2, 2, 4], "latency_ms": 0.5}))
    c = parse_costs(str(path), gpipe(3, 1))          # lists are per stage, used as given
    assert c.f == [1.0, 1.0, 2.0]
    # one micro-batch walks down and back up: sum(f) + sum(b) + 4 transfers of 0.5
    assert simulate(gpipe(3, 1), c).makespan == approx(4 + 8 + 4 * 0.5)


def test_trace_and_png(tmp_path):
    res = simulate(zb_h1(3, 6))
    trace = json.loads(to_chrome_trace(res, tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "0I0" in names and "1SEND_B0" in names
    png = gantt_png(res, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json(capsys):
    assert cli_main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                     "--costs", "f=1,b=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)           # stdout holds only the JSON object
    assert out["makespan"] == 33.0
    assert math.isclose(out["bubble_fraction"], 3 / 11)
    assert out["peak_activations"] == [4, 3, 2, 1]
    assert out["busy"] == [24.0] * 4 and out["idle"] == [9.0] * 4


def test_cli_text_and_csv(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert cli_main(["simulate", "--schedule", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "rank 1" in out
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    assert cli_main(["simulate", "--schedule", str(path)]) == 2
    assert "deadlocks" in capsys.readouterr().err
    assert cli_main(["simulate", "--schedule", "interleaved", "--pp", "4",
                     "--microbatches", "8"]) == 2
    assert "--vpp 2" in capsys.readouterr().err
    # --compare takes everything from the run; schedule or cost flags beside it are refused, not ignored
    assert cli_main(["simulate", "--compare", str(tmp_path), "--schedule", "zbv", "--costs", "f=1"]) == 2
    assert "drop --schedule, --costs" in capsys.readouterr().err


def test_generate_names_match_cli():
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2)):
        assert generate(name, 2, 4, v).name == name


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1),
                                    ("zbv", 2), ("stp", 2), ("dualpipev", 2)])
def test_peak_walk_without_timing_matches_the_simulation(name, v):
    from commpipe.sim.engine import peak_activations

    for p, m in ((2, 4), (3, 6), (4, 8), (4, 16)):
        prog = generate(name, p, m, v)
        ref = simulate(prog, CostTable.uniform(prog.num_stages)).peak_activations
        assert peak_activations(prog) == ref            # the compute-only program, no costs
        assert peak_activations(lower(prog)) == ref
    assert peak_activations(one_f_one_b(4, 8)) == [4, 3, 2, 1]


@pytest.mark.parametrize("name", ["stp", "dualpipev", "zbv", "interleaved"])
def test_untimed_run_keeps_every_total(name):
    import random

    rng = random.Random(3)
    prog = lower(generate(name, 4, 12, 2))
    n = prog.num_stages
    i = [rng.uniform(0.5, 2) for _ in range(n)]
    w = [rng.uniform(0.2, 1.5) for _ in range(n)]
    costs = CostTable(f=[rng.uniform(0.5, 2) for _ in range(n)], b=[x + y for x, y in zip(i, w)],
                      i=i, w=w, latency_ms=0.05, bandwidth_gbps=20.0, activation_bytes=2e6,
                      tp_comm=[rng.uniform(0.1, 1.0) for _ in range(n)],
                      activation_memory_bytes=[1.0] * n)
    full, bare = simulate(prog, costs), simulate(prog, costs, check=False, record=False)
    assert full.events and not bare.events
    assert full.makespan == max(e.end_ms for e in full.events)       # the timeline's own end
    for key in ("makespan", "busy", "idle", "bubble_fraction", "peak_activations",
                "peak_activation_bytes", "tp_bubble"):
        assert getattr(bare, key) == getattr(full, key), key
