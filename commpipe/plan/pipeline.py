"""The simulator, as the planner calls it: cached programs, and long runs by extrapolation.

A step with m micro-batches is periodic once the pipeline is full: adding one period of k
micro-batches (`ScheduleInfo.steady_period`: pp for looped schedules, 1 for the V-shaped
ones, whose every steady-state round takes one more micro-batch through both chunks) adds the
same work in the same pattern, so makespan and busy time grow by a constant per period. For
long steps the planner simulates three runs, m1 = m (mod k) with m1 >= 2*pp, m1 + k and
m1 + 2k; once the two increments agree (to 1e-9) and are no smaller than the busiest rank's
added work (the slope's lower bound: before that the bottleneck is still absorbing idle time),
the line is extended:

    T(m) = T(m1) + (m - m1) / k * (T(m1 + 2k) - T(m1 + k))

Strongly unbalanced stages can take a few periods to settle; then m1 moves up by 2*pp and,
if it never settles below m, m itself is simulated. tests/test_plan.py checks the result
against full simulations with random per-stage costs. Programs are generated and lowered
once per (schedule, pp, vpp, m), results are cached per cost table, and the in-flight counts
(which depend on the action order only) once per schedule shape, so a search over tens of
thousands of layouts runs a few hundred short simulations.

Braided schedules (STP, DualPipeV) get their TP collectives as the cost table's `tp_comm`: the
simulator runs them on a TP stream where the other pass of a braid hides them.
"""

from __future__ import annotations

from functools import lru_cache

from commpipe.schedules import generate, lower
from commpipe.schedules.actions import COMM_OPS as _COMM_OPS
from commpipe.schedules.actions import Program
from commpipe.schedules.registry import info
from commpipe.sim import CostTable, simulate
from commpipe.sim.engine import gc_paused, peak_activations

M_CAP_PER_STAGE = 2     # simulate at least 2*pp micro-batches before extrapolating
M_CAP_MIN = 4


def representative_ms(pp: int, m: int, period: int | None = None) -> list[int]:
    period = period or pp
    cap = max(M_CAP_PER_STAGE * pp, M_CAP_MIN)
    if m <= cap + period:
        return [m]
    m1 = cap + (m - cap) % period
    return [m1, m1 + period]


# programs are up to ~1e5 long-lived actions each: built with the cyclic collector paused
# (it would rescan them, and everything cached before them, while they are made)
@lru_cache(maxsize=256)
def generated_program(schedule: str, pp: int, m: int, vpp: int) -> Program:
    """The compute-only program (what in-flight counts and action counts read)."""
    with gc_paused():
        return generate(schedule, pp, m, vpp)


@lru_cache(maxsize=256)
def lowered_program(schedule: str, pp: int, m: int, vpp: int) -> Program:
    prog = generated_program(schedule, pp, m, vpp)
    with gc_paused():
        return lower(prog)


def _kinds(prog: Program) -> list[dict]:
    out = []
    for acts in prog.actions:
        count: dict = {}
        for a in acts:
            if a.op in _COMM_OPS:
                continue
            # (op, stage) of each part: a braid's forward, then its pair (Action.parts)
            key = ((a.op, a.stage),) if a.pair is None else (("F", a.stage), (a.pair.op, a.pair.stage))
            count[key] = count.get(key, 0) + 1
        out.append(count)
    return out


@lru_cache(maxsize=1024)
def action_counts(schedule: str, pp: int, vpp: int, m: int) -> tuple[dict, ...]:
    """Per pipeline rank, how often each kind of compute action runs in a step: keys are
    ((op, stage),) for a plain action and ((F, stage), (op, stage)) for a braid. Counts grow
    linearly in m (one more micro-batch adds one steady-state round), so they come from the two
    smallest programs; tests/test_plan.py checks them against generated ones."""
    m0 = info(schedule).min_m(pp)
    if m <= m0 + 1:
        return tuple(_kinds(generated_program(schedule, pp, m, vpp)))
    a, b = (_kinds(generated_program(schedule, pp, k, vpp)) for k in (m0, m0 + 1))
    return tuple({k: a[r].get(k, 0) + (m - m0) * (b[r].get(k, 0) - a[r].get(k, 0))
                  for k in set(a[r]) | set(b[r])} for r in range(pp))


