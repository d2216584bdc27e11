"""Measured against predicted: a traced training run beside its simulation.

    commpipe train --pp 2 --schedule 1f1b --steps 4 --out runs/r --trace   (under torchrun)
    commpipe simulate --compare runs/r --trace overlay.json --png overlay.png

`commpipe train --trace` records the last step's per-action timeline of every rank
(`trace/actions_rank{r}.jsonl`, the shared Event schema). Here a cost table is calibrated from
that run (median measured F, B, I, W time per stage; point-to-point cost from the fastest
receives, when the data was already there), the same Program is simulated, and each pipeline
rank's measured and predicted busy time and finish time are reported side by side.

With tensor parallelism and the communication monitor's trace (`--comm-monitor all --trace`),
the TP collectives get their own cost: a plain action's compute, without the time it waited
for its collectives, is the stage's cost, and that wait is the simulator's `tp_comm`
(`tp_split`). Braided actions (stp, dualpipev) are then timed with their collectives on the TP
stream, hidden behind the other pass, as they ran. Without that trace, a plain action's time
includes its blocking collectives and braids are timed as their two passes' plain times.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from commpipe.parallel.dims import DEFAULT_ORDER, ParallelDims
from commpipe.schedules import Action, generate
from commpipe.sim.costs import CostTable
from commpipe.sim.engine import SimResult, simulate
from commpipe.timeline import Event, events_from_dicts, write_chrome_trace


@dataclass
class Comparison:
    program_name: str
    measured_makespan: float          # ms, from the first compute start to the last compute end
    predicted_makespan: float
    measured_busy: list[float]        # per pipeline rank, ms of compute
    predicted_busy: list[float]
    measured_end: list[float]         # per pipeline rank, when its last compute ended
    predicted_end: list[float]
    costs: CostTable
    result: SimResult
    measured_events: list[Event]

    @property
    def makespan_error(self) -> float:
        return (self.predicted_makespan - self.measured_makespan) / self.measured_makespan

    def to_dict(self) -> dict:
        return {"schedule": self.program_name, "measured_makespan_ms": self.measured_makespan,
                "predicted_makespan_ms": self.predicted_makespan,
                "makespan_error": self.makespan_error, "measured_busy_ms": self.measured_busy,
                "predicted_busy_ms": self.predicted_busy, "measured_end_ms": self.measured_end,
                "predicted_end_ms": self.predicted_end}

    def table(self) -> str:
        lines = [f"{self.program_name}: measured makespan {self.measured_makespan:.2f} ms, "
                 f"predicted {self.predicted_makespan:.2f} ms ({self.makespan_error:+.1%})",
                 "pp rank | busy measured | busy predicted | end measured | end predicted | diff"]
        for r, (bm, bp, em, ep) in enumerate(zip(self.measured_busy, self.predicted_busy,
                                                  self.measured_end, self.predicted_end)):
            lines.append(f"{r:>7} | {bm:>13.2f} | {bp:>14.2f} | {em:>12.2f} | {ep:>13.2f} | "
                         f"{(ep - em) / em:+.1%}")
        return "\n".join(lines)


def load_run(run_dir) -> tuple[dict, dict[int, list[Event]]]:
    """(config.json, {pp_rank: events of the rank with dp=cp=tp=0 on that stage})."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {run_dir} a `commpipe train --out` folder?")
    cfg = json.loads(cfg_path.read_text())
    d = cfg["dims"]
    dims = ParallelDims(dp=d["dp"], pp=d["pp"], cp=d["cp"], tp=d["tp"],
                        order=d.get("order", DEFAULT_ORDER))
    per_stage = {}
    for pp_rank in range(dims.pp):
        rank = dims.rank_of(pp=pp_rank)
        path = run_dir / "trace" / f"actions_rank{rank}.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: train with --trace to record the timeline")
        per_stage[pp_rank] = events_from_dicts(json.loads(x) for x in path.read_text().splitlines())
    return cfg, per_stage


def measured_bubble(per_rank: dict[int, list[Event]]) -> float:
    """Idle share of the traced step, the simulator's bubble_fraction measured: the mean over
    pipeline ranks of 1 - compute busy time / (last compute end - first compute start)."""
    compute = {r: [e for e in evs if e.stream == "compute"] for r, evs in per_rank.items()}
    start = min(e.start_ms for evs in compute.values() for e in evs)
    end = max(e.end_ms for evs in compute.values() for e in evs)
    return statistics.mean(1 - sum(e.dur_ms for e in evs) / (end - start)
                           for evs in compute.values())


def tp_split(run_dir) -> dict[int, dict]:
    """Per rank (global), from the monitor's Chrome trace (trace/rank{r}.json, which splits each
    action's compute at its collectives and records the action's whole time): for every plain
    F, B or I, its compute time and the rest, the time it waited for its TP collectives, over
    all traced steps but the first; {rank: {"compute": {(stage, op): [ms]}, "tp": [ms]}}.
    Empty when the run has no such trace."""
    from commpipe.timeline import load_events

    chrome = Path(run_dir) / "trace"
    if not any(chrome.glob("rank*.json")):
        return {}
    parts: dict[tuple, list] = {}                 # (rank, step, action) -> [compute ms, action ms]
    for e in load_events(Path(run_dir)):
        if e["stream"] != "compute" or "action_ms" not in e.get("args", {}):
            continue
        cell = parts.setdefault((e["rank"], e.get("step", 0), e["name"]), [0.0, e["args"]["action_ms"]])
        cell[0] += e["end_ms"] - e["start_ms"]
    first = min((step for _, step, _ in parts), default=0)
    out: dict[int, dict] = {}
    for (rank, step, name), (compute, whole) in parts.items():
        a = Action.parse(name)
        if step == first or a.pair is not None or a.unit or a.op not in ("F", "B", "I", "W"):
            continue
        got = out.setdefault(rank, {"compute": {}, "tp": []})
        got["compute"].setdefault((a.stage, a.op), []).append(compute)
        if a.op != "W":
            got["tp"].append(max(whole - compute, 0.0))
    return out


