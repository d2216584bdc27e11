"""Who keeps which copy of the state (commpipe.train.peer_copies), without processes.

    python -m pytest tests/test_elastic_peers.py -q

Every part of the state must stay on a node that survives the loss of any one node; a DP
replica on another node keeps its twin's part without traffic; a restart picks the newest
step whose parts are all on the nodes that remain. The copies themselves (files in the nodes'
shared memory, sent between ranks, restored into a new layout) are checked by
tests/test_elastic_restart.py under torchrun.
"""

from __future__ import annotations

import shutil
import socket
from types import SimpleNamespace

import pytest

from commpipe.parallel.dims import ParallelDims
from commpipe.train import peer_copies
from commpipe.train.peer_copies import make_plan, newest_complete


def plans(dims: ParallelDims, nodes: list[str], writers: list[int], zero1: bool = False):
    return [make_plan(SimpleNamespace(dims=dims, rank=r, coords=dims.coords(r)), nodes, writers,
                      zero1) for r in range(dims.world_size)]


def where_kept(dims, nodes, writers, zero1=False) -> dict[int, set[str]]:
    """{part: the nodes holding it} after one copy, from every rank's plan."""
    ps = plans(dims, nodes, writers, zero1)
    kept = {w: {nodes[w]} for w in writers}
    for r, p in enumerate(ps):
        if p.send_to is not None:
            assert r in ps[p.send_to].recv_from          # each send has its receive
            kept[r].add(nodes[p.send_to])
        if p.mirror:
            c = dims.coords(r)
            if c["cp"] == 0 and c["tp"] == 0:
                kept[dims.rank_of(pp=c["pp"], dp=0, cp=0, tp=0)].add(nodes[r])
    assert sum(len(p.recv_from) for p in ps) == sum(p.send_to is not None for p in ps)
    return kept


def dp0_writers(dims: ParallelDims) -> list[int]:
    """Without ZeRO-1 the dp=0, cp=0, tp=0 rank of each stage writes its part."""
    return [dims.rank_of(pp=pp, dp=0, cp=0, tp=0) for pp in range(dims.pp)]


@pytest.mark.parametrize("dims,per_node", [
    (ParallelDims(pp=2, dp=2), 2), (ParallelDims(pp=2, dp=2), 1), (ParallelDims(pp=4), 2),
    (ParallelDims(pp=2, dp=2, tp=2), 2), (ParallelDims(pp=2, dp=2, tp=2), 4),
    (ParallelDims(pp=2, dp=4), 4), (ParallelDims(dp=2, cp=2, tp=2), 2),
])
@pytest.mark.parametrize("zero1", [False, True])
def test_every_part_survives_the_loss_of_any_one_node(dims, per_node, zero1):
    world = dims.world_size
    nodes = [f"n{r // per_node}" for r in range(world)]
    writers = list(range(world)) if zero1 else dp0_writers(dims)
    kept = where_kept(dims, nodes, writers, zero1)
    for lost in set(nodes):
        assert all(held - {lost} for held in kept.values()), (lost, kept)


def test_a_dp_replica_on_another_node_keeps_the_copy_without_traffic():
    dims = ParallelDims(pp=2, dp=2)          # ranks (pp, dp): 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1)
    ps = plans(dims, ["a", "b", "a", "b"], [0, 2])
    assert [p.mirror for p in ps] == [False, True, False, True]
    assert all(p.send_to is None and not p.recv_from for p in ps)
    # the replicas on the same node: the parts travel to the neighbour on the other node
    ps = plans(dims, ["a", "a", "b", "b"], [0, 2])
    assert [(p.send_to, p.recv_from, p.mirror) for p in ps] == \
        [(2, [2], False), (None, [], False), (0, [0], False), (None, [], False)]
    # ZeRO-1: the replicas hold other optimizer states, so every part travels
    ps = plans(dims, ["a", "b", "a", "b"], [0, 1, 2, 3], zero1=True)
    assert [p.send_to for p in ps] == [1, 0, 3, 2] and not any(p.mirror for p in ps)
    # expert parallelism (ep2): dp=1 holds the other experts; dp=0's part (its EP group's
    # experts gathered whole) travels
    ps = [make_plan(SimpleNamespace(dims=dims, rank=r, coords=dims.coords(r)), ["a", "b", "a", "b"],
                    [0, 2], False, ep=2) for r in range(4)]
    assert [p.send_to for p in ps] == [1, None, 3, None] and not any(p.mirror for p in ps)


def test_one_node_keeps_one_copy():
    dims = ParallelDims(pp=2, dp=2)
    assert all(p.send_to is None and not p.recv_from and not p.mirror
               for p in plans(dims, ["a"] * 4, [0, 2]))


def test_restart_picks_the_newest_step_the_remaining_nodes_hold_whole():
    held_a = {6: {"writers": [0, 2], "parts": [0, 2]}, 7: {"writers": [0, 2], "parts": [0]}}
    held_b = {6: {"writers": [0, 2], "parts": [0, 2]}}
    views = [("a", held_a), ("a", held_a), ("b", held_b), ("b", held_b)]
    assert newest_complete(views, None, 100) == (6, {0: 0, 2: 0})
    assert newest_complete(views, 5, 100) == (6, {0: 0, 2: 0})
    assert newest_complete(views, 6, 100) is None        # the checkpoint is as new: use it
    assert newest_complete(views, None, 5) is None       # beyond --steps
    # step 7's missing part on a node of its own: complete again, from two providers
    views[2] = ("b", {**held_b, 7: {"writers": [0, 2], "parts": [2]}})
    assert newest_complete(views, 6, 100) == (7, {0: 0, 2: 2})


def test_tidying_keeps_the_newest_copy_and_survives_a_folder_removed_meanwhile(tmp_path,
                                                                               monkeypatch):
    # /dev/shm as tidying finds it: this run's node folder with an older and the newest step,
    # two other runs' folders of dead agents; another node's tidying removes one of them
    # while this one walks the listing
    host = socket.gethostname()
    ours = tmp_path / "commpipe-ours"
    me = f"{host}-100"
    for step in (3, 6):
        (ours / me / f"step_{step:06d}").mkdir(parents=True)
    (tmp_path / "commpipe-old" / f"{host}-101" / "step_000002").mkdir(parents=True)
    (tmp_path / "commpipe-gone" / f"{host}-102").mkdir(parents=True)

    runs = {101: "commpipe-old", 102: "commpipe-gone"}

    def alive(pid):          # agents 101 and 102 are gone; at the first, another node's
        for other, run in runs.items():          # tidying removes the other dead run whole
            if other != pid:
                shutil.rmtree(tmp_path / run, ignore_errors=True)
        runs.clear()
        return False

    monkeypatch.setattr(peer_copies, "_alive", alive)
    peer_copies._tidy(ours, me, 6)
    assert sorted(p.name for p in (ours / me).iterdir()) == ["step_000006"]
    assert not (tmp_path / "commpipe-old").exists()      # the dead agent's run, emptied
