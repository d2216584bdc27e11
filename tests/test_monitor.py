"""Tests of the communication monitor (commpipe.monitor).

    python -m pytest tests/test_monitor.py -x -q

One real two-rank gloo run (tests share its output through a module fixture) checks the
wait/transfer split against a deliberate 0.3 s stall, byte balance, per-step records, link
coverage, sampling agreement, traces and the Megatron adapter; the rest are single-process
checks against hand-derived values.
"""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from commpipe.monitor import Monitor, parse_monitor_flag
from commpipe.monitor import megatron as cpm
from commpipe.monitor.clock import estimate_offset
from commpipe.monitor.records import (
    algbw_bytes,
    build_links,
    build_records,
    busbw_factor,
    class_base,
    link_class,
    sampled_seqs,
    stream_base,
    wire_bytes,
)
from commpipe.parallel.comm import Comm, CommCall
from commpipe.parallel.dims import ParallelDims
from tests.dist_harness import spawn

STALL = 0.3
MIXED_STEPS, MIXED_NUMEL = 16, 1 << 18    # a 1 MiB float32 all-reduce and an 8-byte one per step
HTA_ARGS = ("Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype",
            "In split size", "Out split size", "Process Group Name", "Process Group Ranks")


# -- a stand-in with Megatron-Core's P2PCommunicator._communicate signature ---------------------
class StandInP2P:
    """Same keyword-only signature and return value as Megatron-Core's method; moves tensors
    through a commpipe Comm (whose own observers are empty here, so nothing is counted twice)."""

    def __init__(self, comm, config):
        self.comm, self.config = comm, config
        self.next_rank = self.prev_rank = 1 - comm.rank

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        reqs = {}
        recv_prev_t = torch.empty(tensor_shape, dtype=self.config.pipeline_dtype) if recv_prev else None
        recv_next_t = torch.empty(tensor_shape, dtype=self.config.pipeline_dtype) if recv_next else None
        if tensor_send_next is not None:
            reqs["send_next"] = self.comm.isend(tensor_send_next, self.next_rank)
        if recv_prev_t is not None:
            reqs["recv_prev"] = self.comm.irecv(recv_prev_t, self.prev_rank)
        if tensor_send_prev is not None:
            reqs["send_prev"] = self.comm.isend(tensor_send_prev, self.prev_rank)
        if recv_next_t is not None:
            reqs["recv_next"] = self.comm.irecv(recv_next_t, self.next_rank)
        if wait_on_reqs:
            for r in reqs.values():
                r.wait()
            reqs = None
        return recv_prev_t, recv_next_t, reqs


_ORIGINAL = StandInP2P._communicate


def _xfer(comm, src, dst, numel):
    if comm.rank == src:
        comm.send(torch.ones(numel), dst)
    elif comm.rank == dst:
        comm.recv(torch.empty(numel), src)


def _posted(out, name):
    """Rank 1 says that it has posted its side of message `name`."""
    (out / f"posted-{name}").touch()


def _stall_after_peer_posted(out, name, limit_s=30.0):
    """Rank 0 stalls for STALL from the moment rank 1 has posted (a file says so), so the
    receiver waits at least STALL however late a loaded host schedules either rank. After
    `limit_s` without the file (the peer blocked before posting: a bug) it goes on, and the
    checks that need the order fail instead of the run hanging."""
    end = time.monotonic() + limit_s
    while not (out / f"posted-{name}").exists() and time.monotonic() < end:
        time.sleep(0.001)
    time.sleep(STALL)


