"""Chrome/Perfetto traces of the monitor: one file per rank, laid out as Holistic Trace Analysis
(HTA) reads a PyTorch profiler (Kineto) trace.

What HTA needs, read from its source (hta/common/trace*.py, hta/utils/utils.py, 0.5.0):
- the rank: the first `"rank": N` in the file (so `distributedInfo` is written first);
- device work ("kernels"): `cat` "kernel" with an integer `args.stream` >= 0 and an
  `args.correlation` >= 0 shared with the host event that issued it (the "launch": HTA joins
  them for idle-time causes and keeps only kernels whose launch lies in an analysed step);
- communication is a kernel whose name matches `^nccl.*Kernel`; every other kernel is
  computation (bar Memcpy/Memset/Sync names);
- steps: host annotations named `ProfilerStep#N` (the last one is dropped by default, as HTA
  does for Kineto traces);
- integer microsecond `ts`/`dur` (HTA re-rounds float timestamps and can make short slices
  negative).

On CPU the "device" is the host thread that runs the compute, so: each compute action is a
kernel on stream 7 (Kineto's number for the default CUDA stream) *minus* the communication calls
issued and completed inside it (the TP/CP collectives a forward or backward blocks on); every
communication call is a kernel named after NCCL's (`ncclKernel_AllReduce`, `ncclKernel_Send`,
...; `args.backend` says gloo) on its dimension's stream, with the PyTorch profiler's
communication args (record_param_comms): "Collective name", "In msg nelems", "Out msg nelems",
"Group size", "dtype" (c10 scalar-type name), "In split size", "Out split size",
"Process Group Name", "Process Group Description", "Process Group Ranks", plus
"Src Rank"/"Dst Rank" on send/recv. Collective names follow the profiler's ("allreduce",
"_allgather_base", "_reduce_scatter_base", "broadcast", "send", "recv"). Process group names
are commpipe's stable numbering: "0" is the world, then every group of every dimension in the
order Comm creates them (tp, cp, dp, pp, dp_cp). The host thread carries `ProfilerStep#N`, the
action names as annotations, and one launch per kernel (`compute`, `record_param_comms`).
Slices of one thread nest, as Perfetto requires.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from itertools import count
from pathlib import Path

from commpipe.timeline import Event

PROFILER_NAMES = {"all_reduce": "allreduce", "all_gather": "_allgather_base",
                  "reduce_scatter": "_reduce_scatter_base", "broadcast": "broadcast",
                  "send": "send", "recv": "recv"}

# torch dtype -> (c10 ScalarType name, bytes per element)
C10_DTYPES = {"torch.float32": ("Float", 4), "torch.float16": ("Half", 2),
              "torch.bfloat16": ("BFloat16", 2), "torch.float64": ("Double", 8),
              "torch.int64": ("Long", 8), "torch.int32": ("Int", 4), "torch.int16": ("Short", 2),
              "torch.int8": ("Char", 1), "torch.uint8": ("Byte", 1), "torch.bool": ("Bool", 1),
              "torch.float8_e4m3fn": ("Float8_e4m3fn", 1), "torch.float8_e5m2": ("Float8_e5m2", 1)}


def group_table(dims) -> dict[tuple, tuple[str, str]]:
    """Ranks tuple -> (process group name, description), identical on every rank."""
    from commpipe.parallel.comm import GROUP_DIMS

    table = {tuple(range(dims.world_size)): ("0", "default_pg")}
    for dim in GROUP_DIMS:
        for ranks in dims.groups(dim):
            if len(ranks) > 1:
                table.setdefault(tuple(ranks), (str(len(table)), dim))
    return table


def comm_args(key, nbytes: int, dtype: str, rank: int, world: int, groups: dict) -> dict:
    dim, op, peer, group = key
    c10, size = C10_DTYPES.get(dtype, (dtype.replace("torch.", ""), 1))
    n_in = nbytes // size
    if op in ("send", "recv"):
        # commpipe issues p2p on the default (world) group, as the profiler would record it
        ranks, n = tuple(range(world)), world
        n_out = n_in
    else:
        ranks, n = tuple(group), len(group)
        n_out = n_in * n if op == "all_gather" else (n_in // n if op == "reduce_scatter" else n_in)
    args = {"Collective name": PROFILER_NAMES.get(op, op), "In msg nelems": n_in,
            "Out msg nelems": n_out, "Group size": n, "dtype": c10, "In split size": "[]",
            "Out split size": "[]", "Process Group Name": groups.get(ranks, ("?", ""))[0],
            "Process Group Description": dim, "Process Group Ranks": str(list(ranks)),
            "Rank": rank}
    if op in ("send", "recv"):
        args["Src Rank"], args["Dst Rank"] = (rank, peer) if op == "send" else (peer, rank)
    return args


def comm_events(rank: int, step: int, key, mid, start_ms: float, end_ms: float,
                wait_ms, transfer_ms, args: dict) -> list[Event]:
    """The call on its dimension's track, with its wait as a nested child slice.
    `mid` is the call's sequence number, or (tag, seq) for a tagged point-to-point message."""
    dim, op, peer, group = key
    tag, seq = mid if isinstance(mid, tuple) else (0, mid)
    full = dict(args, seq=seq, tag=tag, wait_ms=wait_ms, transfer_ms=transfer_ms)
    out = [Event(rank, dim, op, start_ms, end_ms, step, full)]
    if wait_ms:
        who = f"rank {peer}" if peer is not None else "the group's last rank"
        out.append(Event(rank, dim, "wait", start_ms, start_ms + wait_ms, step,
                         {"waiting for": who, "seq": seq, "tag": tag}))
    return out


