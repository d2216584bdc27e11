"""`simulate(program, costs)`: execute a lowered Program on a cost table.

The simulator runs the very Program the runtime runs. Each rank walks its action list in order,
like the runtime's host loop, with two streams:
  compute  F, B, I, W back to back (plus exposed TP/CP collective time);
  pp       sends start when the host reaches them (right after their producer, with the
           lowering's placement) and do not block it; each directed link carries one message at
           a time. A receive blocks the host and completes at
           max(post time, send start + latency + bytes / bandwidth).
Because every action's time depends only on earlier actions of its rank and on the matching
send, one pass in dependency order gives exact times: no clock ticks, no priority queue, linear
in the number of actions. A rank blocked on a receive is parked until that send is simulated;
if all ranks park, the schedule deadlocks and `ScheduleDeadlock` says where.

Activation memory is counted in the same walk (see SimResult.peak_activations).

Units and braids (STP, DualPipeV) run unit by unit, their TP collectives on a third stream per
rank and a MoE stage's expert-parallel all-to-alls on a fourth (commpipe/sim/units.py). Plain
(whole-stage, unbraided) actions keep `tp_mode`: "exposed" adds the collective after the
compute, "overlapped" takes max(compute, collective); their all-to-alls block (added after the
compute and the TP collectives), as the whole-stage runtime issues them.
`tp_bubble` is the time the compute stream waits for TP collectives, per rank; `ep_exposed` the
same for the all-to-alls (present when the cost table has `ep_comm`).
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

from commpipe.schedules.actions import Program, lower
from commpipe.schedules.validate import ScheduleDeadlock, check_program, deadlock_message
from commpipe.sim.costs import CostTable
from commpipe.sim.units import _CODE, Streams, _parts, _run_units, _unit_shape, _unit_steps
from commpipe.timeline import Event


@dataclass
class SimResult:
    """Predicted timing of one pipeline step (times in ms, like the cost table).

    peak_activations: per rank, the most micro-batch activations held at once, in units of one
      micro-batch through one rank's share of the model (a chunk of an interleaved or V
      schedule counts pp/num_stages). A stage holds a micro-batch's activations from its F until
      its B, or until its W when the backward is split: the "in-flight micro-batch" count of
      Qi et al. (ICLR 2024, Section 2.1), under which ZB-H1 and ZB-V keep 1F1B's peak of p.
    peak_activation_bytes: the same walk weighted by costs.activation_memory_bytes (None when
      the cost table does not give it).
    """

    program: Program
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_fraction: float
    peak_activations: list[float]
    peak_activation_bytes: list[float] | None
    tp_bubble: list[float] = field(default_factory=list)
    ep_exposed: list[float] = field(default_factory=list)
    _compute: list = field(repr=False, default_factory=list)
    _comm: list = field(repr=False, default_factory=list)
    _tp: list = field(repr=False, default_factory=list)
    _ep: list = field(repr=False, default_factory=list)
    _events: list | None = field(repr=False, default=None)
    _units: list = field(repr=False, default_factory=list)   # (rank, k, part, unit, start, end)

    @property
    def events(self) -> list[Event]:
        """Timeline in the shared schema (commpipe.timeline.Event), built on first access."""
        if self._events is None:
            with gc_paused():
                self._events = self._build_events()
        return self._events

    def _build_events(self) -> list[Event]:
        acts = self.program.actions
        ev = [Event(r, "compute", str(acts[r][k]), s, e) for r, k, s, e in self._compute]
        # a receive's time splits into waiting for the send to start and the transfer
        ev += [Event(r, "pp", str(acts[r][k]), s, e, args={"peer": peer, "bytes": nbytes} | (
                   {} if wait is None else {"wait_ms": wait, "transfer_ms": e - s - wait}))
               for r, k, s, e, peer, nbytes, wait in self._comm]
        ev += [Event(r, "tp", f"{acts[r][k]}.tp", s, e) for r, k, s, e in self._tp]
        ev += [Event(r, "ep", f"{acts[r][k]}.ep", s, e) for r, k, s, e in self._ep]
        ev.sort(key=lambda x: (x.rank, x.start_ms, x.stream))
        return ev

    def to_dict(self) -> dict:
        p = self.program
        ep = {"ep_exposed": sum(self.ep_exposed) / p.pp,
              "ep_exposed_per_rank": self.ep_exposed} if self.ep_exposed else {}
        return {"schedule": p.name, "pp": p.pp, "microbatches": p.microbatches,
                "num_stages": p.num_stages, "vpp": p.vpp, "makespan": self.makespan,
                "bubble_fraction": self.bubble_fraction, "busy": self.busy, "idle": self.idle,
                "peak_activations": self.peak_activations,
                "peak_activation_bytes": self.peak_activation_bytes,
                "tp_bubble": sum(self.tp_bubble) / p.pp if self.tp_bubble else 0.0,
                "tp_bubble_per_rank": self.tp_bubble} | ep


@contextmanager
def gc_paused():
    """The walk allocates ~1e6 small tuples that all stay alive; the cyclic collector would
    rescan them again and again (none can form a cycle), so pause it for the duration. The
    planner's search pauses it too: the programs it generates and caches are ~1e6 actions."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(program: Program, costs: CostTable | None = None, check: bool = True,
             record: bool = True) -> SimResult:
    """Time `program` (lowered here if compute-only) under `costs` (default: f=1, b=2 per
    rank's share). `check=False` skips the static validation (the walk still detects
    deadlock). `record=False` keeps only the totals (makespan, busy, idle, bubble, peaks, TP
    bubble): no timeline, `events` is empty; the planner's many simulations need no more."""
    with gc_paused():
        return _simulate(program, costs, check, record)


