"""Comm's collectives on real gloo processes against sums worked out locally.

On gloo, Comm.reduce_scatter runs as an all-to-all plus a local sum in rank order; these
tests check that it returns exactly the rank-order sum's own slice, for groups of 2 and 4, sync
and async, with trailing dimensions, and that the monitor still books it as a reduce-scatter.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from tests.dist_harness import spawn

WORLD = 4


def _data(rank: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, 3, 5, generator=g)


class Book:
    """A minimal observer: the calls the chokepoint reports as ended."""

    def __init__(self, seen: list):
        self.seen = seen

    def begin(self, call):
        return None

    def end(self, ctx, call):
        self.seen.append((call.op, call.nbytes, call.group))


def _worker(rank, world):
    got = {}
    for name, dims in (("tp4", ParallelDims(tp=4)), ("tp2", ParallelDims(tp=2, dp=2))):
        comm = Comm(dims, rank)
        seen = []
        comm.observers.append(Book(seen))
        x = _data(rank, 8)
        sync = comm.reduce_scatter(x, "tp")
        handle = comm.reduce_scatter(x * 2, "tp", async_op=True)
        async_out = handle.wait().tolist()
        booked = list(seen)                 # the two reduce-scatters, before the gather
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gathered = comm.all_gather(x, "tp")
        got[name] = {"sync": sync.tolist(), "async": async_out,
                     "group": list(comm.groups["tp"]), "coord": comm.coords["tp"],
                     "input_unchanged": bool(torch.equal(x, _data(rank, 8))), "seen": booked,
                     "gathered": gathered.tolist(), "warnings": [str(w.message) for w in caught]}
    # control objects: small ones in one round; one rank's over the row width (4 KiB) widens
    # the row on every rank of the group alike, and the next small gather keeps the width
    comm = Comm(ParallelDims(tp=2, dp=2), rank)
    objects = {"small": comm.gather_objects({"rank": rank, "x": [rank] * 3}, "dp"),
               "large": comm.gather_objects("ab" * (20000 if rank == 1 else 1) + str(rank), "dp"),
               "after": comm.gather_objects((rank, None), "world")}
    got["objects"] = objects | {"dp_group": list(comm.groups["dp"]),
                                "dp_width": comm._object_capacity.get(comm.groups["dp"])}
    # gathers in flight while the ranks run collectives of their own, read one "step" later
    # (the adaptive controller's way); rank 2's third object outgrows the row when read
    inflight, read = None, []
    for step in range(4):
        total = torch.full((4,), float(rank + step))
        comm.all_reduce(total, "tp")
        big = step == 2 and rank == 2
        posted = comm.start_gather_objects({"step": step, "rank": rank, "sum": total[0].item(),
                                            "pad": "x" * (9000 if big else 0)})
        if inflight is not None:
            read.append(inflight.result())
        inflight = posted
    read.append(inflight.result())
    got["started"] = {"read": read, "width": comm._object_capacity.get(("control",))}
    return json.loads(json.dumps(got))      # plain lists, as the checks below compare them


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, WORLD)


@pytest.mark.parametrize("name", ["tp4", "tp2"])
def test_reduce_scatter_is_the_rank_order_sum_of_own_slice(results, name):
    for res in results:
        r = res[name]
        n = len(r["group"])
        total = torch.stack([_data(g, 8) for g in r["group"]]).sum(0)     # rank order
        rows = 8 // n
        mine = total[r["coord"] * rows:(r["coord"] + 1) * rows]
        assert torch.equal(torch.tensor(r["sync"]), mine)
        assert torch.equal(torch.tensor(r["async"]), 2 * mine)
        assert r["input_unchanged"]


def test_reduce_scatter_is_booked_as_one(results):
    for res in results:
        for name in ("tp4", "tp2"):
            r = res[name]
            nbytes = 8 * 3 * 5 * 4
            assert r["seen"] == [["reduce_scatter", nbytes, r["group"]]] * 2


def test_all_gather_concatenates_in_group_order_without_deprecation_warnings(results):
    for res in results:
        for name in ("tp4", "tp2"):
            r = res[name]
            want = torch.cat([_data(g, 8) for g in r["group"]])
            assert torch.equal(torch.tensor(r["gathered"]), want)
            assert not [w for w in r["warnings"] if "deprecated" in w], r["warnings"]


def test_gather_objects_returns_every_ranks_object_in_group_order(results):
    for res in results:
        o = res["objects"]
        group = o["dp_group"]
        assert o["small"] == [{"rank": g, "x": [g] * 3} for g in group]
        assert o["large"] == ["ab" * (20000 if g == 1 else 1) + str(g) for g in group]
        assert o["after"] == [[g, None] for g in range(WORLD)]
        # the group holding rank 1 widened its rows to hold its 40 KB pickle; the other did not
        assert o["dp_width"] == (64 << 10 if 1 in group else None)


def test_started_gathers_are_read_later_in_rank_order_and_widen_when_read(results):
    """Comm.start_gather_objects: posted after a step's collectives and read after the next
    one's, every step's objects come back whole, in rank order, on every rank; the one a rank's
    9 KB object overflowed is gathered again wider (16 KiB rows), on every rank alike."""
    for res in results:
        r = res["started"]
        for step, objs in enumerate(r["read"]):
            # tp pairs are (0, 1) and (2, 3): the sum of the pair's rank + step
            want = [{"step": step, "rank": g, "sum": float(2 * step + 1 + 2 * (g // 2) * 2),
                     "pad": "x" * (9000 if (step, g) == (2, 2) else 0)} for g in range(WORLD)]
            assert objs == want
        assert r["width"] == 16 << 10