def _worker(rank, world, out):
    checks = {}
    try:
        comm = Comm(ParallelDims(pp=2), rank)
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
        full = Monitor(comm, out / "full", sample=1.0, trace=True).attach()
        half = Monitor(comm, out / "half", sample=0.5, seed=7).attach()

        def end(step):
            full.end_step(step)
            half.end_step(step)

        # step 0: rank 0 stalls before sending one 4 KiB message; rank 1 sits in recv meanwhile
        # (its receive is posted before the stall begins)
        if rank == 0:
            _stall_after_peer_posted(out, "step0")
            comm.send(torch.ones(1024), 1)
        else:
            h = comm.irecv(torch.empty(1024), 0)       # what comm.recv does, with a mark between
            _posted(out, "step0")
            h.wait()
        comm.all_reduce(torch.ones(256), "pp")
        t0 = time.perf_counter()
        torch.ones(64, 64) @ torch.ones(64, 64)
        full.record_compute("F0", t0, time.perf_counter())
        end(0)
        # step 1: three messages 0->1 (1, 2, 3 KiB) and two 1->0 (4 KiB)
        for n in (256, 512, 768):
            _xfer(comm, 0, 1, n)
        for _ in range(2):
            _xfer(comm, 1, 0, 1024)
        end(1)
        # step 2: two messages 0->1 and an all-gather
        for _ in range(2):
            _xfer(comm, 0, 1, 256)
        comm.all_gather(torch.ones(128), "pp")
        end(2)
        # steps 3-10: four messages each way, for the half-sampled monitor
        for step in range(3, 11):
            for _ in range(4):
                _xfer(comm, 0, 1, 64)
                _xfer(comm, 1, 0, 64)
            end(step)
        # step 11: tagged messages posted in opposite orders; the stall is before tag 2 only
        if rank == 0:
            first = comm.isend(torch.ones(256), 1, tag=1)
            _stall_after_peer_posted(out, "step11")
            second = comm.isend(torch.full((256,), 2.0), 1, tag=2)
            first.wait(), second.wait()
        else:
            bufs = {t: torch.empty(256) for t in (1, 2)}
            handles = {t: comm.irecv(bufs[t], 0, tag=t) for t in (2, 1)}
            _posted(out, "step11")
            handles[1].wait(), handles[2].wait()
            checks["tags_matched"] = bool(bufs[2].eq(2).all() and bufs[1].eq(1).all())
        end(11)
        # step 12: both consumers wait 0.3 s after the data has arrived (prefetched receive, send
        # waited at step end): the monitor must time the transfer, not the consumer's delay
        comm.barrier()
        if rank == 0:
            h = comm.isend(torch.ones(16384), 1)
        else:
            h = comm.irecv(torch.empty(16384), 0)
        time.sleep(STALL)
        t = time.perf_counter()
        h.wait()
        checks["late_wait_ms"] = (time.perf_counter() - t) * 1e3
        end(12)
        full.close()
        half.close()
        # both ranks read one clock, so a ping-pong estimate of their offset must be ~0: at most
        # half the best of its 8 round trips, so at most 1/16 of the time the estimate took
        t = time.perf_counter()
        checks["pingpong_offset_ms"] = estimate_offset(comm, 8, trust_shared_clock=False) * 1e3
        checks["pingpong_took_ms"] = (time.perf_counter() - t) * 1e3
        after = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1])
        checks["rng_unchanged"] = bool(torch.equal(before[0], after[0]) and before[1] == after[1]
                                       and np.array_equal(before[2], after[2]))

        # a data-parallel step's pattern on one stream: the gradient all-reduce issued async, the
        # 8-byte loss all-reduce while it is in flight, then the wait; one call in four timed
        mixed = Monitor(comm, out / "mixed", sample=0.25).attach()
        for step in range(MIXED_STEPS):
            grads = comm.all_reduce(torch.ones(MIXED_NUMEL), "pp", async_op=True)
            comm.all_reduce(torch.ones((), dtype=torch.float64), "pp")
            grads.wait()
            mixed.end_step(step)
        mixed.close()

        # Megatron adapter on the stand-in: rank 1 receives with wait_on_reqs=False and waits
        # on the returned requests; rank 0 stalls once the call has returned, then sends
        p2p = StandInP2P(comm, SimpleNamespace(pipeline_dtype=torch.float32, variable_seq_lengths=False))
        mon = Monitor(comm, out / "megatron", sample=1.0)
        cpm.install(mon, target=StandInP2P)
        checks["patched"] = StandInP2P._communicate is not _ORIGINAL
        shape = (4, 2, 32)    # [s, b, h] float32: 1 KiB
        try:
            if rank == 0:
                _stall_after_peer_posted(out, "megatron")
                checks["megatron_send_s"] = time.perf_counter()
                p2p._communicate(tensor_send_next=torch.ones(shape), tensor_send_prev=None,
                                 recv_prev=False, recv_next=False, tensor_shape=shape, wait_on_reqs=True)
            else:
                _, _, reqs = p2p._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                                              recv_next=False, tensor_shape=shape, wait_on_reqs=False)
                checks["megatron_returned_s"] = time.perf_counter()
                _posted(out, "megatron")
                for r in reqs.values():
                    r.wait()
            mon.end_step(0)
            p2p._communicate(tensor_send_next=None, tensor_send_prev=torch.ones(shape) if rank else None,
                             recv_prev=False, recv_next=rank == 0, tensor_shape=shape, wait_on_reqs=True)
            mon.end_step(1)
        finally:
            cpm.uninstall(StandInP2P)
            mon.close()
        checks["restored"] = StandInP2P._communicate is _ORIGINAL
    finally:
        (out / f"checks{rank}.json").write_text(json.dumps(checks))


