"""The controller's decision under a degraded link, on synthetic measurements, no launch: the
re-placement (the same degrees, the ranks placed so the slow link carries the least), what a
switch moves and over which link, where the fault's unexplained time goes in the calibration,
which candidates are trialled, and when to stay; each against hand-derived values.

    python -m pytest tests/test_adapt_decide_link.py -q

The synthetic model and its stage costs are tests/test_adapt_decide.py's (tiny LLaMA, seq 16).
"""

from __future__ import annotations

import pytest

from commpipe.adapt.config import AdaptConfig
from commpipe.adapt.records import Decision
from commpipe.layout import Layout
from tests.test_adapt_decide import BLOCK, HEAD, OTHER_MS, C, _cfg

# -- re-placement: the same degrees, the ranks placed so the slow link carries the least -----------

def test_a_slow_link_inside_a_dp_group_moves_the_pipeline_onto_it():
    """pp2 x dp2 on two nodes of two ranks, Megatron's order: the DP groups {0, 1} and {2, 3}
    are inside the nodes, the stages {0, 2} and {1, 3} across them. Node 0's internal link
    slows to 0.5 MB/s: stage 0's gradient all-reduce crosses it every step (2 blocks of 36,992
    parameters and the 16,384 of the embedding, fp32: 361,472 bytes; a 2-rank ring moves them
    once: 723 ms), while re-placed (tp-cp-pp-dp: stages {0, 1} and {2, 3}) it carries only the
    pipeline's activations (1 x 16 x 64 fp32 = 4 kB; 4 micro-batches, forward and backward,
    both stage pairs: at most 16 messages of 8.2 ms + 0.05 ms) and DP runs over the healthy
    node-to-node links (0.4 ms)."""
    from commpipe.adapt.model import CostModel, Measured
    from commpipe.parallel.dims import ParallelDims
    from commpipe.sim.costs import CostTable
    from commpipe.train.config import TrainConfig

    cur = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                 micro_batch_size=1)
    cfg = TrainConfig(model="tiny", dims=ParallelDims(pp=2, dp=2), seq_len=16, global_batch=8,
                      micro_batch_size=1, steps=1000).resolve(4)
    t0, t1 = 2 * BLOCK * C, (2 * BLOCK + HEAD) * C
    healthy, slow = (0.05, 1.0), (0.05, 0.0005)          # (latency ms, GB/s)
    links = {(a, b): healthy for a in range(4) for b in range(4) if a != b}
    links[0, 1] = links[1, 0] = slow
    dp_ms = 361_472 / 0.0005e9 * 1e3                    # a 2-rank ring: 723 ms
    measured = Measured(cur, CostTable(f=[t0 / 3, t1 / 3], b=[2 * t0 / 3, 2 * t1 / 3]),
                        host_ms=0.0, step_ms=t0 + 4 * t1 + OTHER_MS + dp_ms, links=links,
                        rank_busy={0: 4 * t0, 1: 4 * t0, 2: 4 * t1, 3: 4 * t1})
    model = CostModel(cfg.spec, 16, 4, 2, measured)
    assert model.predict(cur) == pytest.approx(measured.step_ms, rel=1e-9)
    replaced = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                      micro_batch_size=1, order="tp-cp-pp-dp")
    assert cur.kind_of_switch(replaced) == "replace"
    bound = t0 + 4 * t1 + OTHER_MS + 16 * (4096 / 0.0005e9 * 1e3 + 0.05) + 1.0
    assert model.predict(replaced) <= bound < 0.25 * measured.step_ms
    from commpipe.adapt.evaluate import evaluate

    d = evaluate(cfg, AdaptConfig(trials=0), measured, step=20, steps_left=1000, world=4,
                 ranks_per_node=2, detections=[], signals={})
    assert d.action == "switch" and d.to["order"] == "tp-cp-pp-dp", (d.kind, d.to, d.reason)
    # on one node there is nothing to re-place: the candidate is not offered
    one_node = evaluate(cfg, AdaptConfig(trials=0), measured, step=20, steps_left=1000, world=4,
                        ranks_per_node=4, detections=[], signals={})
    assert all("ranks tp-cp-pp-dp" not in c["plan"] for c in one_node.candidates)


