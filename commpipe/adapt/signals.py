"""Per-step signals of one rank, and their merge over every rank.

From the runtime's timeline of the step (`PipelineRuntime.events`, the one `--trace` records):
compute time per action and per rank. From the monitor's records of the step
before (`Monitor.last_records`: the monitor's exchange of step s rides in the controller's gather
after step s, so a rank's summary of step s carries the records of step s - 1): per-link
point-to-point transfer time and bandwidth with their link class, and collective transfer times. Fields are
read defensively: a record without timing (nothing sampled that step) gives no observation.
"""

from __future__ import annotations

import statistics

from commpipe.monitor.records import algbw_bytes, busbw_factor

P2P_RECV = "recv"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


class CollectiveTimer:
    """A Comm observer that times every large collective (one tuple per call, no device
    sync). The monitor samples one call in ten; a once-per-step gradient all-reduce would then
    give one observation in ten steps, too few to detect a change within a few steps.

    Each rank keeps its calls' post and completion times; `step_signals` lines up the members'
    calls of a group (they issue them in the same order) and counts a call's transfer from the
    *last* member's post, so a member that arrives late (a straggler) shows as waiting, not as
    a slower collective. Clocks are the monitor's rank-0-aligned ones (Monitor.offset)."""

    def __init__(self, min_bytes: int):
        self.min_bytes = min_bytes
        self.calls: list[tuple] = []

    def begin(self, call):
        if call.op in COLLECTIVES and call.dim != "world" and call.nbytes >= self.min_bytes:
            return call
        return None

    def end(self, ctx, call) -> None:
        if ctx is not None:
            self.calls.append((call.dim, call.op, tuple(call.group), call.nbytes,
                               call.t_post, call.t_done))

    def take(self) -> list[tuple]:
        out, self.calls = self.calls, []
        return out


def _link_class(rec: dict, rank: int, peer: int, ranks_per_node: int) -> str:
    cls = rec.get("link_class")
    if cls in ("intra_node", "inter_node"):
        return cls
    return "intra_node" if rank // ranks_per_node == peer // ranks_per_node else "inter_node"


def rank_summary(trainer, step: int, ranks_per_node: int, timer: CollectiveTimer | None = None
                 ) -> dict:
    """This rank's signals of `step` (a small picklable dict)."""
    rank = trainer.comm.rank
    compute: dict[str, list[float]] = {}
    for e in trainer.runtime.events or ():
        if e.stream == "compute":
            op = e.name.lstrip("0123456789").split(".")[0][:1]
            compute.setdefault(op, []).append(e.dur_ms)
    links, colls = {}, {}
    records = getattr(trainer.monitor, "last_records", None) or []
    for r in records:   # step - 1's: exchanged in the gather this summary goes out in
        if r.get("step") != step - 1 or r.get("transfer_ms") is None:
            continue
        if r.get("op") == P2P_RECV and r.get("peer") is not None:
            calls = max(r.get("sampled") or r.get("calls") or 1, 1)
            per_call_bytes = (r.get("bytes") or 0) / max(r.get("calls") or 1, 1)
            links[(r["dim"], int(r["peer"]), rank)] = {
                "transfer_ms": float(r["transfer_ms"]),
                "bandwidth_gbps": r.get("bandwidth_gbps"),
                "bytes": per_call_bytes, "sampled": calls, "calls": r.get("calls") or calls,
                "link_class": _link_class(r, rank, int(r["peer"]), ranks_per_node)}
        elif r.get("group") and timer is None:
            colls[(r["dim"], r.get("op"), tuple(r["group"]))] = {
                "transfer_ms": float(r["transfer_ms"]), "busbw_gbps": r.get("busbw_gbps"),
                "bytes": (r.get("bytes") or 0) / max(r.get("calls") or 1, 1)}
    timed: dict = {}
    offset = getattr(trainer.monitor, "offset", 0.0) or 0.0
    for dim, op, group, nbytes, post, done in (timer.take() if timer is not None else ()):
        timed.setdefault((dim, op, group), []).append((nbytes, post - offset, done - offset))
    return {"rank": rank, "step": step, "timed": timed,
            "busy_ms": sum(sum(v) for v in compute.values()),
            "compute_ms": {op: statistics.median(v) for op, v in compute.items()},
            "links": links, "collectives": colls}


def slowest_step_ms(summaries: list[dict]) -> float:
    """The step time of one step as every rank sees it: the slowest rank's (`step_ms` of each
    rank's summary). A rank's own differs from its peers' by what it waited."""
    return max(s["step_ms"] for s in summaries)


def step_signals(summaries: list[dict]) -> dict[tuple[str, str], float | None]:
    """Series values of one step from every rank's summary: ("compute", "rank r") busy ms,
    ("link", "pp a->b") transfer ms per call, ("collective", "tp [0, 1] all_reduce") the
    slowest member's transfer ms, ("step", "step") the slowest rank's step time. Every value
    comes from the gathered summaries, the same on every rank, so every rank's detector reaches
    the same verdict (a rank's own step time differs from its peers' by what it waited)."""
    out: dict[tuple[str, str], float | None] = {("step", "step"): slowest_step_ms(summaries)}
    colls: dict[str, float] = {}
    for (dim, op, group), (_, ms) in collective_times(summaries).items():
        out[("collective", f"{dim} {list(group)} {op}")] = ms
    for s in summaries:
        out[("compute", f"rank {s['rank']}")] = s["busy_ms"] or None
        for (dim, src, dst), v in s["links"].items():
            out[("link", f"{dim} {src}->{dst}")] = v["transfer_ms"]
        for (dim, op, group), v in s["collectives"].items():
            key = f"{dim} {list(group)} {op}"
            colls[key] = max(colls.get(key, 0.0), v["transfer_ms"])
    for key, v in colls.items():
        out[("collective", key)] = v
    return out