@lru_cache(maxsize=4096)
def _braid_steps(parts: tuple, n: int) -> tuple:
    from commpipe.sim.units import _unit_steps

    return _unit_steps([(op, st, 0, None) for op, st in parts], n)


def braid_span(parts: tuple, f: list[float], b: list[float], i: list[float], w: list[float],
               tp_comm: list[float], ep_comm: list[float] | None = None) -> float:
    """How long the compute stream is held by one braid ((op, stage) pairs) with nothing else
    in flight: the simulator's own unit walk (commpipe.sim.units) on that braid alone. Any
    wait for an input or a busy TP or EP stream only lengthens it, so it bounds the braid
    below."""
    from commpipe.sim.units import Streams, _run_units

    n = len(f)
    steps = _braid_steps(parts, n)
    durs = (f, b, i, w)
    ep = ep_comm or [0.0] * n
    # the walk's cost lists (quarter passes, half collectives by code * n + stage), for the
    # entries this braid reads
    cq = {ci: durs[ci // n][ci % n] / 4 for _, ci, _, _, _ in steps[1]}
    th = {ti: tp_comm[ti % n] / 2 for _, _, ti, _, _ in steps[1]}
    eh = {ei: ep[ei % n] / 2 for _, _, _, ei, _ in steps[1]}
    th[-1] = eh[-1] = 0.0
    return _run_units(steps, 0, 0, 0.0, 0.0, 0.0, 0.0, 1, n, [0.0] * (2 * n), Streams(1), cq, th,
                      eh, None, None, None, None, {})[0]


@lru_cache(maxsize=1024)
def _peak_at(schedule: str, pp: int, vpp: int, m: int) -> tuple[float, ...]:
    # the in-flight counts follow each rank's action order alone: no lowering, no timing
    return tuple(peak_activations(generated_program(schedule, pp, m, vpp)))


def peak_inflight(schedule: str, pp: int, vpp: int, m: int) -> tuple[float, ...]:
    """Peak micro-batches in flight per pipeline rank (units of one rank's share of the
    model), from the simulator's activation walk; independent of the cost values.

    Every schedule but GPipe reaches its peak during warm-up, which is shorter than 2*pp
    micro-batches, so the walk at min(m, 2*pp) gives the peak for any m; GPipe holds all m
    (both facts checked against full walks in tests/test_plan.py)."""
    if schedule == "gpipe":
        small = min(m, 2)
        return tuple(x * m / small for x in _peak_at(schedule, pp, vpp, small))
    return _peak_at(schedule, pp, vpp, min(m, 2 * pp))


def _key(xs) -> tuple:
    return tuple(float(f"{x:.6g}") for x in xs)


_SIM_CACHE: dict = {}


def simulate_step(schedule: str, pp: int, vpp: int, m: int, f: list[float], b: list[float],
                  i: list[float], w: list[float], latency_ms: dict | float,
                  bandwidth_gbps: dict | float, activation_bytes: float,
                  tp_comm: list[float] | None = None,
                  ep_comm: list[float] | None = None) -> tuple[float, list[float]]:
    """(makespan ms, busy ms per rank) of one step with per-stage costs in ms. `tp_comm`: the
    TP collectives per stage and pass (F, and B or I) that the simulator runs on its own TP
    stream, hidden behind the other pass of a braid (braided schedules); None: already in
    f, b and i. `ep_comm`: the same for a MoE stage's expert-parallel all-to-alls (EP stream)."""
    key = (schedule, pp, vpp, m, _key(f), _key(b), _key(i), _key(w),
           _key(latency_ms.values()) if isinstance(latency_ms, dict) else latency_ms,
           _key(bandwidth_gbps.values()) if isinstance(bandwidth_gbps, dict) else bandwidth_gbps,
           activation_bytes, _key(tp_comm) if tp_comm else None,
           _key(ep_comm) if ep_comm else None)
    hit = _SIM_CACHE.get(key)
    if hit is not None:
        return hit
    period = info(schedule).steady_period(pp)
    ms = representative_ms(pp, m, period)
    comm = (tp_comm, ep_comm)
    if len(ms) == 1:
        out = _run(key, m, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes, *comm)
    else:
        # extend the line once two consecutive periods agree (unbalanced stages can take a few
        # periods to settle); if they never do below m, simulate m itself
        m1 = ms[0]
        while True:
            if m1 + 2 * period > m:
                out = _run(key, m, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes, *comm)
                break
            runs = [_run(key, m1 + k * period, f, b, i, w, latency_ms, bandwidth_gbps,
                         activation_bytes, *comm)
                    for k in range(3)]
            d1, d2 = runs[1][0] - runs[0][0], runs[2][0] - runs[1][0]
            # the makespan cannot grow slower than the busiest rank's work: until it does, the
            # bottleneck is still absorbing idle time and the plateau is not the steady state
            work = max(c - a for a, c in zip(runs[1][1], runs[2][1]))
            if abs(d2 - d1) <= 1e-9 * runs[2][0] and d2 >= work * (1 - 1e-9):
                steps = (m - m1) / period
                out = (runs[0][0] + steps * d2,
                       [a + steps * (c - a) for a, c in zip(runs[0][1], runs[1][1])])
                break
            m1 += 2 * pp
    if len(_SIM_CACHE) > 20000:
        _SIM_CACHE.clear()
    _SIM_CACHE[key] = out
    return out


def _run(key, mm, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes, tp_comm, ep_comm):
    sub_key = key[:3] + (mm,) + key[4:]
    sub = _SIM_CACHE.get(sub_key)
    if sub is None:
        prog = lowered_program(key[0], key[1], mm, key[2])
        costs = CostTable(f=list(f), b=list(b), i=list(i), w=list(w), latency_ms=latency_ms,
                          bandwidth_gbps=bandwidth_gbps, activation_bytes=activation_bytes,
                          tp_comm=list(tp_comm) if tp_comm else None,
                          ep_comm=list(ep_comm) if ep_comm else None)
        res = simulate(prog, costs, check=False, record=False)
        sub = (res.makespan, list(res.busy))
        _SIM_CACHE[sub_key] = sub
    return sub


def cache_clear() -> None:
    _SIM_CACHE.clear()
    _peak_at.cache_clear()
    lowered_program.cache_clear()
    generated_program.cache_clear()
    action_counts.cache_clear()


def busy_overlap(schedule: str, pp: int, vpp: int, m: int, f: list[float], b: list[float],
                 i: list[float], w: list[float], latency_ms: dict | float,
                 bandwidth_gbps: dict | float, activation_bytes: float,
                 cpu_share: dict[str, list[float]] | None = None,
                 tp_comm: list[float] | None = None,
                 ep_comm: list[float] | None = None) -> float:
    """Pipeline ranks using the CPU at once, as a CPU-using rank sees it: the integral of
    n(t)^2 over that of n(t), where each compute action contributes its CPU share (`cpu_share`
    per op letter F/B/I/W and stage, default 1: the whole action) to n(t) while it runs (1 for
    a single rank; p in a pipeline whose stages always overlap). Long runs use a
    representative m (the steady state repeats), like `simulate_step`."""
    mm = min(m, max(M_CAP_PER_STAGE * pp, M_CAP_MIN) + pp)
    prog = lowered_program(schedule, pp, mm, vpp)
    costs = CostTable(f=list(f), b=list(b), i=list(i), w=list(w), latency_ms=latency_ms,
                      bandwidth_gbps=bandwidth_gbps, activation_bytes=activation_bytes,
                      tp_comm=list(tp_comm) if tp_comm else None,
                      ep_comm=list(ep_comm) if ep_comm else None)
    res = simulate(prog, costs, check=False)
    edges = []
    for rank, k, start, end in res._compute:
        act = prog.actions[rank][k]
        # a braid's two passes share its span: the mean of their CPU shares
        share = (sum(cpu_share[x.op][x.stage] for x in act.parts) / len(act.parts)
                 if cpu_share else 1.0)
        edges += [(start, share), (end, -share)]
    edges.sort()
    n, last, first, second = 0.0, 0.0, 0.0, 0.0
    for t, step in edges:
        first += n * (t - last)
        second += n * n * (t - last)
        n, last = n + step, t
    return second / first if first > 0 else 1.0
