"""One record schema for timelines, measured (runtime, monitor) or predicted (simulator).

An `Event` is one interval on one rank and stream; `write_chrome_trace` turns a list of them
into Chrome/Perfetto trace JSON (one process per rank, one thread per stream), with
`distributedInfo` first in a per-rank file. The measured traces of `commpipe train --trace`,
laid out for Holistic Trace Analysis (kernels, streams, launches, steps), are built from the
same events by commpipe.monitor.trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

STREAMS = ("compute", "pp", "tp", "cp", "dp", "dp_cp", "world")


@dataclass
class Event:
    rank: int
    stream: str          # "compute" or a communication dimension (pp, tp, cp, dp, ...)
    name: str            # an action string ("1F3", "0SEND_F2") or an op name ("all_reduce")
    start_ms: float      # on a clock shared by all ranks of the run (aligned when measured)
    end_ms: float
    step: int = 0
    args: dict = field(default_factory=dict)

    @property
    def dur_ms(self) -> float:
        return self.end_ms - self.start_ms

    def to_dict(self) -> dict:
        # written out: dataclasses.asdict deep-copies field by field, ~10x slower, and the
        # adaptive controller converts every step's timeline
        return {"rank": self.rank, "stream": self.stream, "name": self.name,
                "start_ms": self.start_ms, "end_ms": self.end_ms, "step": self.step,
                "args": dict(self.args)}


def events_from_dicts(rows) -> list[Event]:
    return [Event(**r) for r in rows]


def chrome_trace(events: list[Event], rank: int | None = None, world_size: int | None = None,
                 distributed_info: dict | None = None) -> dict:
    """A Chrome trace object ({"traceEvents": [...]}) for `events` (all ranks or one)."""
    out = []
    tids = {s: i for i, s in enumerate(STREAMS)}
    seen = set()
    for e in events:
        if rank is not None and e.rank != rank:
            continue
        tid = tids.setdefault(e.stream, len(tids))
        if (e.rank, e.stream) not in seen:
            seen.add((e.rank, e.stream))
            out.append({"ph": "M", "name": "thread_name", "pid": e.rank, "tid": tid,
                        "args": {"name": e.stream}})
            out.append({"ph": "M", "name": "process_name", "pid": e.rank, "tid": 0,
                        "args": {"name": f"rank {e.rank}"}})
        cat = "kernel" if e.stream == "compute" else "comm"
        out.append({"ph": "X", "name": e.name, "cat": cat, "pid": e.rank, "tid": tid,
                    "ts": e.start_ms * 1000.0, "dur": max(e.dur_ms, 0.0) * 1000.0,
                    "args": {"step": e.step, **e.args}})
    trace = {}
    if rank is not None:
        # first: HTA takes a file's rank from the first `"rank": N` in it
        trace["distributedInfo"] = {"rank": rank, "world_size": world_size or 1,
                                    **(distributed_info or {})}
    trace.update(traceEvents=out, displayTimeUnit="ms")
    return trace


def write_chrome_trace(events: list[Event], path, rank: int | None = None,
                       world_size: int | None = None, distributed_info: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, rank, world_size, distributed_info)))
    return path


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a .jsonl file, one a line; unreadable files and lines are skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_events(run_dir: Path) -> list[dict]:
    """Timeline events (commpipe.timeline schema) of a run: the monitor's Chrome traces
    (trace/rank*.json: compute and the timed calls of every dimension) when present, else the
    runtime's action timeline (trace/*.jsonl: compute and pipeline transfers of the last step),
    else any Chrome trace in trace/."""
    trace_dir = run_dir / "trace"
    chrome = sorted(trace_dir.glob("rank*.json"))
    if not chrome:
        events = [e for path in sorted(trace_dir.glob("*.jsonl")) for e in _read_jsonl(path)]
        if events:
            return events
        chrome = sorted(trace_dir.glob("*.json"))
    events = []
    for path in chrome:
        try:
            trace = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        items = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in items
                   if e.get("ph") == "M" and e.get("name") == "thread_name"}
        for e in items:
            # the host thread (step marks, annotations, launches) repeats the device tracks
            if e.get("ph") == "X" and threads.get((e["pid"], e.get("tid"))) != "host":
                start = e["ts"] / 1000.0
                events.append({"rank": e["pid"], "stream": threads.get((e["pid"], e.get("tid")), "compute"),
                               "name": e.get("name", ""), "start_ms": start,
                               "end_ms": start + e.get("dur", 0) / 1000.0,
                               "step": (e.get("args") or {}).get("step", 0), "args": e.get("args") or {}})
    return events
