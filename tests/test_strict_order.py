"""NCCL legality of every schedule, checked on CPU.

NCCL matches the point-to-point messages of a rank pair in issue order and runs a pair's
operations one after another on one stream. The runtime posts each pair's operations in one
sequence both sides agree on (commpipe.schedules.order); these tests check that three ways:

- a small model of NCCL's rules written here (independent of the validator) runs every
  generated schedule's posting order without deadlock or swapped tensors, and shows the
  program's own order failing;
- the validator (`channel_order_conflicts`) agrees, and the runtime refuses a planted order;
- real training in strict-order mode (gloo with one tag per rank pair, so it matches in issue
  order as NCCL does) computes what one device computes for every schedule, while the order the
  runtime used to post (tag-matched prefetch) gives wrong gradients under strict order.
"""

from __future__ import annotations

import functools

import pytest
import torch

from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.runtime.executor import PipelineRuntime
from commpipe.schedules import dry_run, generate, lower
from commpipe.schedules.order import as_written, peer_of, posting_order
from commpipe.schedules.validate import channel_order_conflicts, message_key
from tests.dist_harness import run_jobs, spawn
from tests.reference import reference_run
from tests.test_equivalence import check_against, check_grads, make_cfg

MODEL = "arch=llama,layers=8,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,vocab=128"
GRID = [("gpipe", p, m, 1) for p, m in ((2, 3), (4, 8))] + \
       [("1f1b", p, m, 1) for p, m in ((2, 4), (4, 8), (4, 13))] + \
       [("interleaved", p, m, v) for p, m, v in ((2, 4, 2), (4, 8, 2), (2, 6, 3))] + \
       [("zbh1", p, m, 1) for p, m in ((2, 4), (4, 8))] + \
       [("zbv", p, m, 2) for p, m in ((2, 4), (3, 6), (4, 8), (4, 12))]


def nccl_model(lowered, posting) -> tuple[bool, list]:
    """Run `posting` under NCCL's rules: each rank posts in order without blocking; the k-th
    operation a rank posts for a pair meets the peer's k-th for that pair, one at a time (one
    stream per pair); send meets recv (a different message than expected: swapped tensors),
    send meets send or recv meets recv: both wait forever. A compute action waits for the
    receives it consumes. Returns (every rank finished, swapped message keys)."""
    ops = {}                      # (rank, peer) -> [(kind, key)] in posting order
    need = {}                     # (rank, action index) -> (peer, position) it waits for
    for r, order in enumerate(posting):
        acts = lowered.actions[r]
        for k in order:
            a = acts[k]
            if a.op.startswith(("SEND", "RECV")):
                seq = ops.setdefault((r, peer_of(lowered, a)), [])
                if a.op.startswith("RECV"):
                    consumer = next(j for j in range(k + 1, len(acts)) if acts[j].is_compute)
                    need[(r, consumer)] = (peer_of(lowered, a), len(seq))
                seq.append((a.op[:4], message_key(a)))
    posted = {pair: 0 for pair in ops}
    done = {frozenset(pair): 0 for pair in ops}
    pcs, swapped, moved = [0] * lowered.pp, [], True
    while moved:
        moved = False
        for pair in done:                 # advance each pair's stream as far as it can go
            a, b = sorted(pair)
            while done[pair] < min(posted[(a, b)], posted[(b, a)]):
                (ka, xa), (kb, xb) = ops[(a, b)][done[pair]], ops[(b, a)][done[pair]]
                if ka == kb:
                    break                 # two sends or two receives: stuck
                if xa != xb:
                    swapped.append(xb if kb == "RECV" else xa)
                done[pair] += 1
                moved = True
        for r, order in enumerate(posting):
            while pcs[r] < len(order):
                k = order[pcs[r]]
                a = lowered.actions[r][k]
                if a.is_compute and (r, k) in need:
                    peer, pos = need[(r, k)]
                    if done[frozenset((r, peer))] <= pos:
                        break
                elif not a.is_compute:
                    posted[(r, peer_of(lowered, a))] += 1
                pcs[r] += 1
                moved = True
    finished = all(pcs[r] == len(order) for r, order in enumerate(posting))
    return finished, swapped


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_posting_order_is_legal_under_nccl_rules(name, p, m, v):
    lowered = dry_run(generate(name, p, m, v))
    for prefetch in (False, True):
        posting = posting_order(lowered, prefetch=prefetch)
        assert nccl_model(lowered, posting) == (True, [])
        assert channel_order_conflicts(lowered, posting) == []
        # compute and sends keep their order; receives only move earlier
        for r, order in enumerate(posting):
            assert sorted(order) == list(range(len(lowered.actions[r])))
            rest = [k for k in order if not lowered.actions[r][k].op.startswith("RECV")]
            assert rest == sorted(rest)
            assert all(order.index(k) <= order.index(k + 1) for k in range(len(order) - 1)
                       if lowered.actions[r][k].op.startswith("RECV"))


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2)])
def test_program_order_is_illegal_and_the_validator_says_so(name, p, m, v):
    lowered = lower(generate(name, p, m, v))
    for posting in (as_written(lowered), posting_order(lowered, prefetch=True, agree=False)):
        finished, swapped = nccl_model(lowered, posting)
        assert not finished or swapped                # deadlock (1f1b) or swapped tensors (zbv)
        assert channel_order_conflicts(lowered, posting)


