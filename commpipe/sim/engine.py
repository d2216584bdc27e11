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

Units and braids (STP, DualPipeV; see commpipe/schedules/actions.py) run on a third stream per
rank, the TP stream. A pass is four units (pre_attn, attn, pre_mlp, mlp; backward in reverse),
each a quarter of the stage's compute. A forward's TP collectives follow its attn and mlp units,
an input gradient's (B or I) follow its pre_mlp and pre_attn units, each half of the stage's
`tp_comm`; W has none. A unit waits for the collective of the unit before it in its own pass,
the TP stream runs one collective at a time, and a braid alternates its two passes' units
(forward first), so one pass's collective is in flight while the other pass computes. A pass's
output is ready when its last collective ends: a send of it starts no earlier, a local consumer
(the next stage on the same rank) waits for it, the rank's compute stream does not. Plain
(whole-stage, unbraided) actions keep `tp_mode`: "exposed" adds the collective after the
compute, "overlapped" takes max(compute, collective). `tp_bubble` is the time the compute
stream waits for TP collectives, per rank.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field

from commpipe.schedules.actions import UNITS, Program, lower
from commpipe.schedules.validate import ScheduleDeadlock, check_program, deadlock_message
from commpipe.sim.costs import CostTable
from commpipe.timeline import Event

_CODE = {"F": 0, "B": 1, "I": 2, "W": 3, "SEND_F": 4, "RECV_F": 5, "SEND_B": 6, "RECV_B": 7}


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
    _compute: list = field(repr=False, default_factory=list)
    _comm: list = field(repr=False, default_factory=list)
    _tp: list = field(repr=False, default_factory=list)
    _events: list | None = field(repr=False, default=None)
    _units: list = field(repr=False, default_factory=list)   # (rank, k, part, unit, start, end)

    @property
    def events(self) -> list[Event]:
        """Timeline in the shared schema (commpipe.timeline.Event), built on first access."""
        if self._events is None:
            with _gc_paused():
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
        ev.sort(key=lambda x: (x.rank, x.start_ms, x.stream))
        return ev

    def to_dict(self) -> dict:
        p = self.program
        return {"schedule": p.name, "pp": p.pp, "microbatches": p.microbatches,
                "num_stages": p.num_stages, "vpp": p.vpp, "makespan": self.makespan,
                "bubble_fraction": self.bubble_fraction, "busy": self.busy, "idle": self.idle,
                "peak_activations": self.peak_activations,
                "peak_activation_bytes": self.peak_activation_bytes,
                "tp_bubble": sum(self.tp_bubble) / p.pp if self.tp_bubble else 0.0,
                "tp_bubble_per_rank": self.tp_bubble}