def _compiled(lowered: Program) -> tuple:
    """The cost-free part of a walk, once per program object (programs are immutable):
    (codes, unitwise, links). codes: per rank, (code, stage, micro-batch, x) with code as in
    _CODE, 8 for a unit action or braid, and x what the walk reads besides costs:
      compute: (duration index op * n + stage, the `out_ready` indices of its local inputs
        (2 * n * m, a slot that stays 0.0, when it has none));
      unit action or braid: its unit steps (see _unit_steps);
      send: (message key, link index into `links`, boundary, `out_ready` index, destination rank);
      receive: (message key, source rank, boundary).
    unitwise: whether any action runs unit by unit; links: the (src, dst) rank pairs sends use."""
    hit = _COMPILED.get(id(lowered))
    if hit is not None and hit[0]() is lowered:
        return hit[1]
    m, n = lowered.microbatches, lowered.num_stages
    nm, rank_of = n * m, lowered.stage_to_rank
    zero = 2 * nm
    links: dict[tuple[int, int], int] = {}
    for s in range(n - 1):                  # both directions of each boundary between ranks
        a, b = rank_of[s], rank_of[s + 1]
        if a != b:
            links.setdefault((a, b), len(links))
            links.setdefault((b, a), len(links))
    codes, unitwise = [], False
    for r, acts in enumerate(lowered.actions):
        row = []
        for a in acts:
            s, mb = a.stage, a.microbatch
            if a.pair is not None or a.unit is not None:
                row.append((8, s, mb, _unit_steps(_parts(a), n)))
                unitwise = True
                continue
            op = _CODE[a.op]
            if op < 4:
                if op == 0:
                    need = ((s - 1) * m + mb if s > 0 else zero, zero)
                elif op < 3:            # its forward's output (the loss) and the gradient
                    need = (s * m + mb, nm + (s + 1) * m + mb if s + 1 < n else zero)
                else:
                    need = (zero, zero)
                x = (op * n + s, *need)
            elif op == 4 or op == 6:
                if op == 4:
                    dst, key, bnd, out = rank_of[s + 1], (s + 1) * m + mb, s, s * m + mb
                else:
                    dst, key, bnd, out = rank_of[s - 1], nm + (s - 1) * m + mb, s - 1, nm + s * m + mb
                x = (key, links[(r, dst)], bnd, out, dst)
            elif op == 5:
                x = (s * m + mb, rank_of[s - 1], s - 1)
            else:
                x = (nm + s * m + mb, rank_of[s + 1], s)
            row.append((op, s, mb, x))
        codes.append(row)
    out = (codes, unitwise, list(links))
    _COMPILED[id(lowered)] = (weakref.ref(lowered), out)
    weakref.finalize(lowered, _COMPILED.pop, id(lowered), None)
    return out


