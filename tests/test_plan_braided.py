"""The planner prices and chooses the braided schedules (STP, DualPipeV) through the simulator:
their TP collectives run on its TP stream, where the other pass of a braid hides them.

    python -m pytest tests/test_plan_braided.py -q
"""

from __future__ import annotations

from collections import Counter

import pytest

from commpipe.models.spec import resolve_model
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, Layout, enumerate_layouts
from commpipe.plan.pipeline import action_counts, simulate_step
from commpipe.plan.search import search
from commpipe.plan.timing import stage_costs
from commpipe.schedules import generate, lower
from commpipe.sim import CostTable, simulate

SPEC = resolve_model("arch=llama,layers=16,hidden=2048,heads=16,kv_heads=8,vocab=32000")
JOB = Job(32, 2048)
# 2 GPUs per node: TP4 spans two nodes, so its collectives are slow and worth hiding
TP_ACROSS = default_cluster(resolve_gpu("h100"), 16, 2)


def test_braided_step_is_the_simulation_with_tp_on_its_stream():
    lay = Layout(tp=4, pp=4, schedule="stp")
    costs = stage_costs(SPEC, lay, JOB, TP_ACROSS, Efficiency())
    m = lay.microbatches_for(JOB)
    # by hand from the cost parts: compute, CP and ZeRO stay in the passes; the TP collectives
    # of one pass (the smaller of forward and backward) go to the TP stream, the rest stays
    tp = [min(a, b) for a, b in zip(costs.tp_f, costs.tp_b)]
    z = [0.0] * len(tp)
    f = [(c + t + p + zf - x) * 1e3 for c, t, p, zf, x in
         zip(costs.comp_f, costs.tp_f, costs.cp_f, costs.zero_f or z, tp)]
    i = [(c + t + p + zb - x) * 1e3 for c, t, p, zb, x in
         zip(costs.comp_i, costs.tp_b, costs.cp_b, costs.zero_b or z, tp)]
    w = [x * 1e3 for x in costs.comp_w]
    link = TP_ACROSS.p2p_link(0, costs.pp_stride)
    table = CostTable(f=f, b=[a + b for a, b in zip(i, w)], i=i, w=w,
                      latency_ms=link.latency_s * 1e3, bandwidth_gbps=link.bandwidth_gbps,
                      activation_bytes=costs.p2p_bytes, tp_comm=[x * 1e3 for x in tp])
    full = simulate(lower(generate("stp", 4, m, 2)), table)
    span, busy = simulate_step("stp", 4, 2, m, f, table.b, i, w, link.latency_s * 1e3,
                               link.bandwidth_gbps, costs.p2p_bytes, tp_comm=table.tp_comm)
    assert span == pytest.approx(full.makespan, rel=1e-9)
    # some TP hides: the braided step beats the same program with every collective exposed
    # (added to its pass), and the exposed TP time is above zero but below the total
    tpc = table.tp_comm
    plain = CostTable(f=[a + t for a, t in zip(f, tpc)], b=[a + t for a, t in zip(table.b, tpc)],
                      i=[a + t for a, t in zip(i, tpc)], w=w, latency_ms=table.latency_ms,
                      bandwidth_gbps=table.bandwidth_gbps, activation_bytes=costs.p2p_bytes)
    exposed = simulate(lower(generate("stp", 4, m, 2)), plain)
    assert full.makespan < exposed.makespan
    per_rank_tp = 2 * m * (tpc[0] + tpc[-1])           # rank 0: F and I of both its chunks
    assert 0 < full.tp_bubble[0] < per_rank_tp


def test_stp_hides_tp_that_zbv_exposes():
    est = {s: estimate(SPEC, Layout(tp=4, pp=4, schedule=s), JOB, TP_ACROSS)
           for s in ("zbv", "stp", "dualpipev")}
    assert all(e.feasible for e in est.values())
    # the same V placement and passes; only the braids differ
    assert est["stp"].breakdown["compute"] == pytest.approx(est["zbv"].breakdown["compute"])
    for s in ("stp", "dualpipev"):
        assert est[s].breakdown["tp"] < 0.7 * est["zbv"].breakdown["tp"]
        assert est[s].step_time_s < est["zbv"].step_time_s


def test_the_planner_chooses_a_braided_schedule_when_tp_is_exposed():
    res = search(SPEC, JOB, TP_ACROSS, fixed={"tp": 4, "pp": 4}, top=3, explain=False)
    assert res.top[0].layout.schedule in ("stp", "dualpipev")
    # and every braided layout it enumerates has tp > 1 (nothing to hide otherwise) and no
    # full recompute (train refuses it with braids)
    lays = [lay for lay in enumerate_layouts(SPEC, JOB, 16) if lay.schedule in ("stp", "dualpipev")]
    assert lays and all(lay.tp > 1 and lay.recompute != "full" and lay.vpp == 2 for lay in lays)


@pytest.mark.parametrize("name,p", [("stp", 2), ("stp", 4), ("dualpipev", 3)])
def test_action_counts_extrapolate_exactly(name, p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2, 6 * p):
        prog = generate(name, p, m, 2)
        want = [Counter(tuple((x.op, x.stage) for x in a.parts) for a in acts)
                for acts in prog.actions]
        got = action_counts(name, p, 2, m)
        assert [dict(c) for c in want] == [{k: v for k, v in g.items() if v} for g in got]


def test_braided_lower_bounds_hold():
    c = default_cluster(resolve_gpu("h100"), 16, 4)
    lays = [lay for lay in enumerate_layouts(SPEC, JOB, 16) if lay.schedule in ("stp", "dualpipev")]
    for lay in lays[::max(1, len(lays) // 25)]:
        e = estimate(SPEC, lay, JOB, c, detail=False)
        assert e.lower_bound_s <= e.step_time_s * (1 + 1e-9), lay
