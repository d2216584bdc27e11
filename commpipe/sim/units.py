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
      (pass index, cost index, TP index, unit): a unit computes cq[cost index] and then, with
      a TP collective, runs th[TP index] on the TP stream (index -1: none)."""
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
        seqs.append([(code * n + s, code * n + s if u in _TP_UNITS[op] else -1, u) for u in units])
    steps = []
    for x in range(max(len(q) for q in seqs)):
        steps += [(j, *q[x]) for j, q in enumerate(seqs) if x < len(q)]
    return tuple(passes), tuple(steps)


def _run_units(unit_steps, r, k, t, bsy, cnt, pk, m, nm, ready, tp_free, exposed, cq, th, rec_c,
               rec_tp, rec_u, pass_done):
    """Time one unit action or braid on rank r from host time t; returns (t, busy, count, peak).

    The compute stream takes the passes' units alternately; each unit waits for its local input
    (first unit) or the collective of the unit before it in its pass (`pass_done` keeps that
    across actions for passes written unit by unit); collectives queue on the rank's TP stream.
    The compute stream is free at the end of the last unit; the passes' outputs are ready (in
    `ready`) when their last collectives end. rec_c, rec_tp, rec_u: timeline lists, or None."""
    passes, steps = unit_steps
    start = t
    for plan in passes:                           # stored activations count from the start
        if plan[5] > 0:
            cnt += plan[5]
            if cnt > pk:
                pk = cnt
    waits = []
    for code, s, mb, first, _, _ in passes:       # a pass's first unit needs its input
        if not first:
            waits.append(pass_done.pop((code, s, mb), 0.0))
        elif code == 0:
            waits.append(ready[(s - 1) * m + mb] if s > 0 else 0.0)
        elif code in (1, 2):                      # its forward's output and the gradient
            waits.append(max(ready[s * m + mb],
                             ready[nm + (s + 1) * m + mb] if (s + 1) * m < nm else 0.0))
        else:
            waits.append(0.0)
    ex, tpf = exposed[r], tp_free[r]
    for j, ci, ti, unit in steps:
        w = waits[j]
        if w > t:                                 # waiting for a collective (or a local input)
            ex += w - t
            bsy += w - t
            t = w
        c = cq[ci]
        if rec_u is not None:
            rec_u.append((r, k, j, unit, t, t + c))
        t += c
        bsy += c
        comm = th[ti]
        if comm > 0:
            c0 = t if t > tpf else tpf
            tpf = c0 + comm
            if rec_tp is not None:
                rec_tp.append((r, k, c0, tpf))
            waits[j] = tpf
        else:
            waits[j] = t
    exposed[r], tp_free[r] = ex, tpf
    if rec_c is not None:
        rec_c.append((r, k, start, t))
    for (code, s, mb, _, last, mem), done in zip(passes, waits):
        if mem < 0:
            cnt += mem
        if not last:
            pass_done[(code, s, mb)] = done
        elif code == 0:
            ready[s * m + mb] = done
        elif code in (1, 2):
            ready[nm + s * m + mb] = done
    return t, bsy, cnt, pk