def _read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor2")
    spawn(_worker, 2, out)
    return out


def _one(records, **kw):
    hits = [r for r in records if all(r[k] == v for k, v in kw.items())]
    assert len(hits) == 1, (kw, hits)
    return hits[0]


# -- two real ranks -----------------------------------------------------------------------------
def test_stall_goes_to_wait_not_transfer(run2):
    recv = _one(_read_jsonl(run2 / "full/monitor/rank1.jsonl"), step=0, op="recv", peer=0)
    send = _one(_read_jsonl(run2 / "full/monitor/rank0.jsonl"), step=0, op="send", peer=1)
    # the receiver posted at least 0.3 s before the sender (the stall began once it had
    # posted): that is waiting, and the naive interval (raw_ms, what a timer around the call
    # sees) contains it
    assert recv["raw_ms"] >= STALL * 1e3 * 0.85
    assert recv["wait_ms"] >= STALL * 1e3 * 0.85
    assert recv["transfer_ms"] < 100            # a 4 KiB copy on loopback, stall excluded
    assert recv["transfer_ms"] + recv["wait_ms"] == pytest.approx(recv["raw_ms"], abs=5)
    assert send["wait_ms"] < 50                 # the receiver was already there
    assert recv["bandwidth_gbps"] == pytest.approx(4096 / (recv["transfer_ms"] / 1e3) / 1e9)


def test_late_consumer_wait_is_not_transfer_time(run2):
    # the 64 KiB message arrived long before either side waited on it (0.3 s later): the
    # consumer's wait returned at once, and the records hold the transfer, not the delay
    for rank, op in ((0, "send"), (1, "recv")):
        rec = _one(_read_jsonl(run2 / f"full/monitor/rank{rank}.jsonl"), step=12, op=op)
        assert json.loads((run2 / f"checks{rank}.json").read_text())["late_wait_ms"] < 50
        assert rec["matched"] == 1 and rec["raw_ms"] < STALL * 1e3 / 3, rec
        assert rec["transfer_ms"] + rec["wait_ms"] == pytest.approx(rec["raw_ms"], abs=1e-6)
    p2p = [lk for lk in _read_jsonl(run2 / "full/monitor/links.jsonl") if lk["kind"] == "p2p"]
    link = _one(p2p, step=12, src=0, dst=1)
    assert link["transfer_ms"] < STALL * 1e3 / 3


def test_blocked_time_is_what_the_caller_waited(run2):
    # step 0: rank 1 sat in recv while rank 0 stalled (blocked the whole stall); step 12: the
    # data had arrived 0.3 s before anyone waited (blocked ~0), whatever the transfer took
    recs = _read_jsonl(run2 / "full/monitor/rank1.jsonl")
    assert _one(recs, step=0, op="recv")["blocked_ms_total"] >= STALL * 1e3 * 0.8
    assert _one(recs, step=12, op="recv")["blocked_ms_total"] < 50
    # counted for every call, sampled or not: the half-sampled monitor sees the same stall
    half = _read_jsonl(run2 / "half/monitor/rank1.jsonl")
    assert _one(half, step=0, op="recv")["blocked_ms_total"] >= STALL * 1e3 * 0.8


def test_link_class_from_shared_node_identity(run2):
    # both ranks run on this host, in one network namespace: one node, every link intra-node
    assert json.loads((run2 / "full/monitor/nodes.json").read_text())["node_of_rank"] == [0, 0]
    for rank in (0, 1):
        recs = _read_jsonl(run2 / f"full/monitor/rank{rank}.jsonl")
        assert {r["link_class"] for r in recs} == {"intra_node"}
    assert {lk["link_class"] for lk in _read_jsonl(run2 / "full/monitor/links.jsonl")} == {"intra_node"}


