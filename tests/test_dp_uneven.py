"""Uneven micro-batches across DP replicas (commpipe.train.dp_split) compute what one device
computes: loss, pre-clip gradient norm and gradients, parameters after 3 AdamW steps, against
tests/reference.py with tests/test_equivalence.py's tolerances; a reduction that averages the
replicas' mean losses (instead of weighting each by its samples) is caught.

    python -m pytest tests/test_dp_uneven.py -q
"""

from __future__ import annotations

import functools

import pytest

from commpipe.adapt.candidates import proportional
from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import OptimConfig, TrainConfig
from commpipe.train.dp_split import check_dp_microbatches, replica_rows
from tests.dist_harness import run_jobs
from tests.test_equivalence import (
    ADAM_EPS,
    GLOBAL_BATCH,
    SEQ,
    STEPS,
    check_against,
    check_grads,
    check_losses,
)


def make_cfg(dims: ParallelDims, schedule: str, counts, mbs: int) -> TrainConfig:
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, clip=1.0, eps=ADAM_EPS)
    return TrainConfig(model="tiny", dims=dims, schedule=schedule, global_batch=GLOBAL_BATCH,
                       micro_batch_size=mbs, dp_microbatches=counts, seq_len=SEQ, steps=STEPS,
                       seed=3, optim=optim)


def plant_mean_of_replicas(trainer) -> None:
    """Each replica's loss is its own mean (over its rows), and the DP sum is halved: the plain
    mean over replicas, right only when they hold equal shares."""
    prepare, cfg = trainer.prepare_batch, trainer.cfg

    def per_replica_mean(batch):
        mb_inputs, mb_labels, positions, scale = prepare(batch)
        rows = sum(x.shape[0] for x in mb_inputs)
        return mb_inputs, mb_labels, positions, scale * cfg.global_batch / (cfg.dims.dp * rows)

    trainer.prepare_batch = per_replica_mean


JOBS = {   # world: [(key, dims, schedule, counts, micro-batch size)]
    2: [("dp2-3,1", ParallelDims(dp=2), "1f1b", (3, 1), 2),
        ("dp2-1,3", ParallelDims(dp=2), "1f1b", (1, 3), 2)],
    4: [("pp2dp2-3,1", ParallelDims(pp=2, dp=2), "gpipe", (3, 1), 2),
        ("pp2dp2-1,3", ParallelDims(pp=2, dp=2), "gpipe", (1, 3), 2),
        ("pp2dp2-6,2", ParallelDims(pp=2, dp=2), "1f1b", (6, 2), 1)],
}


@functools.cache
def results_of(world: int) -> dict:
    jobs = [(key, make_cfg(d, s, c, b)) for key, d, s, c, b in JOBS[world]]
    if world == 2:
        jobs.append(("planted-mean", make_cfg(ParallelDims(dp=2), "1f1b", (3, 1), 2),
                     plant_mean_of_replicas))
    return run_jobs(world, jobs)


@pytest.fixture(scope="module")
def reference():
    from tests.reference import reference_run

    return reference_run(make_cfg(ParallelDims(), "1f1b", None, 1))


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_replicas_match_single_device(world, reference):
    for key, got in results_of(world).items():
        if not key.startswith("planted-"):
            check_against(reference, got, key)


def test_a_plain_mean_over_replicas_is_caught(reference):
    got = results_of(2)["planted-mean"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, "planted-mean")
    with pytest.raises(AssertionError, match="loss"):
        check_losses(reference, got, "planted-mean")


def test_replica_rows_tile_the_global_batch_in_order():
    counts = (3, 1, 2)
    rows = [replica_rows(counts, 2, d) for d in range(3)]
    assert rows == [(0, 6), (6, 8), (8, 12)]


def test_counts_are_validated_with_a_fix():
    assert check_dp_microbatches((2, 2), 2, 2, 1, "1f1b") is None      # even: no split at all
    assert check_dp_microbatches([3, 1], 2, 2, 1, "1f1b") == (3, 1)
    for counts, dp, pp, sched, says in (((3, 1, 0), 2, 1, "1f1b", "one count per replica"),
                                        ((4, 0), 2, 1, "1f1b", "at least one"),
                                        ((3, 3), 2, 1, "1f1b", "sum to 4"),
                                        ((3, 1), 2, 2, "1f1b", "1 micro-batches cannot run")):
        with pytest.raises(ValueError, match=says):
            check_dp_microbatches(counts, dp, 2, pp, sched)
    with pytest.raises(ValueError, match="sum to 8"):
        make_cfg(ParallelDims(dp=2), "1f1b", (3, 1), 1).resolve(2)


@pytest.mark.parametrize("total,speeds,want", [(4, [1.0, 1 / 3], (3, 1)), (8, [1, 1, 1, 1 / 3], (3, 2, 2, 1)),
                                               (4, [1.0, 1e-3], (3, 1)), (6, [1.0, 1.0], (3, 3))])
def test_proportional_split_by_speed(total, speeds, want):
    got = proportional(total, speeds)
    assert sum(got) == total and min(got) >= 1
    assert sorted(got, reverse=True) == sorted(want, reverse=True)
