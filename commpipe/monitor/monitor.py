"""`Monitor`: sampled communication timing at the comm chokepoint, per step, from every rank.

    monitor = Monitor(comm, "runs/x", sample=0.1)   # time one call in ten (all are counted)
    monitor.attach()                                 # collective: aligns the ranks' clocks
    for step in ...:
        train_step()
        monitor.end_step(step)                       # collective: records, written in batches
    monitor.close()                                  # collective: flushes, writes traces

Every call is tallied (calls, bytes) with a few attribute updates. A sampled call keeps its
post and completion times (host perf_counter on CPU; pooled CUDA events on GPU); completion is
observed when the data has arrived, however late the consumer waits (the pipeline runtime
prefetches receives and waits on sends at step end): the comm watches every sampled call
(commpipe.parallel.completion). At attach the ranks also share their node identity
(commpipe.monitor.clock.node_identity), so every record says whether its link is intra_node
or inter_node (a collective is inter_node when its group spans nodes). Every
`exchange_every` steps (default 20) and at close the ranks exchange the post times of their
sampled calls (one all_gather_object over the world, sampled calls only), so each side of a
transfer can separate waiting for its peer from moving data (see commpipe.monitor.records).
Sampling decisions are a function of (seed, stream, size class, position in that class) alone
(CommCall.size_class, size_seq; commpipe.monitor.records.next_sampled), so both ends of a
send/recv, and all members of a collective, time the same calls, and every size class of a
stream gets its share: a large gradient all-reduce and a scalar one on one stream are both
timed, each at `sample` of its calls. Messages are matched by (dim, src, dst,
seq), or (dim, src, dst, tag, seq) for tagged point-to-point messages (CommCall.tag, when the
Comm provides it).

Output: OUT/monitor/rank{r}.jsonl (one record per step and (dim, op, peer or group)),
OUT/monitor/links.jsonl on rank 0 (one record per step and link, both sides),
OUT/monitor/nodes.json on rank 0 (node number of every rank, and the node identities), and with
trace=True OUT/trace/rank{r}.json (Chrome/Perfetto). Records of a step are written when every
sampled call of that step has been matched with its peer's post, at the latest `max_lag`
steps later (then unmatched timing is null); on CPU that is the same end_step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from commpipe.monitor.clock import CudaEvents, estimate_offset, node_identity
from commpipe.monitor.records import (
    P2P_OPS,
    build_links,
    build_records,
    class_base,
    next_window,
    split_times,
    stream_base,
    tagged_sampled,
)
from commpipe.monitor.trace import comm_args, comm_events, group_table, write_trace
from commpipe.timeline import Event


class _Stream:
    """All calls of one (dim, op, peer, group) on this rank: the cheap, always-on tally."""

    __slots__ = ("key", "base", "calls", "bytes", "blocked")

    def __init__(self, key, base):
        self.key, self.base, self.calls, self.bytes = key, base, 0, 0
        self.blocked = 0.0      # seconds callers spent in wait(), every call


class _Sampler:
    """One size class of a stream: its chain's key, its next sampled CommCall.size_seq and the
    window holding it (commpipe.monitor.records.next_window)."""

    __slots__ = ("stream", "base", "window", "next")

    def __init__(self, stream, base, fraction):
        self.stream, self.base = stream, base
        self.window, self.next = next_window(base, -1, fraction, 0)


class _Timed:
    """One sampled call."""

    __slots__ = ("stream", "call", "mid", "step", "post", "done", "nbytes", "ev_post", "ev_done",
                 "anchor", "finished")

    def __init__(self, stream, call, mid):
        self.stream, self.call, self.mid = stream, call, mid
        self.step = self.post = self.done = self.ev_post = self.ev_done = self.anchor = None
        self.nbytes = 0
        self.finished = False


class Monitor:
    """Observer of a `Comm` (see commpipe.parallel.comm for the begin/end protocol)."""

    def __init__(self, comm, out_dir, sample: float = 0.1, seed: int = 1234, ema_alpha: float = 0.3,
                 trace: bool = False, resync_every: int = 100, max_lag: int = 2, sync_rounds: int = 8,
                 exchange_every: int = 20, trace_steps: int | None = None):
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"sample={sample} must be a fraction in [0, 1] (0.1 times one call in ten)")
        if not 0.0 < ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha={ema_alpha} must be in (0, 1]")
        if resync_every < 1 or max_lag < 0 or exchange_every < 1:
            raise ValueError("resync_every and exchange_every must be >= 1 and max_lag >= 0")
        self.comm, self.rank, self.world = comm, comm.rank, comm.dims.world_size
        self.out_dir = Path(out_dir)
        self.sample, self.seed, self.alpha, self.trace = sample, seed, ema_alpha, trace
        self.trace_steps = trace_steps   # the trace keeps only the last N steps (None: all)
        self.resync_every, self.max_lag, self.sync_rounds = resync_every, max_lag, sync_rounds
        # the ranks exchange sampled post times once every `exchange_every` steps (and at
        # close): records stay per step, written in batches, and the one collective the
        # monitor adds to training is paid once per batch instead of once per step
        self.exchange_every = exchange_every
        # True: a caller that gathers over the world after every step anyway (the adaptive
        # controller) carries `exchange_payload()` in its gather and hands the result to
        # `exchange_ingest`, so the exchange costs no collective of its own (every step)
        self.exchange_by_caller = False
        self._closings: list = []             # (step, counts) of steps not yet exchanged
        self._streams: dict = {}              # (dim, op, peer, group) -> _Stream
        self._samplers: dict = {}             # (dim, op, peer, group, size class) -> _Sampler
        self._finished: list[_Timed] = []     # sampled calls completed since the last end_step
        self._inflight: list[_Timed] = []     # sampled calls begun, post not yet shared
        self._unresolved: list[_Timed] = []   # completed, device times not read yet (GPU)
        on_gpu = comm.device.type == "cuda" and torch.cuda.is_available()
        self._cuda = CudaEvents(comm.device) if on_gpu else None
        self.offset = 0.0    # this rank's perf_counter minus rank 0's
        self.epoch = 0.0     # trace time origin, on rank 0's clock
        self._synced = self._closed = False
        self._next_step = 0
        # exchange state: `_steps` holds the data of every rank whose records this rank builds
        # (its own; rank 0 builds everyone's to join links)
        self._steps: dict = {}      # (rank, step) -> [counts | None, samples]
        self._marks: dict = {}      # rank -> all its sampled calls of steps <= mark are shared
        self._done_upto: dict = {}  # rank -> last finalized step
        self._p2p: dict = {}        # (dim, src, dst, mid, op) -> (post, arrival step)
        self._coll: dict = {}       # (dim, op, group, mid) -> [{rank: post}, arrival step]
        self._ema: dict = {}        # rank -> {key: (ema bandwidth, ema latency)}
        self._link_buf: dict = {}   # step -> {rank: records}
        self._events: list[Event] = []        # compute intervals (trace)
        self._calls: list[list[Event]] = []   # one list per timed call: the call, its wait
        self._dtypes: dict = {}     # (key, mid) -> dtype of own sampled calls, for the trace
        self._groups = group_table(comm.dims)
        self._file = self._links_file = None
        self.last_records: list[dict] = []
        self.nodes: list[int] | None = None   # node number of every rank, known at attach

    # -- lifecycle --------------------------------------------------------------------------------
    def attach(self, observe: bool = True) -> Monitor:
        """Start observing; the first attach is collective (clock alignment over the world).

        observe=False prepares the monitor (files, clocks) without registering it on the Comm,
        for callers that feed it themselves (commpipe.monitor.megatron).
        """
        if self._closed:
            raise ValueError("this Monitor is closed; create a new one")
        if not self._synced:
            (self.out_dir / "monitor").mkdir(parents=True, exist_ok=True)
            self._file = open(self.out_dir / "monitor" / f"rank{self.rank}.jsonl", "a")
            if self.rank == 0:
                self._links_file = open(self.out_dir / "monitor" / "links.jsonl", "a")
            self._sync_clock()
            now = time.perf_counter() - self.offset
            # one exchange: the trace origin (rank 0's clock) and every rank's node
            shared = self.comm.gather_objects((now, node_identity()), "world")
            self.epoch = shared[0][0]
            hosts = [h for _, h in shared]
            firsts = list(dict.fromkeys(hosts))            # nodes numbered by their first rank
            self.nodes = [firsts.index(h) for h in hosts]
            if self.rank == 0:
                (self.out_dir / "monitor" / "nodes.json").write_text(
                    json.dumps({"node_of_rank": self.nodes, "hosts": hosts}) + "\n")
            self._synced = True
        if observe and self not in self.comm.observers:
            self.comm.observers.append(self)
        return self

    def detach(self) -> None:
        """Stop observing (not collective). Calls in flight at that moment are not counted: the
        Comm hands their completion only to the observers registered when it happens."""
        if self in self.comm.observers:
            self.comm.observers.remove(self)

    def close(self) -> None:
        """Collective: share what is left, write every pending record and the trace, detach."""
        if self._closed:
            return
        self.detach()
        if self._synced:
            if self._cuda is not None:
                torch.cuda.synchronize(self.comm.device)  # end of run: read every event
            self._exchange(force=True)
            if self.trace:
                write_trace(self._events, self._calls,
                            self.out_dir / "trace" / f"rank{self.rank}.json", self.rank,
                            self.world, "nccl" if self._cuda else "gloo", self._groups)
        for f in (self._file, self._links_file):
            if f is not None:
                f.close()
        self._closed = True

    # -- hot path: Comm calls these around every op -------------------------------------------------
    def begin(self, call):
        sampler = self._samplers.get((call.dim, call.op, call.peer, call.group, call.size_class))
        if sampler is None:
            sampler = self._new_sampler(call)
        stream = sampler.stream
        tag = getattr(call, "tag", 0)
        if tag:
            if not tagged_sampled(stream.base, tag, call.seq, self.sample):
                return stream
            mid = (tag, call.seq)
        else:
            k = call.size_seq
            if k < sampler.next:
                return stream                    # not sampled: the common case, one compare
            if k > sampler.next:                 # calls went by unobserved (detached): catch up
                sampler.window, sampler.next = next_window(
                    sampler.base, k - 1, self.sample, max(sampler.window + 1, int((k - 1) * self.sample)))
                if k < sampler.next:
                    return stream
            sampler.window, sampler.next = next_window(sampler.base, k, self.sample,
                                                       sampler.window + 1)
            mid = call.seq
        timed = _Timed(stream, call, mid)
        # completion is observed when the data has arrived, not when the consumer waits
        # (commpipe.parallel.completion): a watcher stamps call.t_done, or on CUDA the comm
        # records this event after the op on a side stream
        call.watch = True
        if self._cuda is not None:
            timed.ev_post, timed.anchor = self._cuda.record(), self._cuda.anchor
            call.ev_done = self._cuda.take()
        self._inflight.append(timed)
        return timed

    def end(self, ctx, call) -> None:
        if ctx.__class__ is _Stream:
            ctx.calls += 1
            ctx.bytes += call.nbytes
            ctx.blocked += call.blocked_s
            return
        if ctx is None:
            return
        stream = ctx.stream
        stream.calls += 1
        stream.bytes += call.nbytes
        stream.blocked += call.blocked_s
        ctx.nbytes, ctx.finished = call.nbytes, True
        if self._cuda is not None:
            # the comm recorded the event when the op completed; a caller feeding the monitor
            # itself (commpipe.monitor.megatron) did not: then completion is now
            if call.extra.get("ev_done_recorded"):
                ctx.ev_done = call.ev_done
            else:
                if call.ev_done is not None:
                    self._cuda.release(call.ev_done)
                ctx.ev_done = self._cuda.record()
        else:
            ctx.post, ctx.done = call.t_post, call.t_done
        self._finished.append(ctx)

    def _new_sampler(self, call) -> _Sampler:
        key = (call.dim, call.op, call.peer, call.group)
        stream = self._streams.get(key)
        if stream is None:
            base = stream_base(self.seed, call.dim, call.op, self.rank, call.peer, call.group)
            stream = self._streams[key] = _Stream(key, base)
        base = class_base(stream.base, call.size_class)
        sampler = _Sampler(stream, base, self.sample)
        self._samplers[(*key, call.size_class)] = sampler
        return sampler

    def record_compute(self, name: str, start_s: float, end_s: float) -> None:
        """A compute interval for the trace (perf_counter seconds on this rank)."""
        if self.trace:
            t0 = (start_s - self.offset - self.epoch) * 1e3
            t1 = (end_s - self.offset - self.epoch) * 1e3
            self._events.append(Event(self.rank, "compute", name, t0, t1, self._next_step))

    # -- per step -----------------------------------------------------------------------------------
    def end_step(self, step: int) -> None:
        """Collective: close `step` on this rank and write every record that is complete."""
        if self._closed or not self._synced:
            raise ValueError("end_step needs an attached, open Monitor (call attach() first)")
        counts = []
        for s in self._streams.values():
            counts.append((s.key, s.calls, s.bytes, s.blocked))
            s.calls = s.bytes = 0
            s.blocked = 0.0
        for t in self._finished:
            t.step = step
        self._unresolved.extend(self._finished)
        self._finished = []
        self._next_step = step + 1
        self._closings.append((step, counts))
        if not self.exchange_by_caller and (step + 1) % self.exchange_every == 0:
            self._exchange(force=False)
        if (step + 1) % self.resync_every == 0:
            self._sync_clock()

    def _sync_clock(self) -> None:
        self.offset = estimate_offset(self.comm, self.sync_rounds)
        if self._cuda is not None:
            self._cuda.calibrate()

    def _read(self, t: _Timed) -> bool:
        """Fill t.post/t.done (local clock) once known; False while the device is still busy."""
        if self._cuda is None:
            return True
        if not self._cuda.ready(t.ev_done):
            return False
        t.post = self._cuda.host_seconds(t.ev_post, t.anchor)
        t.done = self._cuda.host_seconds(t.ev_done, t.anchor)
        self._cuda.release(t.ev_post, t.ev_done)
        t.ev_post = t.ev_done = None
        return True

    def _post_of_inflight(self, t: _Timed):
        if self._cuda is None:
            return t.call.t_post
        if t.ev_post is not None and self._cuda.ready(t.ev_post):
            return self._cuda.host_seconds(t.ev_post, t.anchor)
        return None

    def _exchange(self, force: bool) -> None:
        self.exchange_ingest(self.comm.gather_objects(self.exchange_payload(force), "world"), force)

    def exchange_payload(self, force: bool = False) -> tuple:
        """This rank's part of an exchange (picklable): every rank's goes to `exchange_ingest`
        on every rank, in rank order."""
        off = self.offset
        samples, still = [], []
        for t in self._unresolved:
            if self._read(t):
                # the link was busy with this rank's previous message to the same peer until
                # it completed (if it completed first): the transfer starts no earlier
                prev, t.call.prev = t.call.prev, None
                after = prev.t_done - off if prev is not None and 0 < prev.t_done <= t.done else None
                samples.append((t.step, t.stream.key, t.mid, t.post - off, t.done - off, t.nbytes,
                                after))
                if self.trace:
                    self._dtypes[(t.stream.key, t.mid)] = t.call.dtype
            else:
                still.append(t)
        self._unresolved = still
        posts, keep = [], []
        for t in self._inflight:
            if t.finished:
                continue
            post = self._post_of_inflight(t)
            if post is None:
                keep.append(t)
            else:
                posts.append((t.stream.key, t.mid, post - off))
        self._inflight = keep
        closings, self._closings = self._closings, []
        step = self._next_step - 1
        mark = (min(t.step for t in still) - 1) if still else (float("inf") if force else step)
        return (self.rank, closings, samples, posts, mark)

    def exchange_ingest(self, payloads: list, force: bool = False) -> None:
        """Match every rank's `exchange_payload` (all of them, rank order) and write the
        records that are complete; `last_records` then holds this rank's latest step's."""
        step = self._next_step - 1
        for r, closed, r_samples, r_posts, r_mark in payloads:
            self._ingest(r, closed, r_samples, r_posts, r_mark, step)
        self._finalize(step, force)

    # -- matching and records -----------------------------------------------------------------------
    def _builds(self, rank: int) -> bool:
        return self.rank == 0 or rank == self.rank

    def _ingest(self, r, closings, samples, posts, mark, now) -> None:
        if self._builds(r):
            for c_step, counts in closings:
                self._steps.setdefault((r, c_step), [None, []])[0] = counts
            for s_step, *sample in samples:               # (key, mid, post, done, nbytes, after)
                if s_step > self._done_upto.get(r, -1):   # else it came after its step was written
                    self._steps.setdefault((r, s_step), [None, []])[1].append(tuple(sample))
            self._marks[r] = mark
        for _step, key, mid, post, *_ in samples:
            self._index(r, key, mid, post, now)
        for key, mid, post in posts:
            self._index(r, key, mid, post, now)

    def _index(self, r, key, mid, post, now) -> None:
        dim, op, peer, group = key
        if op in P2P_OPS:
            src, dst = (r, peer) if op == "send" else (peer, r)
            if self.rank == 0 or self.rank in (src, dst):
                self._p2p[(dim, src, dst, mid, op)] = (post, now)
        elif self.rank == 0 or self.rank in group:
            entry = self._coll.setdefault((dim, op, group, mid), [{}, now])
            entry[0][r] = post

    def _lookup(self, rank: int):
        def find(key, mid):
            dim, op, peer, group = key
            if op in P2P_OPS:
                src, dst, other = (rank, peer, "recv") if op == "send" else (peer, rank, "send")
                hit = self._p2p.get((dim, src, dst, mid, other))
                return hit[0] if hit else None
            hit = self._coll.get((dim, op, group, mid))
            return list(hit[0].values()) if hit and len(hit[0]) == len(group) else None
        return find

    def _finalize(self, now: int, force: bool) -> None:
        for r in (range(self.world) if self.rank == 0 else (self.rank,)):
            find = self._lookup(r)
            for s in sorted(st for (q, st) in self._steps if q == r):
                counts, samples = self._steps[(r, s)]
                complete = (self._marks.get(r, -1) >= s
                            and all(find(k, q) is not None for k, q, *_ in samples))
                if counts is None or not (force or complete or now - s >= self.max_lag):
                    break
                del self._steps[(r, s)]
                self._done_upto[r] = s
                records = build_records(r, s, counts, samples, find, self._ema.setdefault(r, {}),
                                        self.alpha, self.nodes)
                if r == self.rank:
                    self._write_own(s, records, samples, find)
                if self.rank == 0:
                    self._link_buf.setdefault(s, {})[r] = records
        if self.rank == 0:
            for s in sorted(self._link_buf):
                if len(self._link_buf[s]) < self.world and not force:
                    break
                for link in build_links(s, self._link_buf.pop(s)):
                    self._links_file.write(json.dumps(link) + "\n")
            self._links_file.flush()
        horizon = now - self.max_lag - 2
        self._p2p = {k: v for k, v in self._p2p.items() if v[1] >= horizon}
        self._coll = {k: v for k, v in self._coll.items() if v[1] >= horizon}

    def _write_own(self, step, records, samples, find) -> None:
        for rec in records:
            self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self.last_records = records
        if not self.trace:
            return
        for key, mid, post, done, nbytes, *after in samples:
            wait, xfer = split_times(key[1], post, done, find(key, mid), *after)
            args = comm_args(key, nbytes, self._dtypes.pop((key, mid), ""), self.rank, self.world,
                             self._groups)
            self._calls.append(comm_events(
                self.rank, step, key, mid, (post - self.epoch) * 1e3, (done - self.epoch) * 1e3,
                None if wait is None else wait * 1e3, None if xfer is None else xfer * 1e3, args))
        if self.trace_steps:   # bounded memory in long runs: drop steps older than the last N
            first = step - self.trace_steps + 1
            self._calls = [c for c in self._calls if c[0].step >= first]
            self._events = [e for e in self._events if e.step >= first]
