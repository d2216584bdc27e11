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

    rates, took = link_probe.measure(Comm(ParallelDims(dp=world), rank), [(0, 1)])
    return {"rates": rates, "took": took}


@pytest.mark.slow
def test_two_ranks_measure_their_link():
    """Rank 0 gets the pair's latency and rate from the ping-pong; rank 1 only answers."""
    first, second = spawn(_measure, 2)
    assert second["rates"] == {}
    (pair, (latency_ms, gbps)), = first["rates"].items()
    assert pair == (0, 1)
    # a 1 MiB message between two processes of one host: between 1 MB/s and 100 GB/s
    assert 0.0 <= latency_ms < 100.0 and 1e-3 < gbps < 100.0
    assert 0.0 < first["took"] < 30.0
