"""Units and braids in the simulator: how one unit action or braid runs on its rank.

Units and braids (STP, DualPipeV; see commpipe/schedules/actions.py) run on a third stream per
rank, the TP stream. A pass is four units (pre_attn, attn, pre_mlp, mlp; backward in reverse),
each a quarter of the stage's compute. A forward's TP collectives follow its attn and mlp units,
an input gradient's (B or I) follow its pre_mlp and pre_attn units, each half of the stage's
`tp_comm`; W has none. A unit waits for the collective of the unit before it in its own pass,
the TP stream runs one collective at a time, and a braid alternates its two passes' units
(forward first), so one pass's collective is in flight while the other pass computes. A pass's
output is ready when its last collective ends: a send of it starts no earlier, a local consumer
(the next stage on the same rank) waits for it, the rank's compute stream does not.

A MoE stage's expert-parallel all-to-alls (`ep_comm` per pass) run the same way on a fourth
stream per rank, the EP stream, as commpipe/runtime/units_moe.py issues them: a forward's
dispatch follows its pre_mlp unit (router and permutation) and its combine its mlp unit (the
experts); a backward's adjoints run in reverse, the combine's after its mlp unit and the
dispatch's after its pre_mlp unit; each is half of the stage's `ep_comm`. The compute stream's
waits are split by what they wait for: TP (`exposed`, the result's `tp_bubble`) or EP
(`ep_exposed`).

`_unit_steps` turns an action into its passes and unit steps, free of costs (once per program,
in engine._compiled); `_run_units` times them during `commpipe.sim.engine.simulate`'s walk, and
`commpipe.plan.pipeline.braid_span` runs it on one braid alone.
"""

from __future__ import annotations

from functools import lru_cache

from commpipe.schedules.actions import UNITS

# action op -> the walk's integer code (engine._compiled); 8 is a unit action or braid
_CODE = {"F": 0, "B": 1, "I": 2, "W": 3, "SEND_F": 4, "RECV_F": 5, "SEND_B": 6, "RECV_B": 7}

# unit order and which units carry a TP collective, per pass kind
_FWD_UNITS, _BWD_UNITS = UNITS, UNITS[::-1]
_TP_UNITS = {"F": ("attn", "mlp"), "B": ("pre_mlp", "pre_attn"), "I": ("pre_mlp", "pre_attn"), "W": ()}
_EP_UNITS = {"F": ("pre_mlp", "mlp"), "B": ("mlp", "pre_mlp"), "I": ("mlp", "pre_mlp"), "W": ()}
_MEM = {"F": 1.0, "B": -1.0, "I": 0.0, "W": -1.0}


def _parts(a) -> tuple:
    """(op, stage, micro-batch, unit) of each plain pass of action `a` (its `parts`)."""
    if a.pair is None:
        return ((a.op, a.stage, a.microbatch, a.unit),)
    b = a.pair
    return (("F", a.stage, a.microbatch, a.unit), (b.op, b.stage, b.microbatch, b.unit))


def _unit_steps(parts, n: int) -> tuple:
    """A unit action or braid (its passes as (op, stage, micro-batch, unit)) as (passes, steps),
    free of costs.

    passes: per plain pass (whole or one unit), (code, stage, micro-batch, first, last, mem):
      first/last whether it holds its pass's first/last unit, mem the stored activations it
      adds (+1 forward, -1 B or W, 0 I, spread evenly over its units);
    steps: its units in execution order, the passes' units alternately (forward first), each
      (pass index, cost index, TP index, EP index, unit): a unit computes cq[cost index] and
      then, with a TP collective, runs th[TP index] on the TP stream, and with an
      expert-parallel exchange eh[EP index] on the EP stream (index -1: none)."""
    shape, steps = _unit_shape(tuple((op, s, u) for op, s, _, u in parts), n)
    return tuple((code, s, mb, first, last, mem)
                 for (code, first, last, mem), (_, s, mb, _) in zip(shape, parts)), steps


@lru_cache(maxsize=65536)
def _unit_shape(parts: tuple, n: int) -> tuple:
    """_unit_steps for passes given as (op, stage, unit): (code, first, last, mem) per pass,
    and the steps."""
    passes, seqs = [], []
    for op, s, unit in parts:
        code = _CODE[op]
        order = _FWD_UNITS if op == "F" else _BWD_UNITS
        units = (unit,) if unit else order
        passes.append((code, units[0] == order[0], units[-1] == order[-1], _MEM[op] * len(units) / 4))
        seqs.append([(code * n + s, code * n + s if u in _TP_UNITS[op] else -1,
                      code * n + s if u in _EP_UNITS[op] else -1, u) for u in units])
    steps = []
    for x in range(max(len(q) for q in seqs)):
        steps += [(j, *q[x]) for j, q in enumerate(seqs) if x < len(q)]
    return tuple(passes), tuple(steps)