def test_link_class_rules():
    nodes = [0, 0, 1, 1]                       # ranks 0, 1 on one node, 2, 3 on another
    assert link_class(0, 1, (), nodes) == link_class(3, 2, (), nodes) == "intra_node"
    assert link_class(1, 2, (), nodes) == link_class(2, 1, (), nodes) == "inter_node"
    assert link_class(2, None, (2, 3), nodes) == "intra_node"
    assert link_class(0, None, (0, 1, 2, 3), nodes) == link_class(1, None, (1, 2), nodes) == "inter_node"
    assert link_class(0, 1, (), None) is None and link_class(0, 7, (), nodes) is None   # unknown rank


def test_queued_behind_own_earlier_message_is_not_transfer():
    # a 1e6-byte recv posted at 1.0 (sender posted 1.0 too) arrives at 1.3, but the link was
    # carrying the previous message from that peer until 1.2: wait 200 ms, transfer 100 ms
    key = ("pp", "recv", 0, ())
    rec, = build_records(1, 0, [(key, 1, 1_000_000)], [(key, 0, 1.0, 1.3, 1_000_000, 1.2)],
                         lambda k, s: 1.0, {}, 0.3, [0, 1])
    assert rec["wait_ms"] == pytest.approx(200) and rec["transfer_ms"] == pytest.approx(100)
    assert rec["bandwidth_gbps"] == pytest.approx(0.01) and rec["link_class"] == "inter_node"


def test_bytes_balance_and_every_link_every_step(run2):
    links = _read_jsonl(run2 / "full/monitor/links.jsonl")
    p2p = [lk for lk in links if lk["kind"] == "p2p"]
    for step in range(11):
        here = {(lk["src"], lk["dst"]) for lk in p2p if lk["step"] == step}
        assert here == ({(0, 1)} if step == 0 else {(0, 1), (1, 0)}), step
    for lk in p2p:
        assert lk["bytes_sent"] == lk["bytes_recv"] and lk["calls_sent"] == lk["calls_recv"], lk
        assert lk["send"] is not None and (lk["recv"] is not None)
    # hand count: step 1 moved 1+2+3 KiB from 0 to 1 and 2 x 4 KiB back
    assert _one(p2p, step=1, src=0, dst=1)["bytes_sent"] == (256 + 512 + 768) * 4
    assert _one(p2p, step=1, src=1, dst=0)["bytes_recv"] == 2 * 4096


def test_tagged_messages_pair_by_tag(run2):
    # rank 1 waits on tag 1 (sent at once), then tag 2 (sent after the stall); pairing by
    # arrival order instead of tag would turn the stall into transfer time
    recv = _one(_read_jsonl(run2 / "full/monitor/rank1.jsonl"), step=11, op="recv", peer=0)
    assert recv["calls"] == recv["matched"] == 2
    assert recv["wait_ms_total"] >= STALL * 1e3 * 0.85 and recv["transfer_ms_total"] < 100
    assert json.loads((run2 / "checks1.json").read_text())["tags_matched"]


def test_records_are_per_step_not_cumulative(run2):
    rank0 = _read_jsonl(run2 / "full/monitor/rank0.jsonl")
    calls = [_one(rank0, step=s, op="send", peer=1)["calls"] for s in range(4)]
    assert calls == [1, 3, 2, 4]
    # a stream idle in a step still has its record: counts zero, timing null
    idle = _one(rank0, step=2, op="all_reduce")
    assert idle["calls"] == 0 and idle["transfer_ms"] is None and idle["ema_bandwidth_gbps"] is not None
    # EMA (alpha 0.3) beside the raw value: step 1 folds step 1's bandwidth into step 0's
    r0, r1 = (_one(rank0, step=s, op="send", peer=1) for s in (0, 1))
    assert r1["ema_bandwidth_gbps"] == pytest.approx(0.3 * r1["bandwidth_gbps"] + 0.7 * r0["bandwidth_gbps"])


