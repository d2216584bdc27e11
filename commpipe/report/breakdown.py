"""Where a step's time goes, measured from a run's timeline (train with --trace).

Every rank's traced step is cut at each event boundary; each piece goes to the first of these
that covers it:
  compute           a forward, backward or weight-gradient action runs;
  {dim} (exposed)   a call of that dimension moves data (its transfer part) and nothing computes
                    (EP: the dispatch/combine payload only; the row counts before it and the
                    gradient norm's scalar sum go to `other`);
  {dim} (exposed)   a TP/CP/DP collective waits for a late member (skew, also that dimension's);
  pp_wait           a pipeline call waits for the neighbour stage to post (the bubble);
  idle              nothing runs at all (also the bubble: a stage with no work).
The step's window is the same for every rank (first event to last event of that step over all
ranks), so the pieces of each rank add up to it. Values are ms per step, the mean over ranks,
then over the traced steps after the first (allocation and connection set-up), as the medians
elsewhere in the report leave the warm-up out.
"""

from __future__ import annotations

from pathlib import Path

from commpipe.report.tables import after_warmup

DIM_ORDER = ("pp", "tp", "cp", "dp", "ep", "other")
PARTS = ("compute", *DIM_ORDER, "pp_wait", "idle")
# edp: the expert gradients' reduction over the ranks holding the same experts (data parallel)
STREAM_DIMS = {"pp": "pp", "tp": "tp", "cp": "cp", "dp": "dp", "dp_cp": "dp", "edp": "dp", "ep": "ep"}
# lower wins where pieces overlap
_RANK = {"compute": 0, **{d: 1 for d in DIM_ORDER}, "skew": 2, "pp_wait": 3}


def stream_dim(stream: str) -> str:
    """Dimension of a timeline stream ("pp.1" is a second pipeline lane; "world" is not a link)."""
    return STREAM_DIMS.get(stream.split(".")[0], "other")


def _pieces(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, part) of one rank's step; a call splits into its wait (first) and transfer."""
    out = []
    for e in events:
        start, end = e["start_ms"], e["end_ms"]
        if end <= start:
            continue
        if e["stream"] == "compute":
            out.append((start, end, "compute"))
            continue
        if e.get("name") == "wait":        # the monitor's nested slice; the call's args say it
            continue
        dim = stream_dim(e["stream"])
        if dim == "ep" and e.get("name") != "all_to_all":
            dim = "other"
        wait = min((e.get("args") or {}).get("wait_ms") or 0.0, end - start)
        if wait > 0:
            out.append((start, start + wait, "pp_wait" if dim == "pp" else f"skew:{dim}"))
        out.append((start + wait, end, dim))
    return out


def split_window(events: list[dict], t0: float, t1: float) -> dict[str, float]:
    """ms of each part (PARTS) of one rank's events within [t0, t1]; they sum to t1 - t0."""
    marks = []
    for start, end, part in _pieces(events):
        start, end = max(start, t0), min(end, t1)
        if end > start:
            marks += [(start, 1, part), (end, -1, part)]
    marks.sort(key=lambda m: (m[0], m[1]))
    out = dict.fromkeys(PARTS, 0.0)
    active: dict[str, int] = {}
    last = t0
    for t, delta, part in marks:
        if t > last:
            live = [p for p, n in active.items() if n > 0]
            if live:
                top = min(live, key=lambda p: (_RANK.get(p.split(":")[0], 1),
                                               DIM_ORDER.index(p.split(":")[-1]) if ":" in p or p in DIM_ORDER
                                               else 0))
                out[top.split(":")[-1]] += t - last
            else:
                out["idle"] += t - last
            last = t
        active[part] = active.get(part, 0) + delta
    out["idle"] += max(t1 - last, 0.0)
    return out


def step_breakdown(events: list[dict]) -> dict[str, float]:
    """Mean over ranks of split_window over the step's common window; adds window_ms."""
    by_rank: dict = {}
    for e in events:
        by_rank.setdefault(e["rank"], []).append(e)
    t0 = min(e["start_ms"] for e in events)
    t1 = max(e["end_ms"] for e in events)
    splits = [split_window(evs, t0, t1) for evs in by_rank.values()]
    out = {p: sum(s[p] for s in splits) / len(splits) for p in PARTS}
    out["window_ms"] = t1 - t0
    return out


def run_breakdown(run_dir, warmup: int = 1) -> dict | None:
    """Mean step_breakdown over the traced steps after `warmup` of them; None without a trace.
    Keys: PARTS, window_ms, bubble_ms (pp_wait + idle), exposed_ms (every dimension's), steps."""
    from commpipe.timeline import load_events

    events = [e for e in load_events(Path(run_dir)) if isinstance(e.get("rank"), int)]
    if not events:
        return None
    by_step: dict = {}
    for e in events:
        by_step.setdefault(e.get("step", 0), []).append(e)
    steps = after_warmup(sorted(by_step), warmup)
    parts = [step_breakdown(by_step[s]) for s in steps]
    out = {k: sum(p[k] for p in parts) / len(parts) for k in (*PARTS, "window_ms")}
    out["bubble_ms"] = out["pp_wait"] + out["idle"]
    out["exposed_ms"] = sum(out[d] for d in DIM_ORDER)
    out["steps"] = steps
    return out
