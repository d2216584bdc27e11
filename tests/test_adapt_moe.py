"""Adaptive training of a Mixture-of-Experts model: layouts that include expert parallelism.

    python -m pytest tests/test_adapt_moe.py -q

Without a launch: the candidates of a MoE run include every ep the layouts admit (ep divides
dp*cp and the expert count, commpipe.parallel.expert.check_ep) and a LLaMA run's only ep 1; the
cost model's EP all-to-all is the planner's (commpipe.plan.moe_costs) for the same bytes and
link rates, and a hand-derived (ep-1)/ep x bytes / rate + latency.

One launch of 4 gloo processes (tests/test_moe_parallel.py's 4-layer MoE, 4 experts): a run on
ep2 x pp2 x dp2 switches in memory (commpipe.adapt.switch, as the controller does) to ep4 x dp4
(pp1), then to ep1 x pp2 x dp2, then to tp2 x ep2 x dp2 (each expert's width split over TP too:
commpipe.parallel.tensor_moe). Across each switch every full tensor (experts gathered over EP,
AdamW moments included) is bit-identical; the steps after each switch give the losses of a
static run of the new layout loaded from a checkpoint of the same state (DCP reshards the
experts by their offsets, another path than the switch's gather), and the whole switched run
gives the single-device reference's losses (tests/test_equivalence.py's tolerance). A planted
bug, a switch that slices each rank's experts at the next rank's offset, is caught by the
comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from commpipe.adapt.config import AdaptConfig
from commpipe.layout import Layout
from commpipe.parallel.placement import placement
from tests.dist_harness import spawn
from tests.test_equivalence import LOSS_RTOL, check_params
from tests.test_moe_parallel import moe_cfg, moe_reference_run, one_thread

BEFORE, MIDDLE, AFTER = 2, 2, 1       # steps before the first switch, between, after the second
START = Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
               micro_batch_size=1, ep=2)
PLANS = (Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                micro_batch_size=1, ep=4),        # another ep and pp
         Layout(tp=1, cp=1, pp=2, dp=2, stage_layers=(2, 2), schedule="1f1b", microbatches=4,
                micro_batch_size=1),            # experts whole again (ep 1)
         Layout(tp=2, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b", microbatches=4,
                micro_batch_size=1, ep=2))        # each expert split over tp2 too
SPANS = (MIDDLE, AFTER, AFTER)                               # steps after each switch


def _cfg(plan: Layout = START):
    from commpipe.parallel.dims import ParallelDims

    cfg = moe_cfg(ParallelDims(dp=plan.dp, pp=plan.pp), ep=plan.ep)
    cfg.steps = BEFORE + sum(SPANS)            # the learning-rate schedule of the whole run
    return cfg


# -- without a launch ------------------------------------------------------------------------------

def _measured(plan: Layout, links: dict | None = None):
    """A synthetic measurement of `plan` (two stages of 10 ms F+B per micro-batch)."""
    from commpipe.adapt.model import Measured
    from commpipe.sim.costs import CostTable

    world = plan.tp * plan.cp * plan.pp * plan.dp
    return Measured(plan, CostTable(f=[10 / 3] * plan.pp, b=[20 / 3] * plan.pp), host_ms=0.0,
                    step_ms=10.0 * (plan.microbatches + plan.pp) + 5.0, links=links or {},
                    rank_busy={r: 10.0 * plan.microbatches for r in range(world)})


def _layout_key(p: Layout) -> tuple:
    return p.tp, p.cp, p.pp, p.dp, p.ep


def test_candidates_of_a_moe_run_include_every_feasible_ep():
    from commpipe.adapt.candidates import candidates
    from commpipe.adapt.evaluate import evaluate
    from commpipe.adapt.model import CostModel

    cfg = START.apply(_cfg())
    model = CostModel(cfg.spec, cfg.seq_len, 4, 4, _measured(START))
    found = candidates(START, model, cfg.spec, cfg.seq_len, cfg.global_batch, 4, 4,
                       AdaptConfig())
    keys = {_layout_key(p) for p in found}
    # the rule, by hand: ep divides dp (cp is 1 for MoE) and the 4 experts
    for tp, pp, dp in ((1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 4, 1)):
        want = {e for e in (1, 2, 4) if dp % e == 0}
        got = {k[4] for k in keys if k[:4] == (tp, 1, pp, dp)}
        assert got == want, (tp, pp, dp)      # the running ep too: re-splits, re-batches
    assert all(k[1] == 1 for k in keys), "context parallelism is not applied to MoE models"
    assert all(p.ep == 2 for p in found if p.kind_of_switch(START) == "resplit")
    assert (1, 1, 2, 2, 1) in keys                 # the running degrees with another ep
    # the balancing loss is per micro-batch: every plan keeps the running micro-batch size,
    # where a dense run's candidates re-batch too (test_candidates_of_a_llama_run_keep_ep_1)
    assert {p.micro_batch_size for p in found} == {START.micro_batch_size}
    assert START.kind_of_switch(PLANS[1]) == "reshard"       # another ep: new groups
    # the whole evaluation runs on it and names the ep of what it prices
    d = evaluate(cfg, AdaptConfig(trials=0), _measured(START), step=5, steps_left=100,
                 world=4, ranks_per_node=4, detections=[], signals={})
    assert d.candidates_considered == len(found)
    assert any(c["plan"].startswith("ep4-") for c in d.candidates)


def test_candidates_of_a_llama_run_keep_ep_1():
    from commpipe.adapt.candidates import candidates
    from commpipe.adapt.model import CostModel
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig

    cfg = TrainConfig(model="tiny", dims=ParallelDims(pp=2, dp=2), seq_len=16, global_batch=8,
                      steps=10).resolve(4)
    cur = Layout.of(cfg)
    model = CostModel(cfg.spec, 16, 4, 4, _measured(cur))
    found = candidates(cur, model, cfg.spec, 16, 8, 4, 4, AdaptConfig())
    assert found and {p.ep for p in found} == {1}
    assert len({p.micro_batch_size for p in found}) > 1
    assert cur.ep == 1 and not cur.title.startswith("ep")      # LLaMA plans read as before


def test_plan_round_trips_ep():
    import json


    plan = PLANS[0]
    assert Layout.from_record(json.loads(json.dumps(plan.record()))) == plan
    assert plan.title.startswith("ep4-tp1-cp1-pp1-dp4 ")
    cfg = plan.apply(_cfg())
    assert cfg.ep == 4 and Layout.of(cfg) == plan
    from commpipe.train.config import layout_label

    assert layout_label(cfg) == plan.title      # the metrics' layout names the plan


def test_the_switch_cost_moves_whole_moe_layers():
    """pp2 -> pp1: a stage-0 rank lacks stage 1's two layers and the head. A layer of the test
    model (h 32, 4 heads, 2 KV heads of 8, 4 experts and 1 shared of width 16, vocab 128):
    attention 32*(32+2*16) + 32*32 = 3,072, norms 64, router 128, experts 5 x 3*32*16 = 7,680:
    10,944 parameters; the head 128*32 + 32; 12 bytes each (fp32 value and two moments)."""
    from commpipe.adapt.plan import moved_bytes

    spec = _cfg().resolve(4).spec
    assert moved_bytes(START, PLANS[0], spec) == 12 * (2 * 10_944 + 128 * 32 + 32)


@pytest.mark.parametrize("rpn, ranks", [(4, [0, 1]), (4, [0, 1, 2, 3]), (2, [0, 1, 2, 3])])
def test_the_ep_all_to_all_is_the_planners(rpn, ranks):
    """The cost model's dispatch (or combine) in EP group `ranks` equals
    commpipe.plan.moe_costs for the same bytes and the rates measured between its ranks, and
    the alpha-beta formula by hand; each link class at the group's slowest measured pair."""
    from commpipe.adapt.model import CostModel
    from commpipe.adapt.model_links import MEASURED_RUN
    from commpipe.adapt.model_moe import a2a_ms
    from commpipe.layout import Layout
    from commpipe.plan.cluster import Cluster, Link
    from commpipe.plan.layout import Job
    from commpipe.plan.moe_costs import a2a_seconds

    ep = len(ranks)
    plan = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                  micro_batch_size=1, ep=ep)
    fast, slow = 2.0, 0.25                       # GB/s: inside a node, across nodes
    links = {(a, b): (0.1, fast if a // rpn == b // rpn else slow)
             for a in range(4) for b in range(4) if a != b}
    intra = 1.0                                  # the group's slowest pair inside a node
    links[0, 1] = links[1, 0] = (0.1, intra)
    cfg = plan.apply(_cfg())
    model = CostModel(cfg.spec, cfg.seq_len, 4, rpn, _measured(plan, links))
    got = a2a_ms(model, plan, ranks)
    lat = model.base_latency / 1e3
    assert lat == pytest.approx(1e-4)
    # the planner with one scale-out link per node (the controller's premise, as its DP share)
    cluster = Cluster(MEASURED_RUN, 4, rpn, intra=Link(intra, lat), inter=Link(slow, lat),
                      backend="gloo", nics_per_node=1)
    layout = Layout(1, 1, 1, 4, 1, 1, "1f1b", ep=ep)
    job = Job(8, cfg.seq_len, precision="fp32")
    assert got == pytest.approx(1e3 * a2a_seconds(cfg.spec, layout, job, cluster), rel=1e-12)
    # by hand: a rank's 16 tokens x top_k 2 x imbalance 1.25 rows of h=32 fp32 values
    nbytes = 16 * 2 * 1.25 * 32 * 4
    if rpn >= ep:       # one node: (ep-1)/ep of it over the node's links
        want = (ep - 1) / ep * nbytes / (intra * 1e9) + lat
    else:               # two ranks per node: a peer inside over the node, two across, and
        # both ranks of the node send their share across its one link at once: half its rate
        want = max(1 / ep * nbytes / (intra * 1e9), 2 / ep * nbytes / (slow / 2 * 1e9)) + lat
    assert got == pytest.approx(1e3 * want, rel=1e-12)
    # each MoE layer of a stage adds a dispatch and a combine to the stage's F and to its B
    bare = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                  micro_batch_size=1, ep=1)
    _, with_ep = model.components(plan)
    _, without = model.components(bare)
    dp_diff = model._dp_ms(plan) - model._dp_ms(bare)
    moe_layers = cfg.spec.moe_layers             # the model's MoE layers (not its dense first)
    assert with_ep - without - dp_diff == pytest.approx(2 * 2 * moe_layers * 2 * got, rel=1e-9)