def test_collectives_use_nccl_tests_accounting(run2):
    for rank in (0, 1):
        recs = _read_jsonl(run2 / f"full/monitor/rank{rank}.jsonl")
        ag = _one(recs, step=2, op="all_gather")
        # all-gather of 128 floats from each of 2 ranks: S = 1 KiB (the output), busbw = S/t * 1/2
        assert ag["bytes"] == 512 and ag["bytes_sent"] == ag["bytes_recv"] == 512
        assert ag["bandwidth_gbps"] == pytest.approx(1024 / (ag["transfer_ms"] / 1e3) / 1e9)
        assert ag["busbw_gbps"] == pytest.approx(ag["bandwidth_gbps"] * 0.5)
        ar = _one(recs, step=0, op="all_reduce")
        assert ar["busbw_gbps"] == pytest.approx(ar["bandwidth_gbps"])   # 2(n-1)/n = 1 at n = 2


def test_sampling_agrees_between_both_ends(run2):
    links = [lk for lk in _read_jsonl(run2 / "half/monitor/links.jsonl") if lk["kind"] == "p2p"]
    total = sum(lk["send"]["calls"] for lk in links if 3 <= lk["step"] <= 10)
    sampled = sum(lk["send"]["sampled"] for lk in links if 3 <= lk["step"] <= 10)
    for lk in links:
        assert lk["send"]["sampled"] == lk["recv"]["sampled"] == lk["recv"]["matched"], lk
    assert total == 64 and 0.25 < sampled / total < 0.75
    assert any(lk["sampled"] == 0 and lk["transfer_ms"] is None for lk in links) or sampled == total


def test_every_size_class_of_a_stream_is_timed(run2):
    # one stream, two calls per step (1 MiB async, then 8 bytes), sample=0.25: in every four
    # steps exactly one large and one small call are timed, on both ranks alike, so the stream
    # has timed calls of the large size and its bandwidth is not the scalar's latency
    big = MIXED_NUMEL * 4
    for rank in (0, 1):
        recs = [r for r in _read_jsonl(run2 / f"mixed/monitor/rank{rank}.jsonl")
                if r["op"] == "all_reduce"]
        assert [(r["step"], r["calls"], r["bytes"]) for r in recs] == \
            [(s, 2, big + 8) for s in range(MIXED_STEPS)]
        large, small = [], []
        for r in recs:
            assert r["matched"] == r["sampled"], r
            # bytes of the step's timed calls: raw bandwidth is their bytes over their raw time
            timed = r["raw_bandwidth_gbps"] * r["raw_ms_total"] * 1e6 if r["sampled"] else 0.0
            large.append(round(timed / big))
            small.append(r["sampled"] - large[-1])
            assert timed == pytest.approx(large[-1] * big + small[-1] * 8, abs=1e-3), r
        for w in range(0, MIXED_STEPS, 4):
            assert sum(large[w:w + 4]) == 1 and sum(small[w:w + 4]) == 1, (rank, large, small)
        # bytes per timed call (bandwidth x transfer time) of the steps that timed the large one
        sizes = [r["bandwidth_gbps"] * r["transfer_ms"] * 1e6 for r, n, m in zip(recs, large, small)
                 if n == 1 and m == 0]
        assert sizes and all(size == pytest.approx(big) for size in sizes), sizes


def test_rng_untouched_and_megatron_adapter(run2):
    checks = [json.loads((run2 / f"checks{r}.json").read_text()) for r in (0, 1)]
    assert all(c["rng_unchanged"] and c["patched"] and c["restored"] for c in checks)
    assert checks[0]["pingpong_offset_ms"] == 0
    assert abs(checks[1]["pingpong_offset_ms"]) <= checks[1]["pingpong_took_ms"] / 16 + 1e-6, checks[1]
    recv = _one(_read_jsonl(run2 / "megatron/monitor/rank1.jsonl"), step=0, op="recv", peer=0)
    assert recv["bytes"] == 4 * 2 * 32 * 4                 # requested shape x float32
    # timed from the request's completion: the function itself returned before the sender
    # even began its stall (both ranks read one perf_counter clock)
    assert checks[1]["megatron_returned_s"] < checks[0]["megatron_send_s"] - STALL
    assert recv["raw_ms"] >= STALL * 1e3 * 0.85 and recv["wait_ms"] >= STALL * 1e3 * 0.85
    assert recv["transfer_ms"] < 100
    back = _one(_read_jsonl(run2 / "megatron/monitor/links.jsonl"), step=1, src=1, dst=0)
    assert back["bytes_sent"] == back["bytes_recv"] == 1024