@contextmanager
def _gc_paused():
    """The walk allocates ~1e6 small tuples that all stay alive; the cyclic collector would
    rescan them again and again (none can form a cycle), so pause it for the duration."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(program: Program, costs: CostTable | None = None, check: bool = True) -> SimResult:
    """Time `program` (lowered here if compute-only) under `costs` (default: f=1, b=2 per
    rank's share). `check=False` skips the static validation (the walk still detects
    deadlock)."""
    with _gc_paused():
        return _simulate(program, costs, check)


def _simulate(program: Program, costs: CostTable | None, check: bool) -> SimResult:
    lowered = program if program.is_lowered else lower(program)
    if costs is None:
        costs = CostTable.for_program(lowered)
    costs.check_fits(lowered)
    if check:
        check_program(lowered)
    p, m, n = lowered.pp, lowered.microbatches, lowered.num_stages
    rank_of = lowered.stage_to_rank

    # per-op durations per stage: 0 F, 1 B, 2 I, 3 W (TP/CP collectives ride on F, B and I)
    tp = costs.tp_comm or [0.0] * n
    if costs.tp_mode == "exposed":
        def with_tp(xs):
            return [x + c for x, c in zip(xs, tp)]
    else:
        def with_tp(xs):
            return [max(x, c) for x, c in zip(xs, tp)]
    dur = (with_tp(costs.f), with_tp(costs.b), with_tp(costs.i), list(costs.w))
    dur_raw = (costs.f, costs.b, costs.i, costs.w)
    has_tp = any(tp)
    mem_w = costs.activation_memory_bytes
    link_param, link_free = {}, {}
    for s in range(n - 1):
        a, b = rank_of[s], rank_of[s + 1]
        if a != b:
            for src, dst in ((a, b), (b, a)):
                link_param[(src, dst)] = costs.link(src, dst)
                link_free[(src, dst)] = 0.0
    act_bytes = costs.activation_bytes

    # units and braids: code 8, with their passes' unit plans (see _plan) in `plans`
    plans: dict[tuple[int, int], list] = {}
    codes = []
    for r, acts in enumerate(lowered.actions):
        row = []
        for k, a in enumerate(acts):
            if a.is_braid or a.unit is not None:
                plans[(r, k)] = [_plan(x, dur_raw, tp) for x in a.parts]
                row.append((8, a.stage, a.microbatch))
            else:
                row.append((_CODE[a.op], a.stage, a.microbatch))
        codes.append(row)
    unitwise = bool(plans)
    nm = n * m
    out_ready = [0.0] * (2 * nm)          # when a pass's output is complete: F (s, mb), then B/I
    tp_free, exposed = [0.0] * p, [0.0] * p
    rec_u, pass_done = [], {}
    arrive: list[float | None] = [None] * (2 * nm)     # message key -> arrival time
    sent_at = [0.0] * (2 * nm)                          # message key -> send start
    waiting: dict[int, int] = {}                        # message key -> parked rank
    pcs, cur, busy = [0] * p, [0.0] * p, [0.0] * p
    count, peak = [0] * p, [0] * p
    mem_b, peak_b = [0.0] * p, [0.0] * p
    rec_c, rec_p, rec_tp = [], [], []

    ready = list(range(p))
    while ready:
        r = ready.pop()
        acts, k, t = codes[r], pcs[r], cur[r]
        nacts, bsy, cnt, pk, mb_, pkb = len(acts), busy[r], count[r], peak[r], mem_b[r], peak_b[r]
        while k < nacts:
            op, s, mb = acts[k]
            if op == 8:                                             # units / braid
                t, bsy, cnt, pk = _run_units(plans[(r, k)], r, k, t, bsy, cnt, pk, m, nm, out_ready,
                                             tp_free, exposed, rec_c, rec_tp, rec_u, pass_done)
            elif op < 4:                                            # compute
                if unitwise:                # a local input from a unit pass may still be in flight
                    need = (out_ready[(s - 1) * m + mb] if op == 0 and s > 0 else 0.0)
                    if op in (1, 2):        # its forward's output (the loss) and the gradient
                        need = max(out_ready[s * m + mb],
                                   out_ready[nm + (s + 1) * m + mb] if s + 1 < n else 0.0)
                    if need > t:
                        exposed[r] += need - t
                        bsy += need - t
                        t = need
                d = dur[op][s]
                rec_c.append((r, k, t, t + d))
                if has_tp and op < 3 and tp[s] > 0:
                    rec_tp.append((r, k, t + d - tp[s], t + d) if costs.tp_mode == "exposed"
                                  else (r, k, t, t + tp[s]))
                    exposed[r] += d - dur_raw[op][s]
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
                if op == 4:
                    dst_stage, key, nbytes = s + 1, (s + 1) * m + mb, act_bytes[s]
                else:
                    dst_stage, key, nbytes = s - 1, nm + (s - 1) * m + mb, act_bytes[s - 1]
                link = (r, rank_of[dst_stage])
                lat, ms_per_byte = link_param[link]
                start = t if t > link_free[link] else link_free[link]
                if unitwise:                # the tensor is complete when its last collective is
                    out = out_ready[s * m + mb] if op == 4 else out_ready[nm + s * m + mb]
                    start = out if out > start else start
                xfer = nbytes * ms_per_byte
                link_free[link] = start + xfer
                arrive[key] = start + lat + xfer
                sent_at[key] = start
                rec_p.append((r, k, start, start + lat + xfer, link[1], nbytes, None))
                w = waiting.pop(key, None)
                if w is not None:
                    ready.append(w)
            else:                                                   # RECV_F / RECV_B
                if op == 5:
                    key, src, nbytes = s * m + mb, rank_of[s - 1], act_bytes[s - 1]
                else:
                    key, src, nbytes = nm + s * m + mb, rank_of[s + 1], act_bytes[s]
                arr = arrive[key]
                if arr is None:
                    waiting[key] = r
                    break
                done = arr if arr > t else t
                wait = sent_at[key] - t
                rec_p.append((r, k, t, done, src, nbytes, wait if wait > 0 else 0.0))
                t = done
            k += 1
        if k == nacts and tp_free[r] > t:     # the step ends when the last collective has
            exposed[r] += tp_free[r] - t
            bsy += tp_free[r] - t
            t = tp_free[r]
        pcs[r], cur[r], busy[r], count[r], peak[r], mem_b[r], peak_b[r] = k, t, bsy, cnt, pk, mb_, pkb
    if any(pcs[r] < len(codes[r]) for r in range(p)):
        raise ScheduleDeadlock(deadlock_message(lowered, pcs))

    makespan = max(cur)
    unit = p / n                       # one chunk's activations in micro-batch units
    return SimResult(
        program=lowered, makespan=makespan, busy=busy, idle=[makespan - b for b in busy],
        bubble_fraction=(sum(1 - b / makespan for b in busy) / p) if makespan > 0 else 0.0,
        peak_activations=[x * unit for x in peak],
        peak_activation_bytes=peak_b if mem_w is not None else None, tp_bubble=exposed,
        _compute=rec_c, _comm=rec_p, _tp=rec_tp, _units=rec_u)


# unit order and which units carry a TP collective, per pass kind
_FWD_UNITS, _BWD_UNITS = UNITS, UNITS[::-1]
_TP_UNITS = {"F": ("attn", "mlp"), "B": ("pre_mlp", "pre_attn"), "I": ("pre_mlp", "pre_attn"), "W": ()}


def _plan(part, dur_raw, tp) -> tuple:
    """One plain pass (whole or one unit) as (code, key, frees, [(unit, compute, tp), ...]).

    key: index of its output in the engine's `out_ready` list (F outputs first, then B/I), or None
    for W; frees: +1 forward (stores), -1 B or W (frees), 0 I, spread evenly over its units."""
    op, s = part.op, part.stage
    code = _CODE[op]
    order = _FWD_UNITS if op == "F" else _BWD_UNITS
    units = (part.unit,) if part.unit else order
    c = dur_raw[code][s] / 4
    t = tp[s] / 2
    seq = [(u, c, t if u in _TP_UNITS[op] else 0.0) for u in units]
    first, last = units[0] == order[0], units[-1] == order[-1]
    mem = {"F": 1.0, "B": -1.0, "I": 0.0, "W": -1.0}[op] * len(seq) / 4
    return (code, part.stage, part.microbatch, first, last, mem, seq)


def _run_units(plans, r, k, t, bsy, cnt, pk, m, nm, ready, tp_free, exposed, rec_c, rec_tp, rec_u,
               pass_done):
    """Time one unit action or braid on rank r from host time t; returns (t, busy, count, peak).

    The compute stream takes the passes' units alternately; each unit waits for its local input
    (first unit) or the collective of the unit before it in its pass (`pass_done` keeps that
    across actions for passes written unit by unit); collectives queue on the rank's TP stream.
    The compute stream is free at the end of the last unit; the passes' outputs are ready (in
    `ready`) when their last collectives end."""
    start = t
    for plan in plans:                            # stored activations count from the start
        if plan[5] > 0:
            cnt += plan[5]
            if cnt > pk:
                pk = cnt
    waits = []
    for code, s, mb, first, _, _, _ in plans:     # a pass's first unit needs its input
        if not first:
            waits.append(pass_done.pop((code, s, mb), 0.0))
        elif code == 0:
            waits.append(ready[(s - 1) * m + mb] if s > 0 else 0.0)
        elif code in (1, 2):                      # its forward's output and the gradient
            waits.append(max(ready[s * m + mb],
                             ready[nm + (s + 1) * m + mb] if (s + 1) * m < nm else 0.0))
        else:
            waits.append(0.0)
    idx = [0] * len(plans)
    while any(idx[j] < len(plans[j][6]) for j in range(len(plans))):
        for j, plan in enumerate(plans):
            if idx[j] >= len(plan[6]):
                continue
            unit, c, comm = plan[6][idx[j]]
            if waits[j] > t:                      # waiting for a collective (or a local input)
                exposed[r] += waits[j] - t
                bsy += waits[j] - t
                t = waits[j]
            rec_u.append((r, k, j, unit, t, t + c))
            t += c
            bsy += c
            if comm > 0:
                c0 = t if t > tp_free[r] else tp_free[r]
                tp_free[r] = c0 + comm
                rec_tp.append((r, k, c0, c0 + comm))
                waits[j] = c0 + comm
            else:
                waits[j] = t
            idx[j] += 1
    rec_c.append((r, k, start, t))
    for (code, s, mb, _, last, mem, _), done in zip(plans, waits):
        if mem < 0:
            cnt += mem
        if not last:
            pass_done[(code, s, mb)] = done
        elif code == 0:
            ready[s * m + mb] = done
        elif code in (1, 2):
            ready[nm + s * m + mb] = done
    return t, bsy, cnt, pk