def test_the_experts_gradients_cross_a_node_link_at_their_groups_share():
    """dp4 x ep2 on nodes of 2: the edp groups {0, 2} and {1, 3} (the ranks holding the same
    experts) both cross between the nodes and reduce at once, so each gets half the link's
    measured rate; the rest reduces over the dp4 ring, alone on the link."""
    from commpipe.adapt.model import CostModel
    from commpipe.adapt.model_moe import edp_group, stage_params

    plan = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                  micro_batch_size=1, ep=2)
    links = {(a, b): (0.1, 2.0 if a // 2 == b // 2 else 0.25)
             for a in range(4) for b in range(4) if a != b}
    cfg = plan.apply(_cfg())
    model = CostModel(cfg.spec, cfg.seq_len, 4, 2, _measured(plan, links))
    assert edp_group(plan) == [0, 2]
    assert model.link_share(plan, "edp", [0, 2]) == 2
    shared, experts = stage_params(cfg.spec, plan, 0)
    whole = model._reduction_ms(4.0 * shared, [0, 1, 2, 3], plan)
    halved = model._reduction_ms(4.0 * experts / 2, [0, 2], plan, "edp")
    assert halved > model._reduction_ms(4.0 * experts / 2, [0, 2])      # at the whole link
    assert model._dp_ms(plan) == pytest.approx(whole + halved, rel=1e-12)


# -- switching in memory (4 processes) -------------------------------------------------------------

def _worker(rank: int, world: int, outdir: str) -> dict:
    import commpipe.adapt.switch as sw
    from commpipe.parallel.comm import Comm
    from commpipe.train import checkpoint
    from commpipe.train.loop import Trainer

    def build(plan):
        cfg = plan.apply(_cfg())
        return Trainer.build(cfg, Comm(cfg.dims, rank))

    def steps(trainer, n):
        return [trainer.train_step()["loss"] for _ in range(n)]

    def merged(trainer):      # every full tensor of the model, experts gathered whole
        out = {}
        for part in trainer.comm.gather_objects(sw.held_state(trainer), "world"):
            out.update(part)
        return out

    def params(trainer):      # {name: full parameter}
        return {k[len("model."):]: v for k, v in merged(trainer).items() if k.startswith("model.")}

    res: dict = {"kept": [], "static": [], "layouts": [], "params": [], "static_params": []}
    tr = build(START)
    res["switched"] = steps(tr, BEFORE)
    ckpts = []
    for i, (plan, n) in enumerate(zip(PLANS, SPANS)):
        ckpts.append(checkpoint.save(tr, Path(outdir) / f"ckpt{i}"))
        before = merged(tr)
        tr, _ = sw.switch(tr, plan)
        mine = sw.held_state(tr)
        res["kept"].append((len(mine), all(torch.equal(v, before[k]) for k, v in mine.items()),
                            sum(k.endswith(".exp_avg") for k in mine) == len(tr.named_params),
                            merged(tr).keys() == before.keys()))
        res["layouts"].append((tr.cfg.ep, tr.comm.size("ep"), str(tr.cfg.dims)))
        res["switched"] += steps(tr, n)
        res["params"].append(params(tr))
        static = build(plan)                 # the new layout, from a checkpoint of the state
        checkpoint.load(static, ckpts[i])
        res["static"].append(steps(static, n))
        res["static_params"].append(params(static))

    # a planted bug: the switch slices each rank's experts (and moments) at the next rank's
    # offset, so every expert's rows hold another expert's weights
    def next_offset(full, p, comm):
        if not placement(p).ep_sharded:
            return full
        n = comm.size("ep")
        return full.chunk(n, dim=0)[(comm.local_rank("ep") + 1) % n]

    bad = build(START)
    checkpoint.load(bad, ckpts[0])
    sw.shard_ep, kept = next_offset, sw.shard_ep
    try:
        bad, _ = sw.switch(bad, PLANS[0])
    finally:
        sw.shard_ep = kept
    res["planted"] = steps(bad, MIDDLE)
    return res


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(_worker, 4, str(tmp_path_factory.mktemp("adapt_moe")))


@pytest.fixture(scope="module")
def reference():
    with one_thread():
        return moe_reference_run(_cfg())


def _close(got, want, label):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{label}: {m}")


def test_switches_across_ep_keep_every_tensor_bit_for_bit(four_ranks):
    for res in four_ranks:
        assert [x[:2] for x in res["layouts"]] == [(4, 4), (1, 1), (2, 2)]
        for n, own_ok, every_optim, same_items in res["kept"]:
            assert n > 0 and own_ok, "a rank holds a changed expert or moment after a switch"
            assert every_optim and same_items


def _params(named: dict) -> dict:
    return {"params": named, "replicas_equal": True}   # gathered whole: one value per name


def test_losses_and_parameters_after_each_switch_equal_a_static_run_of_the_new_layout(
        four_ranks):
    for res in four_ranks:
        got = res["switched"]
        ends = [BEFORE + sum(SPANS[:i + 1]) for i in range(len(SPANS))]
        labels = ("ep4 x dp4", "ep1 x pp2 x dp2", "tp2 x ep2 x dp2")
        for i, label in enumerate(labels):
            span = slice(ends[i] - SPANS[i], ends[i])
            _close(got[span], res["static"][i], f"switched vs static {label}")
            check_params(_params(res["static_params"][i]), _params(res["params"][i]),
                         f"switched vs static {label}")


def test_the_switched_run_equals_the_single_device_reference(four_ranks, reference):
    got = four_ranks[0]["switched"]
    losses = reference["losses"]
    assert len(got) == len(losses) == BEFORE + sum(SPANS)
    label = "ep2 x pp2 x dp2 -> ep4 x dp4 -> ep1 x pp2 x dp2 -> tp2 x ep2 x dp2 vs one device"
    _close(got, losses, label)
    check_params(reference, _params(four_ranks[0]["params"][-1]), label)
    assert max(losses) - min(losses) > 1e-3      # the losses move: not vacuous


def test_a_switch_that_misplaces_the_experts_is_caught(four_ranks):
    planted, static = four_ranks[0]["planted"], four_ranks[0]["static"][0]
    with pytest.raises(AssertionError):
        _close(planted, static, "planted")


def test_rebalances_of_an_ep_run_share_micro_batches_between_ep_groups():
    # ep2 x dp4: replicas (0, 1) and (2, 3) are two EP groups; rank 3 at three times the
    # compute. Each group runs one count (check_ep_blocks), the slow group fewer, the total kept
    from commpipe.adapt.candidates import candidates, rebalances
    from commpipe.adapt.model import CostModel
    from commpipe.train.dp_split import check_ep_blocks

    cur = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                 micro_batch_size=1, ep=2)
    cfg = cur.apply(_cfg(cur))
    measured = _measured(cur)
    measured.rank_busy[3] *= 3.0
    model = CostModel(cfg.spec, cfg.seq_len, 4, 4, measured)
    found = rebalances(cur, model)
    assert found
    for plan in found:
        c = plan.dp_microbatches or (cur.microbatches,) * 4
        check_ep_blocks(c, 2)
        assert sum(c) == 8 and c[0] == c[1] and c[2] == c[3]
    assert any(p.dp_microbatches and p.dp_microbatches[2] < p.dp_microbatches[0] for p in found)
    everything = candidates(cur, model, cfg.spec, cfg.seq_len, cfg.global_batch, 4, 4,
                            AdaptConfig(rebalance=True))
    assert any(p.dp_microbatches for p in everything)