def calibrate(program, per_rank: dict[int, list[Event]], activation_bytes: float,
              split: dict[int, dict] | None = None) -> CostTable:
    """Median measured compute time per (stage, op) plus the median host time between compute
    actions; point-to-point cost from the fastest receives.

    split: `tp_split` of a TP run. A plain F, B or I waited for all of its TP collectives; its
    compute alone is then the stage's cost, and the median wait of the plain passes is the
    `tp_comm` of every stage ("exposed" for plain actions, the TP stream for braids). Braided
    actions' own times are not used: they are what the simulator predicts from their passes."""
    durations: dict[tuple[int, str], list[float]] = {}
    recv_waits = []
    for events in per_rank.values():
        for e in events:
            a = Action.parse(e.name)
            if e.stream == "compute":
                durations.setdefault((a.stage, a.op), []).append(e.dur_ms)
            elif a.op.startswith("RECV"):
                recv_waits.append(e.dur_ms)

    tp = 0.0
    if split:
        durations = {}
        for got in split.values():
            for key, vals in got["compute"].items():
                durations.setdefault(key, []).extend(vals)
        tp = statistics.median(x for got in split.values() for x in got["tp"])

    def med(stage, op, default=0.0):
        vals = durations.get((stage, op))
        return statistics.median(vals) if vals else default

    # the host loop's own time between two compute actions (posting receives and sends,
    # Python) that was not spent waiting for a peer: charged to every compute action
    gaps = []
    for events in per_rank.values():
        evs = sorted(events, key=lambda e: e.start_ms)
        last_end, waited = None, 0.0
        for e in evs:
            if e.stream != "compute":
                waited += e.dur_ms
                continue
            if last_end is not None:
                gaps.append(max(e.start_ms - last_end - waited, 0.0))
            last_end, waited = e.end_ms, 0.0
    host = statistics.median(gaps) if gaps else 0.0
    n = program.num_stages
    f = [med(s, "F") + host for s in range(n)]
    i = [med(s, "I") + host for s in range(n)]
    w = [med(s, "W") + host for s in range(n)]
    b = [med(s, "B", i[s] + w[s] - host) + host for s in range(n)]
    has_i = any(durations.get((s, "I")) for s in range(n))
    # the quickest receives found their data waiting: what is left is the transfer itself
    recv_waits.sort()
    fastest = recv_waits[: max(1, len(recv_waits) // 10)] if recv_waits else [0.0]
    return CostTable(f=f, b=b, i=i if has_i else None, w=w if has_i else None,
                     latency_ms=statistics.median(fastest), activation_bytes=activation_bytes,
                     tp_comm=[tp] * n if split else None)


def calibrate_run(run_dir):
    """(the run's Program, the CostTable calibrated from its trace, the traced events per
    pipeline rank), as `simulate --compare` uses them."""
    cfg, per_rank = load_run(run_dir)
    d = cfg["dims"]
    program = generate(cfg["schedule"], d["pp"], cfg["microbatches"], cfg.get("vpp", 1))
    spec = cfg["spec"]
    act_bytes = 4.0 * cfg["micro_batch_size"] * (cfg["seq_len"] // d["cp"]) * spec["hidden"]
    split = None
    if d["tp"] > 1:
        dims = ParallelDims(dp=d["dp"], pp=d["pp"], cp=d["cp"], tp=d["tp"],
                            order=d.get("order", DEFAULT_ORDER))
        ranks = {dims.rank_of(pp=r): r for r in range(d["pp"])}
        split = {ranks[k]: v for k, v in tp_split(run_dir).items() if k in ranks} or None
    return program, calibrate(program, per_rank, act_bytes, split), per_rank


def compare_run(run_dir) -> Comparison:
    program, costs, per_rank = calibrate_run(run_dir)
    res = simulate(program, costs)
    measured_busy, measured_end, starts = [], [], []
    for r in range(program.pp):
        compute = [e for e in per_rank[r] if e.stream == "compute"]
        measured_busy.append(sum(e.dur_ms for e in compute))
        measured_end.append(max(e.end_ms for e in compute))
        starts.append(min(e.start_ms for e in compute))
    origin = min(starts)
    measured_end = [e - origin for e in measured_end]
    predicted_end = []
    for r in range(program.pp):
        ends = [e.end_ms for e in res.events if e.rank == r and e.stream == "compute"]
        predicted_end.append(max(ends))
    measured = [e for r in per_rank for e in per_rank[r]]
    return Comparison(program.name, max(measured_end), res.makespan, measured_busy,
                      list(res.busy), measured_end, predicted_end, costs, res, measured)


def overlay_trace(cmp: Comparison, path) -> Path:
    """One Chrome trace: measured ranks as processes 0..p-1, predicted as 1000+r."""
    events = list(cmp.measured_events)
    for e in cmp.result.events:
        events.append(Event(1000 + e.rank, e.stream, e.name, e.start_ms, e.end_ms, e.step,
                            {"predicted": True}))
    return write_chrome_trace(events, path)