def lay_out(calls: list[list[Event]]) -> list[Event]:
    """Flatten per-call event lists onto tracks where slices nest properly.

    Async ops of one dimension overlap (an isend in flight while an irecv runs), and Chrome
    traces require the slices of one thread to nest; overlapping calls therefore go to extra
    lanes "pp.1", "pp.2", ... (greedy interval partitioning), each call with its wait slice.
    """
    lanes: dict[str, list[float]] = {}
    out = []
    for evs in sorted(calls, key=lambda evs: evs[0].start_ms):
        head = evs[0]
        ends = lanes.setdefault(head.stream, [])
        lane = next((i for i, end in enumerate(ends) if end <= head.start_ms), len(ends))
        if lane == len(ends):
            ends.append(head.end_ms)
        ends[lane] = head.end_ms
        stream = head.stream if lane == 0 else f"{head.stream}.{lane}"
        for e in evs:
            e.stream = stream
            out.append(e)
    return out


COMPUTE_STREAM = 7     # Kineto's stream number for the default CUDA stream
HOST_TID = 0
NCCL_KERNELS = {"all_reduce": "AllReduce", "all_gather": "AllGather",
                "reduce_scatter": "ReduceScatter", "broadcast": "Broadcast", "send": "Send",
                "recv": "Recv"}


def kernel_name(op: str) -> str:
    """HTA counts a kernel as communication when its name matches ^nccl.*Kernel."""
    return f"ncclKernel_{NCCL_KERNELS.get(op, op)}"


def split_compute(compute: list[Event], calls: list[Event]):
    """[(compute event, its busy parts [(start, end)], the calls it blocked on)].

    A call issued and completed inside a compute action (a TP/CP collective of a forward or
    backward: Comm's collectives there are synchronous) kept the host, and so the compute,
    waiting from post to completion; that time is communication, not computation."""
    heads = sorted(calls, key=lambda e: e.start_ms)
    starts = [e.start_ms for e in heads]
    out = []
    for c in compute:
        inside = []
        i = bisect_left(starts, c.start_ms)
        while i < len(heads) and heads[i].start_ms <= c.end_ms:
            if heads[i].end_ms <= c.end_ms:
                inside.append(heads[i])
            i += 1
        parts, cur = [], c.start_ms
        for h in inside:
            if h.start_ms > cur:
                parts.append((cur, h.start_ms))
            cur = max(cur, h.end_ms)
        if c.end_ms > cur:
            parts.append((cur, c.end_ms))
        out.append((c, parts, inside))
    return out