class Streams:
    """The communication streams of every rank during one walk: when each rank's TP and EP
    streams are next free, the compute stream's waits for each (per rank), and which pass outputs
    were last completed by an EP exchange (`ep_ready`: indices into the walk's `ready`)."""

    __slots__ = ("tp_free", "ep_free", "tp_wait", "ep_wait", "ep_ready")

    def __init__(self, ranks: int):
        self.tp_free, self.ep_free = [0.0] * ranks, [0.0] * ranks
        self.tp_wait, self.ep_wait = [0.0] * ranks, [0.0] * ranks
        self.ep_ready: set[int] = set()


def _run_units(unit_steps, r, k, t, bsy, cnt, pk, m, nm, ready, streams, cq, th, eh, rec_c,
               rec_tp, rec_ep, rec_u, pass_done):
    """Time one unit action or braid on rank r from host time t; returns (t, busy, count, peak).

    The compute stream takes the passes' units alternately; each unit waits for its local input
    (first unit) or the exchanges of the unit before it in its pass (`pass_done` keeps that
    across actions for passes written unit by unit, with whether EP ended last); collectives
    queue on the rank's TP stream, all-to-alls on its EP stream. The compute stream is free at
    the end of the last unit; the passes' outputs are ready (in `ready`) when their last
    exchanges end. rec_c, rec_tp, rec_ep, rec_u: timeline lists, or None."""
    passes, steps = unit_steps
    start = t
    for plan in passes:                           # stored activations count from the start
        if plan[5] > 0:
            cnt += plan[5]
            if cnt > pk:
                pk = cnt
    waits, by_ep = [], []
    ep_ready = streams.ep_ready
    for code, s, mb, first, _, _ in passes:       # a pass's first unit needs its input
        if not first:
            w, e = pass_done.pop((code, s, mb), (0.0, False))
        elif code == 0:
            i = (s - 1) * m + mb
            w, e = (ready[i], i in ep_ready) if s > 0 else (0.0, False)
        elif code in (1, 2):                      # its forward's output and the gradient
            i, g = s * m + mb, nm + (s + 1) * m + mb
            w, e = ready[i], i in ep_ready
            if (s + 1) * m < nm and ready[g] > w:
                w, e = ready[g], g in ep_ready
        else:
            w, e = 0.0, False
        waits.append(w)
        by_ep.append(e)
    tpx, epx = streams.tp_wait[r], streams.ep_wait[r]
    tpf, epf = streams.tp_free[r], streams.ep_free[r]
    for j, ci, ti, ei, unit in steps:
        w = waits[j]
        if w > t:                                 # waiting for an exchange (or a local input)
            if by_ep[j]:
                epx += w - t
            else:
                tpx += w - t
            bsy += w - t
            t = w
        c = cq[ci]
        if rec_u is not None:
            rec_u.append((r, k, j, unit, t, t + c))
        t += c
        bsy += c
        done, ep_last = t, False
        comm = th[ti]
        if comm > 0:
            c0 = t if t > tpf else tpf
            tpf = c0 + comm
            if rec_tp is not None:
                rec_tp.append((r, k, c0, tpf))
            done = tpf
        a2a = eh[ei]
        if a2a > 0:
            c0 = t if t > epf else epf
            epf = c0 + a2a
            if rec_ep is not None:
                rec_ep.append((r, k, c0, epf))
            if epf > done:
                done, ep_last = epf, True
        waits[j] = done
        by_ep[j] = ep_last
    streams.tp_wait[r], streams.ep_wait[r] = tpx, epx
    streams.tp_free[r], streams.ep_free[r] = tpf, epf
    if rec_c is not None:
        rec_c.append((r, k, start, t))
    for (code, s, mb, _, last, mem), done, e in zip(passes, waits, by_ep):
        if mem < 0:
            cnt += mem
        if not last:
            pass_done[(code, s, mb)] = (done, e)
            continue
        if code == 0:
            i = s * m + mb
        elif code in (1, 2):
            i = nm + s * m + mb
        else:
            continue
        ready[i] = done
        if e:
            ep_ready.add(i)
        else:
            ep_ready.discard(i)
    return t, bsy, cnt, pk