def step_calls(summaries: list[dict]) -> dict[tuple[str, str], int]:
    """Calls per step of each link and timed collective series of `step_signals` (the keys
    match): a link's receives in the step, a collective's calls timed on every member."""
    out: dict[tuple[str, str], int] = {}
    members: dict[str, list[int]] = {}
    for s in summaries:
        for (dim, src, dst), v in s["links"].items():
            out[("link", f"{dim} {src}->{dst}")] = int(v["calls"])
        for (dim, op, group), calls in (s.get("timed") or {}).items():
            members.setdefault(f"{dim} {list(group)} {op}", []).append(len(calls))
    for key, counts in members.items():
        out[("collective", key)] = max(min(counts), 1)
    return out


def link_rates(window: list[list[dict]], min_bytes: int = 0
               ) -> dict[tuple[int, int], tuple[float | None, float | None]]:
    """(src, dst) -> (latency ms, GB/s) of pipeline links over a window of steps' summaries:
    the median per-call bytes / median transfer time. Messages smaller than `min_bytes` per call
    measure latency and the host's scheduling, not bandwidth (16 kB between two processes of a
    busy host took 2-20 ms, "0.001-0.03 GB/s", over a link that moves gigabytes a second): they
    give no rate, and whatever needs the link's rate takes its class's."""
    times: dict = {}
    for summaries in window:
        for s in summaries:
            for (dim, src, dst), v in s["links"].items():
                if dim == "pp" and v["transfer_ms"] > 0:
                    times.setdefault((src, dst), []).append((v["transfer_ms"], v["bytes"]))
    out = {}
    for key, vals in times.items():
        ms = statistics.median(t for t, _ in vals)
        nbytes = statistics.median(b for _, b in vals)
        out[key] = (None, nbytes / (ms * 1e6) if nbytes and nbytes >= min_bytes else None)
    return out


def collective_times(summaries: list[dict]) -> dict[tuple, tuple[float, float]]:
    """(dim, op, group) -> (bytes per call, transfer ms) of the step's timed collectives: per
    call, each member's completion minus the last member's post; the median over members and
    calls."""
    by_key: dict[tuple, dict[int, list]] = {}
    for s in summaries:
        for key, calls in (s.get("timed") or {}).items():
            by_key.setdefault(key, {})[s["rank"]] = calls
    out = {}
    for key, members in by_key.items():
        if len(members) < len(key[2]):
            continue                       # a member's record is missing: no verdict
        n_calls = min(len(c) for c in members.values())
        times, sizes = [], []
        for i in range(n_calls):
            last_post = max(c[i][1] for c in members.values())
            times += [max(c[i][2] - last_post, 0.0) for c in members.values()]
            sizes.append(next(iter(members.values()))[i][0])
        if times:
            out[key] = (statistics.median(sizes), statistics.median(times) * 1e3)
    return out


# the dimensions whose gradient all-reduces the GradReducer has in flight at once
GRADIENT_DIMS = ("dp_cp", "edp")


def collective_rates(window: list[list[dict]], ranks_per_node: int,
                     min_bytes: float) -> dict[str, float]:
    """Link class -> median bus bandwidth (GB/s) of the timed all-reduces of at least
    `min_bytes` per call over a window (small ones, a loss or a norm, measure latency). Across
    nodes, the rate of a whole node link: each group's rate times the groups timed crossing the
    same node link at once (commpipe.plan.cluster.groups_on_a_node_link, each at its share):
    those of its dimension, and for a gradient reduction those of every gradient dimension
    (GRADIENT_DIMS: a MoE model's dense buckets over dp x cp and its experts' over edp are in
    flight together, commpipe.parallel.data.GradReducer). So a rate measured by one plan prices
    another's groups (commpipe.adapt.model_links.MeasuredLinks.link_share), whose reductions
    the cost model adds up, each at its dimension's share of the link."""
    from commpipe.plan.cluster import groups_on_a_node_link

    rates: dict[str, list[float]] = {}
    node = lambda r: r // ranks_per_node   # noqa: E731
    for summaries in window:
        timed = collective_times(summaries)
        for (dim, op, group), (nbytes, ms) in timed.items():
            if op != "all_reduce" or nbytes < min_bytes or ms <= 0:
                continue
            n = len(group)
            cls = "intra_node" if len({node(g) for g in group}) == 1 else "inter_node"
            together = GRADIENT_DIMS if dim in GRADIENT_DIMS else (dim,)
            share = groups_on_a_node_link([list(g) for d, o, g in timed
                                           if d in together and o == op], node, group)
            rates.setdefault(cls, []).append(
                share * algbw_bytes(op, nbytes, n) * busbw_factor(op, n) / (ms * 1e6))
    return {cls: statistics.median(v) for cls, v in rates.items()}