# -- a degraded link between two nodes: who pays the fault's time ----------------------------------

STAGE0 = 12 * (2 * 36_992 + 16_384)       # parameters and two AdamW moments, fp32 (bytes)
STAGE1 = 12 * (2 * 36_992 + 16_384 + 64)  # the head carries its norm
AR = 361_472                              # a stage's gradients all-reduced over DP (fp32 bytes)
INTER_GBPS, SLOW_GBPS, LAT_MS = 0.1, 0.0002, 1.0
UNEXPLAINED_MS = 300.0                    # the fault's time the model does not price
DP_ACROSS = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                   micro_batch_size=1, order="tp-cp-pp-dp")


def _two_nodes(plan, inter_gbps, extra_ms=0.0, load=1.0, reference=None):
    """pp2 x dp2 on 2 nodes of 2 ranks: within a node the ranks measured 1 GB/s at 1 ms; the
    all-reduces between the nodes ran at `inter_gbps`. The step: the 1f1b pipeline (t0 + 4 t1,
    each stage `load` times slower), one all-reduce of AR bytes across the nodes, OTHER_MS and
    `extra_ms` of time the model does not see."""
    from commpipe.adapt.model import Measured
    from commpipe.plan.cluster import groups_on_a_node_link
    from commpipe.sim.costs import CostTable

    t0, t1 = 2 * BLOCK * C * load, (2 * BLOCK + HEAD) * C * load
    dims = plan.dims
    # each DP group ran at inter_gbps; the groups crossing a node link at once shared it, so the
    # rate recorded for the whole link (signals.collective_rates) is that many times higher
    share = groups_on_a_node_link(dims.groups("dp_cp"), lambda r: r // 2, dims.group_of("dp_cp", 0))
    links = {(a, b): (LAT_MS, 1.0) for a in range(4) for b in range(4) if a != b and a // 2 == b // 2}
    return Measured(plan, CostTable(f=[t0 / 3, t1 / 3], b=[2 * t0 / 3, 2 * t1 / 3]), 0.0,
                    t0 + 4 * t1 + AR / (inter_gbps * 1e6) + OTHER_MS + extra_ms, links=links,
                    collective_gbps={"inter_node": share * inter_gbps},
                    rank_busy={r: 4 * (t0, t1)[dims.coords(r)["pp"]] for r in range(4)},
                    reference=reference, rebuild_s=0.1, groups_s=0.9)   # the run's own build


def _degraded(plan=DP_ACROSS):
    """The link between the nodes at SLOW_GBPS, UNEXPLAINED_MS beyond what the model prices,
    with the healthy steps (INTER_GBPS) as the reference."""
    return _two_nodes(plan, SLOW_GBPS, UNEXPLAINED_MS, reference=_two_nodes(plan, INTER_GBPS))


def _decide4(measured, steps_left=1000, **acfg) -> Decision:
    from commpipe.adapt.evaluate import evaluate
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig

    cfg = measured.plan.apply(TrainConfig(model="tiny", dims=ParallelDims(pp=2, dp=2), seq_len=16,
                                          global_batch=8, micro_batch_size=1,
                                          steps=1000).resolve(4))
    return evaluate(cfg, AdaptConfig(**acfg), measured, step=20, steps_left=steps_left, world=4,
                    ranks_per_node=2, detections=[], signals={})


def _crosses_nodes(plan: Layout, dim: str) -> bool:
    dims = plan.dims
    return any(len({r // 2 for r in dims.group_of(dim, g)}) > 1 for g in range(4))


def test_the_faults_unexplained_time_stays_on_the_slow_link():
    """Healthy, the step is the model's plus OTHER_MS; degraded, the all-reduce across the nodes
    takes AR / SLOW_GBPS = 1,807.36 ms and the step UNEXPLAINED_MS more. The constant comes from
    the healthy steps, so it stays what it was, and the 300 ms go to the links between the nodes
    (the monitor measured them 500x slower): their time is multiplied by f, where
    AR f / SLOW - AR / INTER = AR / SLOW + 300 - AR / INTER, f = 1 + 300 / 1,807.36 (the
    all-reduce's latency terms cancel). A candidate that moves DP inside the nodes keeps of
    those 300 ms only what f adds to its own messages across the nodes: at most its 16
    activations (4 micro-batches, forward and backward, 2 replicas) of 4,096 bytes, each
    (f - 1) x 20.48 ms longer."""
    from commpipe.adapt.model import CostModel

    spec = _cfg().spec
    fault = _degraded()
    new = CostModel(spec, 16, 4, 2, fault)
    old = CostModel(spec, 16, 4, 2, _two_nodes(DP_ACROSS, SLOW_GBPS, UNEXPLAINED_MS))
    assert new.predict(DP_ACROSS) == pytest.approx(fault.step_ms, rel=1e-9)
    assert new.slow_links == {(a, b) for a in range(4) for b in range(4) if a // 2 != b // 2}
    slow_ar_ms = AR / (SLOW_GBPS * 1e6)
    f = 1 + UNEXPLAINED_MS / slow_ar_ms
    assert new.fault_factor == pytest.approx(f, rel=1e-6)
    healthy = CostModel(spec, 16, 4, 2, fault.reference)
    assert new.other_ms == pytest.approx(healthy.other_ms, abs=1e-6)
    assert new.other_ms == pytest.approx(old.other_ms - UNEXPLAINED_MS, abs=1e-6)
    replaced = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                      micro_batch_size=1)          # DP inside the nodes
    on_link = 16 * (f - 1) * 4096 / (SLOW_GBPS * 1e6)
    assert old.predict(replaced) - UNEXPLAINED_MS <= new.predict(replaced) \
        <= old.predict(replaced) - UNEXPLAINED_MS + on_link + 1e-6


def test_a_slow_link_the_model_over_prices_is_scaled_down_not_carried_into_every_candidate():
    """The degraded step measured UNEXPLAINED_MS *less* than the model prices it (the slow
    link's rate comes from sampled transfers, and read low). The slow links' time is scaled by
    f = 1 - 300 / 1,807.36 so the running plan predicts its step, and the healthy constant
    stays: a candidate with DP inside the nodes is predicted as with the link priced right
    (less only what f takes off its own 16 activations across the nodes), not 300 ms faster,
    as a negative constant would make it (in a MoE run, negative step times)."""
    from commpipe.adapt.model import CostModel

    spec = _cfg().spec
    healthy = _two_nodes(DP_ACROSS, INTER_GBPS)
    fault = _two_nodes(DP_ACROSS, SLOW_GBPS, -UNEXPLAINED_MS, reference=healthy)
    new = CostModel(spec, 16, 4, 2, fault)
    exact = CostModel(spec, 16, 4, 2, _two_nodes(DP_ACROSS, SLOW_GBPS, 0.0, reference=healthy))
    assert new.predict(DP_ACROSS) == pytest.approx(fault.step_ms, rel=1e-9)
    f = 1 - UNEXPLAINED_MS / (AR / (SLOW_GBPS * 1e6))
    assert exact.fault_factor == 1.0 and new.fault_factor == pytest.approx(f, rel=1e-6)
    assert new.other_ms == pytest.approx(CostModel(spec, 16, 4, 2, healthy).other_ms, abs=1e-6)
    replaced = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                      micro_batch_size=1)
    on_link = 16 * (1 - f) * 4096 / (SLOW_GBPS * 1e6)
    assert exact.predict(replaced) - on_link - 1e-6 <= new.predict(replaced) \
        <= exact.predict(replaced) + 1e-6
    # over-priced by nearly the whole all-reduce (1,806 of its 1,807.36 ms): the factor that
    # would explain it, 7.5e-4, would price the slow link faster than it ran healthy; it stops at
    # SLOW / INTER = 0.002 (the link back at its healthy rate), the rest stays in the constant
    nearly = _two_nodes(DP_ACROSS, SLOW_GBPS, -1806.0, reference=healthy)
    clamped = CostModel(spec, 16, 4, 2, nearly)
    assert clamped.fault_factor == pytest.approx(SLOW_GBPS / INTER_GBPS, rel=1e-9)
    assert clamped.link(0, 2)[1] == pytest.approx(CostModel(spec, 16, 4, 2, healthy).link(0, 2)[1])
    assert clamped.predict(DP_ACROSS) == pytest.approx(nearly.step_ms, rel=1e-9)


def test_a_replacement_predicted_best_is_chosen_and_moves_its_state_inside_the_nodes():
    """Degraded as above, the same degrees in Megatron's order (DP inside the nodes) are
    predicted fastest. The switch moves only what the ranks that change stage lack: rank 1
    (stage 1 -> 0) takes stage 0 from rank 0 and rank 2 (0 -> 1) stage 1 from rank 3, each on
    its own node at 1 GB/s: 1.0 s of rebuilding and STAGE1 bytes / 1 GB/s. Priced at the slow
    link's rate (or sent by the lowest holder, rank 1 -> 2 across the nodes) it would cost
    seconds. pp4 needs one layer on ranks 1 and 2, from ranks 0 and 3."""
    d = _decide4(_degraded())
    assert d.action == "switch" and d.kind == "replace", d.reason
    assert d.to["order"] == "tp-cp-dp-pp" and d.to["pp"] == d.to["dp"] == 2
    assert d.candidates[0]["plan"] == d.to["name"] and d.trials[0]["plan"] == d.to["name"]
    assert d.switch_cost_s == pytest.approx(1.0 + STAGE1 / 1e9, rel=1e-9)
    pp4 = next(c for c in d.candidates if c["plan"].startswith("tp1-cp1-pp4-dp1 1f1b"))
    assert pp4["switch_cost_s"] == pytest.approx(1.0 + 12 * 36_992 / 1e9, rel=1e-9)


def test_a_candidate_keeping_dp_on_the_slow_link_is_not_trialled():
    """Re-batches, rebalances and re-splits of the running plan keep its DP all-reduce across
    the degraded link: predicted near the running step (~2.2 s), beyond the CPU interval of
    the best (~0.17 s) and so not trialled, though the switch to them is the cheapest."""
    from commpipe.adapt.candidates import candidates
    from commpipe.adapt.model import CostModel

    spec = _cfg().spec
    named = {p.title: p for p in candidates(DP_ACROSS, CostModel(spec, 16, 4, 2, _degraded()),
                                           spec, 16, 8, 4, 2, AdaptConfig())}
    d = _decide4(_degraded(), logged_candidates=len(named))
    trialled = [named[t["plan"]] for t in d.trials]
    assert trialled
    assert not any(_crosses_nodes(p, dim) for p in trialled for dim in ("dp_cp", "tp"))
    kept = [c for c in d.candidates if _crosses_nodes(named[c["plan"]], "dp_cp")]
    assert kept and min(c["switch_cost_s"] for c in kept) == pytest.approx(0.1)


def test_a_host_wide_slowdown_with_no_slow_link_stays():
    """Every rank's compute 30% slower and 100 ms more per step elsewhere (host load), the links
    as healthy: nothing was measured slow, so the 100 ms stay a constant of every candidate
    and the healthy plan, the best there (zbh1, DP inside the nodes), stays the best. (The
    synthetic step counts an all-reduce across the nodes either way; the calibration takes the
    difference as the constant.)"""
    from commpipe.adapt.model import CostModel

    cur = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="zbh1", microbatches=4,
                 micro_batch_size=1)
    healthy = _two_nodes(cur, INTER_GBPS)
    loaded = _two_nodes(cur, INTER_GBPS, 100.0, load=1.3, reference=healthy)
    assert _decide4(healthy).action == "stay"
    model = CostModel(_cfg().spec, 16, 4, 2, loaded)
    assert model.slow_links == set() and model.slow_ranks == set()
    assert model.fault_factor == 1.0
    d = _decide4(loaded)
    assert d.action == "stay", (d.to, d.reason)
    assert d.predicted_current_ms == pytest.approx(loaded.step_ms, rel=1e-9)


def test_a_plan_that_left_the_slow_link_still_prices_it_at_its_last_measured_rate():
    """After the switch off the slow link the running plan sends no collective over it: its
    window measures no inter-node rate. The controller recalls the last rate an earlier plan
    measured instead of the class's default: the whole node link's, 2 x SLOW_GBPS (the degraded
    plan's two DP groups each ran at SLOW_GBPS through it at once). So DP across the nodes again
    (ranks 0 and 2 beside 1 and 3) is priced at SLOW_GBPS: AR bytes once around a 2-rank ring,
    1.81 s, plus its two latency steps; without the memory the model prices it at the default."""
    from commpipe.adapt.config import AdaptConfig
    from commpipe.adapt.model import CostModel
    from commpipe.adapt.rates import KnownRates
    from commpipe.models.family import family_for_model

    memory = KnownRates()
    memory.recall(_degraded(), learn=True)
    assert memory.collective == {"inter_node": 2 * SLOW_GBPS}
    off = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                 micro_batch_size=1)          # DP inside the nodes
    spec = family_for_model("tiny").resolve("tiny")

    def now():
        m = _two_nodes(off, INTER_GBPS)
        m.collective_gbps = {}                            # nothing crossed the nodes
        return m

    forgetful = CostModel(spec, 16, 4, 2, now())
    m = now()
    memory.recall(m, learn=True)
    assert m.collective_gbps == {"inter_node": 2 * SLOW_GBPS}
    recalled = CostModel(spec, 16, 4, 2, m)
    assert recalled.all_reduce_ms(AR, [0, 2], DP_ACROSS, "dp_cp") == pytest.approx(
        AR / (SLOW_GBPS * 1e6) + 2 * LAT_MS, rel=1e-6)
    default = AdaptConfig().default_inter_gbps
    assert forgetful.all_reduce_ms(AR, [0, 2]) == pytest.approx(
        AR / (default * 1e6) + 2 * LAT_MS, rel=1e-6)
    # what the running plan measures itself replaces what was known
    memory.recall(_two_nodes(DP_ACROSS, INTER_GBPS), learn=True)
    assert memory.collective == {"inter_node": 2 * INTER_GBPS}


# -- groups sharing a node's link -------------------------------------------------------------------

@pytest.mark.parametrize("groups, group, expected", [
    ([[0, 1, 2, 3]], [0, 1, 2, 3], 1),                  # dp4: one ring across the two nodes
    ([[0, 2], [1, 3]], [0, 2], 2),                      # tp2 x dp2: both DP groups cross
    ([[0, 1], [2, 3]], [0, 1], 1),                      # inside a node: no node link
    ([[0, 2, 4, 6], [1, 3, 5, 7]], [1, 3, 5, 7], 2),    # 4 nodes of 2: two rings per node
    ([[0, 1], [2, 4], [3, 5]], [2, 4], 2),              # node 1 (2, 3) sends two groups' traffic
])
def test_groups_crossing_the_same_node_link_are_counted_on_the_busiest_node(groups, group,
                                                                          expected):
    from commpipe.plan.cluster import groups_on_a_node_link

    assert groups_on_a_node_link(groups, lambda r: r // 2, group) == expected


def test_a_candidate_gets_its_share_of_the_node_link():
    """Measured.collective_gbps across nodes is a whole node link's rate: here 2 x INTER_GBPS,
    recorded from pp2 x dp2 with DP across the nodes, whose two DP groups, (0, 2) and (1, 3),
    each ran at INTER_GBPS through each node's link at once. dp4 runs one ring through it and
    gets it whole; the running plan's groups get INTER_GBPS again. The bandwidth term of an
    all-reduce over n ranks is 2 (n - 1) / n * bytes / rate (the latency steps cancel in the
    difference); without a plan nothing is shared."""
    from commpipe.adapt.model import CostModel

    m = CostModel(_cfg().spec, 16, 4, 2, _two_nodes(DP_ACROSS, INTER_GBPS))
    assert m.m.collective_gbps == {"inter_node": 2 * INTER_GBPS}

    def per_byte(plan, ranks):      # ms per byte
        return (m.all_reduce_ms(2e6, ranks, plan, "dp_cp")
                - m.all_reduce_ms(1e6, ranks, plan, "dp_cp")) / 1e6

    dp4 = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                 micro_batch_size=1)
    assert per_byte(dp4, [0, 1, 2, 3]) == pytest.approx(1e3 * 1.5 / (2 * INTER_GBPS * 1e9))
    assert per_byte(DP_ACROSS, [0, 2]) == pytest.approx(1e3 * 1.0 / (INTER_GBPS * 1e9))
    assert per_byte(None, [0, 2]) == pytest.approx(1e3 * 1.0 / (2 * INTER_GBPS * 1e9))


def test_a_rate_timed_on_groups_sharing_a_node_link_is_recorded_for_the_whole_link():
    """Two DP groups crossing the nodes at once, (0, 2) and (1, 3), each moved 1 MB in 10 ms:
    0.1 GB/s each, so the node link carried 0.2 GB/s, the rate recorded (and recalled by later
    plans, whose own groups then get their share of it). One group alone: its own rate."""
    from commpipe.adapt.signals import collective_rates

    def call(rank, group):
        return {("dp", "all_reduce", group): [(1e6, 0.0, 0.010)]}

    both = [{"rank": r, "timed": call(r, (r % 2, r % 2 + 2))} for r in range(4)]
    assert collective_rates([both], ranks_per_node=2, min_bytes=65536) == \
        {"inter_node": pytest.approx(0.2)}
    one = [{"rank": r, "timed": call(r, (0, 2))} for r in (0, 2)]
    assert collective_rates([one], ranks_per_node=2, min_bytes=65536) == \
        {"inter_node": pytest.approx(0.1)}


def test_a_moe_steps_dense_and_expert_reductions_share_the_node_link_they_ran_on_together():
    """A MoE step of dp4 x ep2 on 2 nodes of 2: the dense buckets' all-reduce over dp x cp
    (0, 1, 2, 3) and the experts' over edp (0, 2) and (1, 3) are in flight together, three
    groups crossing the one node link. Each moved 1 MB (bus bytes) in 30 ms, 1/30 GB/s
    apiece, so the link carried 0.1 GB/s: the rate recorded. Counting each dimension alone
    (1 dp_cp group, 2 edp groups) records half of it or less, and a later plan's reductions,
    added up at their shares, would be priced at twice their time or more."""
    from commpipe.adapt.signals import collective_rates
    from commpipe.monitor.records import busbw_factor

    def call(group):
        return [(1e6 / busbw_factor("all_reduce", len(group)), 0.0, 0.030)]

    step = [{"rank": r, "timed": {("dp_cp", "all_reduce", (0, 1, 2, 3)): call((0, 1, 2, 3)),
                                  ("edp", "all_reduce", (r % 2, r % 2 + 2)): call((0, 2))}}
            for r in range(4)]
    assert collective_rates([step], ranks_per_node=2, min_bytes=65536) == \
        {"inter_node": pytest.approx(0.1)}