def hta_trace(compute: list[Event], calls: list[list[Event]], rank: int, world: int,
              backend: str, groups: dict) -> dict:
    """The trace object of one rank: compute intervals and per-call event lists (the call,
    then its nested wait slice), on one clock in ms."""
    def us(ms: float) -> int:
        return round(ms * 1000.0)

    def x(name, cat, tid, start, end, args):
        ts = us(start)
        return {"ph": "X", "name": name, "cat": cat, "pid": rank, "tid": tid, "ts": ts,
                "dur": max(us(end) - ts, 0), "args": args}

    lay_out(calls)                        # overlapping calls of a dimension: extra lanes
    heads = [evs[0] for evs in calls]
    tracks = sorted({h.stream for h in heads}, key=lambda s: (s.split(".")[0], len(s), s))
    stream_of = {"compute": COMPUTE_STREAM}
    for name in tracks:
        stream_of[name] = COMPUTE_STREAM + len(stream_of)
    correlation = count(1)
    device, host = [], []                 # host: (step, event)
    blocking = set()
    for c, parts, inside in split_compute(compute, heads):
        blocking.update(id(h) for h in inside)
        host.append((c.step, x(c.name, "user_annotation", HOST_TID, c.start_ms, c.end_ms,
                               {"step": c.step})))
        for start, end in parts:
            if us(end) <= us(start):
                continue
            cid = next(correlation)
            host.append((c.step, x("compute", "cpu_op", HOST_TID, start, end,
                                   {"correlation": cid, "External id": cid, "step": c.step})))
            device.append(x(c.name, "kernel", COMPUTE_STREAM, start, end,
                            {"stream": COMPUTE_STREAM, "correlation": cid, "step": c.step,
                             "action_ms": c.dur_ms}))
    for evs in calls:
        head, sid, cid = evs[0], stream_of[evs[0].stream], next(correlation)
        device.append(x(kernel_name(head.name), "kernel", sid, head.start_ms, head.end_ms,
                        dict(head.args, stream=sid, correlation=cid, step=head.step,
                             backend=backend)))
        for w in evs[1:]:                 # no stream: a marker inside the kernel, not a kernel
            device.append(x(w.name, "comm_wait", sid, w.start_ms, w.end_ms,
                            dict(w.args, step=w.step)))
        # a blocking call holds the host until it completes; others return once posted
        end = head.end_ms if id(head) in blocking else head.start_ms
        host.append((head.step, x("record_param_comms", "cpu_op", HOST_TID, head.start_ms, end,
                                  dict(head.args, correlation=cid, step=head.step,
                                       **{"External id": cid}))))
    steps: dict[int, list[int]] = {}
    for step, e in host:
        span = steps.setdefault(step, [e["ts"], e["ts"] + e["dur"]])
        span[0], span[1] = min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])
    marks, prev_end = [], None
    for step in sorted(steps):
        lo, hi = steps[step]
        lo = lo if prev_end is None else max(lo, prev_end)
        marks.append({"ph": "X", "name": f"ProfilerStep#{step}", "cat": "user_annotation",
                      "pid": rank, "tid": HOST_TID, "ts": lo, "dur": max(hi - lo, 0),
                      "args": {"step": step}})
        prev_end = hi
    meta = [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": HOST_TID,
             "args": {"name": "host"}}]
    meta += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": sid, "args": {"name": name}}
             for name, sid in stream_of.items()]
    events = marks + [e for _, e in host] + device
    events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))   # parents before children
    info = {"rank": rank, "world_size": world, "backend": backend, "pg_count": len(groups),
            "pg_config": [{"pg_name": name, "pg_desc": desc, "backend_config": backend,
                           "ranks": list(ranks)} for ranks, (name, desc) in groups.items()]}
    # distributedInfo first: HTA takes a file's rank from the first `"rank": N` in it
    return {"distributedInfo": info, "schemaVersion": 1, "displayTimeUnit": "ms",
            "traceEvents": meta + events}


def write_trace(compute: list[Event], calls: list[list[Event]], path, rank: int, world: int,
                backend: str, groups: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hta_trace(compute, calls, rank, world, backend, groups)))
    return path
