"""The adaptive controller measures a link class nothing of the run gave a rate for
(commpipe.adapt.link_probe) before it prices candidates that would use it.

    python -m pytest tests/test_adapt_link_probe.py -q
"""

from __future__ import annotations

import pytest

from commpipe.adapt import link_probe
from tests.dist_harness import spawn


def test_only_the_classes_without_a_rate_are_measured():
    # two nodes of one rank (the suite's cluster): the one inter-node pair, unless rated
    assert link_probe.pairs_to_measure(2, 1, set()) == [(0, 1)]
    assert link_probe.pairs_to_measure(2, 1, {"inter_node"}) == []
    # two nodes of two: rank 0 with its node's other rank, and with the first of node 1
    assert link_probe.pairs_to_measure(4, 2, set()) == [(0, 1), (0, 2)]
    assert link_probe.pairs_to_measure(4, 2, {"intra_node"}) == [(0, 2)]
    # one node: no inter-node class to measure
    assert link_probe.pairs_to_measure(2, 2, set()) == [(0, 1)]
    assert link_probe.pairs_to_measure(1, 1, set()) == []


def test_a_rate_comes_from_collectives_or_from_pipeline_links_that_gave_one():
    # a pipeline link whose messages were too small to give a rate (None) rates nothing
    assert link_probe.rated_classes({(0, 1): (None, None)}, {}, 1) == set()
    assert link_probe.rated_classes({(0, 1): (None, 0.11)}, {}, 1) == {"inter_node"}
    assert link_probe.rated_classes({(0, 1): (None, 0.11)}, {}, 2) == {"intra_node"}
    assert link_probe.rated_classes({}, {"inter_node": 0.1, "intra_node": None}, 1) == \
        {"inter_node"}


def _measure(rank: int, world: int) -> dict:
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims

    comm = Comm(ParallelDims(dp=world), rank)
    rates, took = link_probe.measure(comm, [(0, 1)])
    ops, nbytes, calls_took = link_probe.measure_calls(comm)
    total = comm.all_reduce_scalars([1.0], "world")     # the world carries on afterwards
    return {"rates": rates, "took": took, "ops": ops, "nbytes": nbytes, "total": total,
            "calls_took": calls_took}


@pytest.mark.slow
def test_ranks_measure_their_link_and_a_calls_time():
    """Rank 0 gets the pair's latency and rate from the ping-pong; rank 1 only answers. Ranks 0
    and 1 then time collectives after compute in a group of their own while rank 2 waits."""
    first, second, third = spawn(_measure, 3)
    assert second["rates"] == third["rates"] == {}
    (pair, (latency_ms, gbps)), = first["rates"].items()
    assert pair == (0, 1)
    # a 1 MiB message between two processes of one host: between 1 MB/s and 100 GB/s
    assert 0.0 <= latency_ms < 100.0 and 1e-3 < gbps < 100.0
    assert 0.0 < first["took"] < 30.0
    assert third["ops"] is None and first["nbytes"] == 8192
    for ops in (first["ops"], second["ops"]):
        assert set(ops) == {"all_reduce", "all_gather", "reduce_scatter"}
        # each call follows 0.5 ms of compute that is not in its time; a call on one host
        # takes more than nothing and less than a second
        assert all(0.0 < v["median_ms"] and 0.0 < v["mean_ms"] < 1e3 for v in ops.values())
    assert first["total"] == third["total"] == [3.0]
    assert 0.0 < first["calls_took"] < 60.0


def test_a_calls_time_is_its_mean_beyond_the_links_price():
    """1.0, 0.8 and 0.6 ms means on a 0.1 ms, 1 GB/s link: all-reduce 2 steps, all-gather (of
    2 x 8 KiB) and reduce-scatter 1 step each (commpipe.plan.cluster.call_overhead)."""
    ops = {"all_reduce": {"mean_ms": 1.0}, "all_gather": {"mean_ms": 0.8},
           "reduce_scatter": {"mean_ms": 0.6}}
    ar = 1.0 - (8192 / 1e6 + 0.2)
    ag = 0.8 - (8192 / 1e6 + 0.1)
    rs = 0.6 - (4096 / 1e6 + 0.1)
    assert link_probe.call_ms(ops, 8192, 0.1, 1.0) == pytest.approx((ar + ag + rs) / 3)
    assert link_probe.call_ms({}, 8192, 0.1, 1.0) == 0.0


@pytest.mark.parametrize("ranks,timing,cores,factor", [
    (4, 2, 2, 2.0),      # the demo: 4 ranks on 2 cores, the calls timed by 2 of them
    (8, 2, 2, 4.0),      # 8 ranks on 2 cores
    (4, 1, 2, 2.0),      # rank 1 on another machine: rank 0 timed alone
    (8, 2, 64, 1.0),     # a core for every rank: nothing to share
    (3, 2, 2, 1.5)])
def test_calls_in_training_are_stretched_by_the_ranks_sharing_the_cores(ranks, timing, cores,
                                                                        factor):
    """Busy ranks per core in training over those while the calls were timed, as
    commpipe.plan.host's processor sharing prices a collective call's host time."""
    assert link_probe.sharing_factor(ranks, timing, cores) == pytest.approx(factor)


@pytest.mark.parametrize("ranks,timing,cores,device,factor", [
    (4, 2, 2, 2.0, 1.0),     # 4 ranks on 2 cores, each busy half its compute time: 1 per core
    (8, 2, 2, 2.0, 2.0),     # 8 ranks, busy half the time: 2 per core
    (8, 2, 2, 3.0, 4 / 3),   # busy a third of the time
    (4, 2, 2, 1.0, 2.0)])    # no emulation: as above
def test_an_emulated_device_leaves_the_cores_to_the_other_ranks(ranks, timing, cores, device,
                                                                 factor):
    """Under --emulate-device F a computing rank is on a core 1/F of the time (the rest it
    leaves idle for the emulated device), so F times fewer ranks compete for the cores."""
    assert link_probe.sharing_factor(ranks, timing, cores, device) == pytest.approx(factor)


class _Gathered:
    """A comm whose gather_objects returns the given rows (one per rank)."""

    def __init__(self, rows):
        self.rows = rows

    def gather_objects(self, obj, dim="world"):
        return self.rows


@pytest.mark.parametrize("rows,expected", [
    # 4 ranks free to use both cores of one machine
    ([("m", [0, 1])] * 4, {"ranks": 4, "cores": 2, "timing_ranks": 2, "factor": 2.0}),
    # each pinned to its own core: nothing shared
    ([("m", [c]) for c in range(4)], {"ranks": 4, "cores": 4, "timing_ranks": 2, "factor": 1.0}),
    # rank 1 on another machine: rank 0 timed alone, 3 ranks on 2 cores here
    ([("m", [0, 1]), ("n", [0, 1]), ("m", [0, 1]), ("m", [0, 1])],
     {"ranks": 3, "cores": 2, "timing_ranks": 1, "factor": 1.5})])
def test_host_sharing_counts_the_ranks_and_cores_of_rank_0s_machine(rows, expected):
    assert link_probe.host_sharing(_Gathered(rows)) == expected


def test_host_sharing_records_an_emulated_device():
    got = link_probe.host_sharing(_Gathered([("m", [0, 1])] * 8), 2.0)
    assert got == {"ranks": 8, "cores": 2, "timing_ranks": 2, "factor": 2.0, "emulated_device": 2.0}