def test_traces_are_chrome_json_with_hta_args(run2):
    for rank in (0, 1):
        trace = json.loads((run2 / f"full/trace/rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank
        assert {pg["pg_name"] for pg in trace["distributedInfo"]["pg_config"]} >= {"0"}
        slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        for e in slices:
            assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0
        # communication: kernels named as HTA recognises them (^nccl.*Kernel), each with a
        # stream and a launch on the host sharing its correlation id
        comm = [e for e in slices if e["cat"] == "kernel" and e["name"].startswith("ncclKernel_")]
        assert comm and all(set(HTA_ARGS) <= e["args"].keys() for e in comm)
        names = {e["args"]["Collective name"] for e in comm}
        assert {"send", "recv", "allreduce", "_allgather_base"} <= names
        launches = {e["args"]["correlation"] for e in slices if e["cat"] == "cpu_op"}
        assert all(e["args"]["stream"] > 0 and e["args"]["correlation"] in launches for e in comm)
        tids = {e["name"]: e["tid"] for e in slices if e["cat"] == "kernel"}
        if rank == 0:
            assert tids["F0"] != tids["ncclKernel_Send"]   # compute and pp on their own streams
        else:
            wait = [e for e in slices if e["name"] == "wait" and e["args"]["step"] == 0]
            assert wait and wait[0]["dur"] >= STALL * 1e6 * 0.85


# -- single process -----------------------------------------------------------------------------
def test_parse_monitor_flag():
    assert parse_monitor_flag("off") is None
    assert parse_monitor_flag("all") == 1.0
    assert parse_monitor_flag("sample=0.1") == 0.1
    assert parse_monitor_flag(" Sample=0.25 ") == 0.25
    for bad in ("sample=0", "sample=1.5", "sometimes", "sample="):
        with pytest.raises(ValueError, match="sample=F"):
            parse_monitor_flag(bad)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_nccl_tests_factors(n):
    # nccl-tests doc/PERFORMANCE.md: a ring all-reduce moves 2(n-1)/n of the buffer per rank,
    # all-gather and reduce-scatter (n-1)/n of the full tensor, send/recv and broadcast 1
    assert busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    assert busbw_factor("all_gather", n) == busbw_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    # alltoall.cu: of the n chunks a rank sends, the one it keeps crosses no link
    assert busbw_factor("all_to_all", n) == pytest.approx((n - 1) / n)
    assert busbw_factor("send", n) == busbw_factor("recv", n) == busbw_factor("broadcast", n) == 1
    assert algbw_bytes("all_gather", 100, n) == 100 * n          # S is the gathered output
    assert algbw_bytes("reduce_scatter", 100 * n, n) == 100 * n  # S is the full input
    assert wire_bytes("all_reduce", 1000 * n, n) == (2000 * (n - 1),) * 2


def test_records_against_hand_computation():
    # rank 1 receives 1e6 bytes from rank 0: posted at t=1.0, peer posted at 1.2, done at 1.3
    # -> wait 200 ms, transfer 100 ms, 1e6 B / 0.1 s = 0.01 GB/s; then an all-reduce of 4e6 B
    # over 4 ranks posted at 2.0 (peers 2.0, 2.05, 2.1), done at 2.3 -> wait 100, transfer 200
    # ms, algbw 4e6/0.2 = 0.02 GB/s, busbw x 1.5 = 0.03 GB/s
    recv_key = ("pp", "recv", 0, ())
    ar_key = ("tp", "all_reduce", None, (0, 1, 2, 3))
    posts = {(recv_key, 0): 1.2, (ar_key, 0): [2.0, 2.0, 2.05, 2.1]}
    ema = {}
    recs = build_records(1, 5, [(recv_key, 3, 3_000_000), (ar_key, 1, 4_000_000)],
                         [(recv_key, 0, 1.0, 1.3, 1_000_000), (ar_key, 0, 2.0, 2.3, 4_000_000)],
                         lambda k, s: posts.get((k, s)), ema, 0.3)
    rv, ar = recs
    assert (rv["calls"], rv["sampled"], rv["bytes"]) == (3, 1, 3e6)
    assert (rv["bytes_recv"], rv["bytes_sent"]) == (3e6, 0)
    assert rv["wait_ms"] == pytest.approx(200) and rv["transfer_ms"] == pytest.approx(100)
    assert rv["raw_ms"] == pytest.approx(300) and rv["bandwidth_gbps"] == pytest.approx(0.01)
    assert ar["wait_ms"] == pytest.approx(100) and ar["transfer_ms"] == pytest.approx(200)
    assert ar["bandwidth_gbps"] == pytest.approx(0.02) and ar["busbw_gbps"] == pytest.approx(0.03)
    links = build_links(5, {1: recs, 0: [dict(rv, rank=0, op="send", peer=1, wait_ms=0.0)]})
    link = _one([lk for lk in links if lk["kind"] == "p2p"], src=0, dst=1)
    assert link["wait_ms"] == pytest.approx(200) and link["send_wait_ms"] == 0.0


def test_sampling_decision_is_shared_and_uses_its_own_rng(tmp_path):
    # the k-th send a->b and the k-th recv on b from a draw the same decision
    a_side = stream_base(7, "pp", "send", 3, 5, ())
    b_side = stream_base(7, "pp", "recv", 5, 3, ())
    assert a_side == b_side != stream_base(8, "pp", "send", 3, 5, ())
    picks = sampled_seqs(a_side, 0.1, 5000)
    # one call in each window of ten: exactly a tenth, never more than 19 calls apart
    assert len(picks) == 500 and picks == sorted(set(picks))
    assert all(10 * w <= p < 10 * (w + 1) for w, p in enumerate(picks))
    assert sampled_seqs(a_side, 1.0, 50) == list(range(50)) and sampled_seqs(a_side, 0.0, 50) == []
    # a real single-rank Monitor fed real CommCalls: global RNGs untouched, per-step tallies
    torch.manual_seed(1)
    state, py_state = torch.random.get_rng_state(), random.getstate()
    np_state = np.random.get_state()[1].copy()
    mon = Monitor(Comm(ParallelDims(), 0), tmp_path, sample=0.1).attach()
    seqs = [0, 1, 2, 3, 4, 1000, 1001]    # the last two after a gap (monitor detached meanwhile)
    timed = []
    for step, n in enumerate((5, 2)):
        for seq in seqs[:n] if step == 0 else seqs[5:]:
            call = CommCall("world", "all_reduce", 8, group=(0,), seq=seq, size_class=4,
                            size_seq=seq, dtype="torch.float32")
            ctx = mon.begin(call)
            call.t_post = time.perf_counter()
            call.t_done = time.perf_counter()
            mon.end(ctx, call)
            timed += [seq] if ctx.__class__.__name__ == "_Timed" else []
        mon.end_step(step)
    mon.close()
    assert torch.equal(state, torch.random.get_rng_state()) and py_state == random.getstate()
    assert np.array_equal(np_state, np.random.get_state()[1])
    recs = _read_jsonl(tmp_path / "monitor/rank0.jsonl")
    assert [(r["step"], r["calls"], r["bytes"]) for r in recs] == [(0, 5, 40), (1, 2, 16)]
    # it times exactly the calls the shared chain picks, also after skipping ahead
    chain = sampled_seqs(class_base(stream_base(1234, "world", "all_reduce", 0, None, (0,)), 4),
                         0.1, 1002)
    assert timed == [s for s in seqs if s in chain]
    assert [r["sampled"] for r in recs] == [sum(s < 5 for s in timed), sum(s >= 5 for s in timed)]


def test_megatron_install_needs_megatron_or_target(tmp_path):
    try:
        import megatron.core.pipeline_parallel.p2p_communication as p2p  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="megatron-core"):
            cpm.install(out_dir="unused")
        return
    import inspect

    real = p2p.P2PCommunicator
    params = inspect.signature(real._communicate).parameters
    for name in ("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape",
                 "wait_on_reqs"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    original = real._communicate
    mon = cpm.install(Monitor(Comm(ParallelDims(), 0), tmp_path, sample=1.0))
    try:
        assert real._communicate is not original and real._communicate.__wrapped__ is original
    finally:
        cpm.uninstall()
        mon.close()
    assert real._communicate is original
