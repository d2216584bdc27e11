"""The `rebalance` reaction is exact at the switch: after an in-memory switch from even DP shares
to uneven ones (commpipe.adapt.switch, as the controller makes it), the losses of the next steps
equal those of a static run started with the same `--dp-microbatches` from a checkpoint of the
same state, and every loss equals the single-device reference.

    python -m pytest tests/test_adapt_rebalance_exact.py -q

One launch of 2 gloo processes (dp=2, the tiny LLaMA, global batch 8 of micro-batches of 1: 4
per replica, then 6 and 2). A new micro-batching drifts from the old one as any float run does,
so the static run it is compared with has the same micro-batching; the single-device reference
(tests/reference.py) bounds both with test_equivalence's tolerance. A planted bug, a switch whose
replicas average their gradients instead of weighting them by sample count, is caught by the
same comparison.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.dist_harness import spawn
from tests.test_equivalence import LOSS_RTOL, make_cfg

BEFORE, AFTER = 3, 4          # steps before the switch, steps compared after it
COUNTS = (6, 2)               # replica 1 (the slower one) gets fewer micro-batches


def _cfg(counts=None):
    from commpipe.parallel.dims import ParallelDims

    cfg = make_cfg(ParallelDims(dp=2), "1f1b", dp_microbatches=counts)
    cfg.steps = BEFORE + AFTER      # the learning-rate schedule of the whole run
    return cfg


def _worker(rank: int, world: int, outdir: str) -> dict:
    from commpipe.adapt.switch import switch
    from commpipe.layout import Layout
    from commpipe.parallel.comm import Comm
    from commpipe.train import checkpoint
    from commpipe.train.loop import Trainer
    from tests.test_dp_uneven import plant_mean_of_replicas

    def build(counts=None):
        cfg = _cfg(counts).resolve(world)
        return Trainer.build(cfg, Comm(cfg.dims, rank))

    def steps(trainer, n):
        return [trainer.train_step()["loss"] for _ in range(n)]

    res: dict = {}
    # even shares, then the controller's rebalance: the same plan with uneven counts
    tr = build()
    res["before"] = steps(tr, BEFORE)
    path = checkpoint.save(tr, Path(outdir) / "ckpt")
    plan = dataclasses.replace(Layout.of(tr.cfg), dp_microbatches=COUNTS)
    res["phases"] = {}
    tr, res["switch_s"] = switch(tr, plan, res["phases"])
    res["counts"] = tr.cfg.dp_microbatches
    res["switched"] = steps(tr, AFTER)

    # static: --dp-microbatches 6,2 from the checkpoint of the same state
    st = build(COUNTS)
    checkpoint.load(st, path)
    res["static"] = steps(st, AFTER)

    # a planted bug: the switched replicas average their gradients
    bad = build()
    checkpoint.load(bad, path)
    bad, _ = switch(bad, plan)
    plant_mean_of_replicas(bad)
    res["planted"] = steps(bad, AFTER)
    return res


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(_worker, 2, str(tmp_path_factory.mktemp("rebalance")))


@pytest.fixture(scope="module")
def reference():
    from tests.reference import reference_run

    return reference_run(_cfg())["losses"]


def _close(got, want, label):
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{label}: {m}")


def test_losses_after_a_rebalance_equal_a_static_run_with_the_same_counts(two_ranks):
    for res in two_ranks:
        assert tuple(res["counts"]) == COUNTS
        _close(res["switched"], res["static"], "switched vs static --dp-microbatches 6,2")


def test_the_switch_reports_its_parts(two_ranks):
    """A rebalance keeps the process groups: its time is moving the state and rebuilding the
    stages, which add up to no more than the whole switch."""
    for res in two_ranks:
        parts = res["phases"]
        assert set(parts) == {"state_s", "rebuild_s"} and min(parts.values()) >= 0
        assert sum(parts.values()) <= res["switch_s"]


def test_every_loss_equals_the_single_device_reference(two_ranks, reference):
    for res in two_ranks:
        _close(res["before"] + res["switched"], reference, "adaptive vs one device")
        _close(res["before"] + res["static"], reference, "static 6,2 vs one device")


def test_a_switch_that_averages_the_replicas_is_caught(two_ranks):
    with pytest.raises(AssertionError):
        _close(two_ranks[0]["planted"], two_ranks[0]["static"], "planted")