def test_planted_swap_of_two_receives_is_caught():
    lowered = lower(generate("zbv", 2, 4, 2))
    posting = posting_order(lowered)
    order = posting[1]
    recvs = [i for i, k in enumerate(order) if lowered.actions[1][k].op.startswith("RECV")]
    i, j = recvs[0], recvs[1]
    order[i], order[j] = order[j], order[i]           # rank 1 receives two messages swapped
    first = lowered.actions[1][order[i]]
    conflicts = channel_order_conflicts(lowered, posting)
    assert conflicts and conflicts[0].startswith("rank 0 <-> rank 1: operation 0 of the pair")
    finished, swapped = nccl_model(lowered, posting)
    assert message_key(first) in swapped or not finished
    comm = Comm(ParallelDims(pp=2), 1, strict_order=True)
    with pytest.raises(ValueError, match="different orders on the two sides"):
        PipelineRuntime(lowered, {}, comm, None, (1,), torch.device("cpu"), posting=posting)
    PipelineRuntime(lowered, {}, Comm(ParallelDims(pp=2), 1), None, (1,), torch.device("cpu"),
                    posting=posting)             # tag matching: any order is fine


# -- gloo in strict-order mode matches in issue order ------------------------------------------
def _pair_worker(rank: int, world: int) -> dict:
    got = {}
    for strict in (False, True):
        comm = Comm(ParallelDims(pp=2), rank, strict_order=strict)
        if rank == 0:       # sends message 1 (tag 1), then message 2 (tag 2)
            for h in [comm.isend(torch.tensor([float(t)]), 1, tag=t) for t in (1, 2)]:
                h.wait()
        else:               # posts the receive for message 2 first
            two, one = torch.zeros(1), torch.zeros(1)
            handles = [comm.irecv(two, 0, tag=2), comm.irecv(one, 0, tag=1)]
            for h in handles:
                h.wait()
            got[strict] = (two.item(), one.item())
    return got


def test_strict_comm_pairs_messages_in_issue_order():
    got = spawn(_pair_worker, 2)[1]
    assert got[False] == (2.0, 1.0)       # by tag
    assert got[True] == (1.0, 2.0)        # by issue order: the first receive gets the first send


# -- real training, strict order, every schedule -----------------------------------------------
def plant_tagged_posting(trainer) -> None:
    """A deliberate bug under strict order: post receives as the runtime does for tag matching
    (prefetch that ignores the pair's sequence), as it did before orders agreed per pair."""
    rt = trainer.runtime
    rt.order = posting_order(rt.program, prefetch=True, agree=False)[rt.pp_rank]


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 1), ("stp", 1),
             ("dualpipev", 1)]


def _cfg(dims, name, v, strict=True):
    return make_cfg(dims, name, vpp=v, model=MODEL, strict_order=strict)


@functools.cache
def strict_results() -> dict:
    jobs = [(f"{d}-{name}-v{v}", _cfg(d, name, v)) for d in (ParallelDims(pp=4),)
            for name, v in SCHEDULES]
    jobs.append(("tp2-pp2-zbv", _cfg(ParallelDims(pp=2, tp=2), "zbv", 1)))
    jobs.append(("tp2-pp2-stp", _cfg(ParallelDims(pp=2, tp=2), "stp", 1)))
    jobs.append(("planted-strict", _cfg(ParallelDims(pp=4), "zbv", 1), plant_tagged_posting))
    jobs.append(("planted-tagged", _cfg(ParallelDims(pp=4), "zbv", 1, strict=False),
                 plant_tagged_posting))
    return run_jobs(4, jobs)


@pytest.fixture(scope="module")
def reference():
    return reference_run(_cfg(ParallelDims(), "1f1b", 1, strict=False))


def test_every_schedule_under_strict_order_matches_single_device(reference):
    for key, got in strict_results().items():
        if not key.startswith("planted"):
            check_against(reference, got, key)


def test_tagged_posting_under_strict_order_is_caught(reference):
    check_against(reference, strict_results()["planted-tagged"], "tags match any order")
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, strict_results()["planted-strict"], "strict, unagreed order")
