"""The multi-rank launcher every gloo test uses (tests/dist_harness.py `spawn`).

    python -m pytest tests/test_dist_harness.py -q

Launches of 1 and 2 processes: return values come back in rank order from a real all-reduce;
a rank that raises while its peer is blocked on it fails the launch with its own message and
traceback (not a hang); a launch blocked past its time limit is stopped and says which ranks;
ranks see the launching process's environment.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import RankFailed, spawn


def _sum_of_ranks(rank: int, world: int, scale: float) -> tuple:
    x = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(x)
    return rank, world, x.item(), torch.get_num_threads()


def _second_rank_raises(rank: int, world: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a barrier; the group is started here, from
    torchrun's variables (backend=None), as the trainer's init_distributed does."""
    from commpipe.parallel.world import init_distributed

    assert init_distributed("gloo") == (rank, world)
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    dist.barrier()


def _environment(rank: int, world: int) -> tuple:
    import os

    return os.environ.get("COMMPIPE_HARNESS_MARK"), os.environ["MASTER_ADDR"]


def _both_ranks_receive(rank: int, world: int) -> None:
    dist.recv(torch.zeros(1), src=1 - rank)    # a deadlock: neither sends


def test_results_come_back_in_rank_order():
    # all-reduce of 0.5 * (rank + 1) over 2 ranks: 0.5 + 1.0
    assert spawn(_sum_of_ranks, 2, 0.5) == [(0, 2, 1.5, 1), (1, 2, 1.5, 1)]


def test_ranks_see_the_launching_process_environment_now(monkeypatch):
    """Ranks fork from a server started at the first launch: they still get the environment
    of the process that launches them, as it is at the launch."""
    spawn(_environment, 1)                       # the fork server runs before the variable is set
    monkeypatch.setenv("COMMPIPE_HARNESS_MARK", "set after the server started")
    assert spawn(_environment, 2) == [("set after the server started", "127.0.0.1")] * 2


def test_a_raising_rank_fails_the_launch_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 raised first.*_second_rank_raises.*"
                                         r"ValueError: planted failure on rank 1"):
        spawn(_second_rank_raises, 2, backend=None, timeout_s=120)


def test_a_blocked_launch_stops_at_its_time_limit():
    with pytest.raises(RankFailed, match=r"ranks \[0, 1\] still running after timeout_s=8 s"):
        spawn(_both_ranks_receive, 2, timeout_s=8)
