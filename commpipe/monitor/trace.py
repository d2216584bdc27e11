"""Chrome/Perfetto traces of the monitor: one file per rank, HTA-style communication args.

Communication events carry the argument names the PyTorch profiler writes for collectives
(record_param_comms), which Holistic Trace Analysis and similar tools read: "Collective name",
"In msg nelems", "Out msg nelems", "Group size", "dtype" (c10 scalar-type name),
"In split size", "Out split size", "Process Group Name", "Process Group Description",
"Process Group Ranks", plus "Src Rank"/"Dst Rank" on send/recv. Collective names follow the
profiler's ("allreduce", "_allgather_base", "_reduce_scatter_base", "broadcast", "send", "recv").
Process group names are commpipe's stable numbering: "0" is the world, then every group of
every dimension in the order Comm creates them (tp, cp, dp, pp, dp_cp).
"""

from __future__ import annotations

import json
from pathlib import Path

from commpipe.timeline import Event, chrome_trace

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


def write_trace(events: list[Event], path, rank: int, world: int, backend: str,
                groups: dict) -> Path:
    """Chrome trace JSON built by commpipe.timeline, plus the process-group table HTA reads."""
    trace = chrome_trace(events, rank, world, {
        "backend": backend,
        "pg_count": len(groups),
        "pg_config": [{"pg_name": name, "pg_desc": desc, "backend_config": backend,
                       "ranks": list(ranks)} for ranks, (name, desc) in groups.items()],
    })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path
