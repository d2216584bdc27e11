"""The `rebalance` reaction on synthetic measurements, no launch: a compute straggler inside a
DP replica gets fewer micro-batches, priced by the controller's model against hand-derived
values.

    python -m pytest tests/test_adapt_rebalance.py -q

The synthetic run: the tiny LLaMA (4 blocks + head) on dp=2, 1f1b, 4 micro-batches of 1 per
replica (global batch 8), one rank per replica. A healthy micro-batch takes T = 10 ms (F+B);
rank 1 (DP replica 1, not the replica whose timeline is calibrated) takes `slow` x T.
"""

from __future__ import annotations

import pytest

from commpipe.adapt.config import AdaptConfig
from commpipe.layout import Layout

T, OTHER_MS = 10.0, 5.0
CUR = Layout(tp=1, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b", microbatches=4, micro_batch_size=1)


def _cfg():
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig

    return TrainConfig(model="tiny", dims=ParallelDims(dp=2), seq_len=16, global_batch=8,
                       micro_batch_size=1, steps=1000).resolve(2)


def _measured(slow: float, plan: Layout = CUR):
    """Replica 0's timeline (healthy) calibrates the stage; each rank's compute per step is its
    micro-batches x its time; the step waits for the slower replica."""
    from commpipe.adapt.model import Measured
    from commpipe.sim.costs import CostTable

    m = plan.dp_microbatches or (plan.microbatches,) * 2
    busy = {0: m[0] * T, 1: m[1] * T * slow}
    return Measured(plan, CostTable(f=[T / 3], b=[2 * T / 3]), host_ms=0.0,
                    step_ms=max(busy.values()) + OTHER_MS, rank_busy=busy)


def _decide(measured, **acfg):
    from commpipe.adapt.evaluate import evaluate

    cfg = measured.plan.apply(_cfg())
    return evaluate(cfg, AdaptConfig(**acfg), measured, step=20, steps_left=1000, world=2,
                    ranks_per_node=2, detections=[], signals={})


def test_a_straggler_in_another_replica_is_seen_and_gets_fewer_microbatches():
    d = _decide(_measured(slow=3.0), trials=0, layouts=False)
    assert d.model["slowdown"] == {"0": 1.0, "1": pytest.approx(3.0)}
    assert d.action == "switch" and d.kind == "rebalance", d.reason
    # speeds 1 : 1/3 of 8 micro-batches: 6 and 2, each replica 6 T = 60 ms instead of 4 x 3 T
    assert d.to["dp_microbatches"] == [6, 2]
    assert d.to["stage_layers"] == [4] and d.to["microbatches"] == 4
    assert d.predicted_current_ms == pytest.approx(12 * T + OTHER_MS)
    assert d.predicted_best_ms == pytest.approx(6 * T + OTHER_MS, rel=1e-6)
    # the neighbours are priced too: 5,3 leaves replica 1 at 9 T
    near = next(c for c in d.candidates if c["plan"].endswith("dp-m 5,3"))
    assert near["predicted_ms"] == pytest.approx(9 * T + OTHER_MS, rel=1e-6)
    assert near["kind"] == "rebalance"


def test_a_healthy_run_stays_even_and_a_recovered_one_goes_back():
    d = _decide(_measured(slow=1.0), trials=0, layouts=False)
    assert d.action == "stay" and all("dp-m" not in c["plan"] or c["predicted_ms"] >
                                      d.predicted_current_ms for c in d.candidates)
    # running 6,2 after the straggler recovered: 6 T on replica 0, the even split is 4 T
    back = _decide(_measured(slow=1.0, plan=Layout(tp=1, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b",
                                                   microbatches=4, micro_batch_size=1,
                                                   dp_microbatches=(6, 2))),
                   trials=0, layouts=False)
    even = next(c for c in back.candidates if c["plan"] == CUR.title)
    assert even["kind"] == "rebalance"
    assert even["predicted_ms"] == pytest.approx(4 * T + OTHER_MS, rel=1e-6)
    # it goes to an even split (a re-batching to 2 x 2 ties with it)
    assert back.action == "switch" and back.to["dp_microbatches"] == []
    assert back.predicted_best_ms == pytest.approx(even["predicted_ms"])


def test_plan_records_and_labels_the_split():
    p = Layout(tp=1, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b", microbatches=4, micro_batch_size=1,
               dp_microbatches=[6, 2])
    assert p.dp_microbatches == (6, 2) and p.title.endswith("dp-m 6,2")
    assert Layout.from_record(p.record()) == p
    assert CUR.kind_of_switch(p) == "rebalance" and p.apply(_cfg()).dp_microbatches == (6, 2)