_COMPILED: dict[int, tuple] = {}      # id(program) -> (weak reference to it, its compiled walk)


def _simulate(program: Program, costs: CostTable | None, check: bool, record: bool = True) -> SimResult:
    lowered = program if program.is_lowered else lower(program)
    if costs is None:
        costs = CostTable.for_program(lowered)
    costs.check_fits(lowered)
    if check:
        check_program(lowered)
    p, m, n = lowered.pp, lowered.microbatches, lowered.num_stages

    # per-op durations per stage: 0 F, 1 B, 2 I, 3 W (TP/CP collectives and EP all-to-alls ride
    # on F, B and I)
    tp = costs.tp_comm or [0.0] * n
    ep = costs.ep_comm or [0.0] * n
    if costs.tp_mode == "exposed":
        def with_comm(xs):
            return [x + c + e for x, c, e in zip(xs, tp, ep)]
    else:
        def with_comm(xs):
            return [max(x, c) + e for x, c, e in zip(xs, tp, ep)]
    dur = (with_comm(costs.f), with_comm(costs.b), with_comm(costs.i), list(costs.w))
    dur_raw = (costs.f, costs.b, costs.i, costs.w)
    has_tp, has_ep = any(tp), any(ep)
    mem_w = costs.activation_memory_bytes
    # units and braids: code 8, with their passes' unit steps (see _unit_steps); a unit runs a
    # quarter of its pass (cq, by code * n + stage) and half its TP collective if it has one
    # (th; index -1, a zero, for the units without), and half its all-to-alls (eh, the same)
    codes, unitwise, links = _compiled(lowered)
    cq = [x / 4 for d in dur_raw for x in d]
    th = [x / 2 for x in tp] * 4 + [0.0]
    eh = [x / 2 for x in ep] * 4 + [0.0]
    durs = [x for d in dur for x in d]
    link_lat, link_mspb = [], []
    for src, dst in links:
        lat, ms_per_byte = costs.link(src, dst)
        link_lat.append(lat)
        link_mspb.append(ms_per_byte)
    link_free = [0.0] * len(links)
    act_bytes = costs.activation_bytes
    nm = n * m
    out_ready = [0.0] * (2 * nm + 1)      # when a pass's output is complete: F (s, mb), then B/I
    streams = Streams(p)
    tp_wait, ep_wait, ep_ready = streams.tp_wait, streams.ep_wait, streams.ep_ready
    rec_u, pass_done = [], {}
    arrive: list[float | None] = [None] * (2 * nm)     # message key -> arrival time
    sent_at = [0.0] * (2 * nm)                          # message key -> send start
    waiting: dict[int, int] = {}                        # message key -> parked rank
    pcs, cur, busy = [0] * p, [0.0] * p, [0.0] * p
    count, peak = [0] * p, [0] * p
    mem_b, peak_b = [0.0] * p, [0.0] * p
    rec_c, rec_p, rec_tp, rec_ep = ([], [], [], []) if record else (None, None, None, None)
    if not record:
        rec_u = None

    ready = list(range(p))
    while ready:
        r = ready.pop()
        acts, k, t = codes[r], pcs[r], cur[r]
        nacts, bsy, cnt, pk, mb_, pkb = len(acts), busy[r], count[r], peak[r], mem_b[r], peak_b[r]
        while k < nacts:
            op, s, mb, x = acts[k]
            if op == 8:                                             # units / braid
                t, bsy, cnt, pk = _run_units(x, r, k, t, bsy, cnt, pk, m, nm, out_ready, streams,
                                             cq, th, eh, rec_c, rec_tp, rec_ep, rec_u, pass_done)
            elif op < 4:                                            # compute
                if unitwise:                # a local input from a unit pass may still be in flight
                    need, on = out_ready[x[1]], x[1]
                    if out_ready[x[2]] > need:
                        need, on = out_ready[x[2]], x[2]
                    if need > t:
                        if on in ep_ready:
                            ep_wait[r] += need - t
                        else:
                            tp_wait[r] += need - t
                        bsy += need - t
                        t = need
                d = durs[x[0]]
                if record:
                    rec_c.append((r, k, t, t + d))
                if has_tp and op < 3 and tp[s] > 0:
                    end = t + d - ep[s]
                    if record:
                        rec_tp.append((r, k, end - tp[s], end) if costs.tp_mode == "exposed"
                                      else (r, k, t, t + tp[s]))
                    tp_wait[r] += d - ep[s] - dur_raw[op][s]
                if has_ep and op < 3 and ep[s] > 0:
                    if record:
                        rec_ep.append((r, k, t + d - ep[s], t + d))
                    ep_wait[r] += ep[s]
                t += d
                bsy += d
                if op == 0:
                    cnt += 1
                    if cnt > pk:
                        pk = cnt
                    if mem_w is not None:
                        mb_ += mem_w[s]
                        if mb_ > pkb:
                            pkb = mb_
                elif op != 2:                                       # B or W frees
                    cnt -= 1
                    if mem_w is not None:
                        mb_ -= mem_w[s]
            elif op == 4 or op == 6:                                # SEND_F / SEND_B
                key, li, bnd, out, dst = x
                nbytes = act_bytes[bnd]
                lat, free = link_lat[li], link_free[li]
                start = t if t > free else free
                if unitwise:                # the tensor is complete when its last collective is
                    out = out_ready[out]
                    start = out if out > start else start
                xfer = nbytes * link_mspb[li]
                link_free[li] = start + xfer
                arrive[key] = start + lat + xfer
                sent_at[key] = start
                if record:
                    rec_p.append((r, k, start, start + lat + xfer, dst, nbytes, None))
                w = waiting.pop(key, None)
                if w is not None:
                    ready.append(w)
            else:                                                   # RECV_F / RECV_B
                key, src, bnd = x
                arr = arrive[key]
                if arr is None:
                    waiting[key] = r
                    break
                done = arr if arr > t else t
                if record:
                    wait = sent_at[key] - t
                    rec_p.append((r, k, t, done, src, act_bytes[bnd], wait if wait > 0 else 0.0))
                t = done
            k += 1
        if k == nacts:                        # the step ends when the last exchange has
            last = streams.tp_free[r]
            if last > t:
                tp_wait[r] += last - t
                bsy += last - t
                t = last
            last = streams.ep_free[r]
            if last > t:
                ep_wait[r] += last - t
                bsy += last - t
                t = last
        pcs[r], cur[r], busy[r], count[r], peak[r], mem_b[r], peak_b[r] = k, t, bsy, cnt, pk, mb_, pkb
    if any(pcs[r] < len(codes[r]) for r in range(p)):
        raise ScheduleDeadlock(deadlock_message(lowered, pcs))

    makespan = max(cur)
    unit = p / n                       # one chunk's activations in micro-batch units
    return SimResult(
        program=lowered, makespan=makespan, busy=busy, idle=[makespan - b for b in busy],
        bubble_fraction=(sum(1 - b / makespan for b in busy) / p) if makespan > 0 else 0.0,
        peak_activations=[x * unit for x in peak],
        peak_activation_bytes=peak_b if mem_w is not None else None, tp_bubble=tp_wait,
        ep_exposed=ep_wait if costs.ep_comm is not None else [],
        _compute=rec_c or [], _comm=rec_p or [], _tp=rec_tp or [], _ep=rec_ep or [],
        _units=rec_u or [],
        _events=None if record else [])


def peak_activations(program: Program) -> list[float]:
    """`simulate(program, ...).peak_activations` without the timing walk: the counts follow
    each rank's compute actions in order and nothing else, so `program` may be compute-only
    (not lowered) and no costs are needed. The same counting as `simulate`, step for step."""
    n = program.num_stages
    out = []
    for acts in program.actions:
        cnt = pk = 0
        for a in acts:
            op = a.op
            if a.pair is not None or a.unit is not None:     # as _run_units counts
                mems = [x[3] for x in _unit_shape(tuple((o, st, u) for o, st, _, u in _parts(a)), n)[0]]
                for mem in mems:                    # stored activations count from the start
                    if mem > 0:
                        cnt += mem
                        if cnt > pk:
                            pk = cnt
                for mem in mems:
                    if mem < 0:
                        cnt += mem
            elif op == "F":
                cnt += 1
                if cnt > pk:
                    pk = cnt
            elif op == "B" or op == "W":
                cnt -= 1
        out.append(pk)
    unit = program.pp / n
    return [x * unit for x in out]
