"""The simulator, as the planner calls it: cached programs, and long runs by extrapolation.

A step with m micro-batches is periodic once the pipeline is full: adding pp micro-batches to
any of the schedules adds the same work in the same pattern, so makespan and busy time grow
by a constant per pp micro-batches. For m above 3*pp the planner simulates three runs,
m1 = m (mod pp) with m1 >= 2*pp, m1 + pp and m1 + 2*pp; once the two increments agree (to
1e-9) and are no smaller than the busiest rank's added work (the slope's lower bound: before
that the bottleneck is still absorbing idle time), the line is extended:

    T(m) = T(m1) + (m - m1) / pp * (T(m1 + 2pp) - T(m1 + pp))

Strongly unbalanced stages can take a few periods to settle; then m1 moves up by 2*pp and,
if it never settles below m, m itself is simulated. tests/test_plan.py checks the result
against full simulations with random per-stage costs. Programs are generated and lowered
once per (schedule, pp, vpp, m), results are cached per cost table, and the in-flight counts
(which depend on the action order only) once per schedule shape, so a search over tens of
thousands of layouts runs a few hundred short simulations.
"""

from __future__ import annotations

from functools import lru_cache

from commpipe.schedules import generate, lower
from commpipe.schedules.actions import Program
from commpipe.sim import CostTable, simulate

M_CAP_PER_STAGE = 2     # simulate at least 2*pp micro-batches before extrapolating
M_CAP_MIN = 4


def representative_ms(pp: int, m: int) -> list[int]:
    cap = max(M_CAP_PER_STAGE * pp, M_CAP_MIN)
    if m <= cap + pp:
        return [m]
    m1 = cap + (m - cap) % pp
    return [m1, m1 + pp]


@lru_cache(maxsize=256)
def lowered_program(schedule: str, pp: int, m: int, vpp: int) -> Program:
    return lower(generate(schedule, pp, m, vpp))


def _extend(values: list[list[float]], ms: list[int], m: int, pp: int) -> list[float]:
    if len(ms) == 1:
        return values[0]
    steps = (m - ms[0]) / pp
    return [a + steps * (b - a) for a, b in zip(values[0], values[1])]


@lru_cache(maxsize=1024)
def _peak_at(schedule: str, pp: int, vpp: int, m: int) -> tuple[float, ...]:
    prog = lowered_program(schedule, pp, m, vpp)
    res = simulate(prog, CostTable.uniform(prog.num_stages, f=1.0, b=2.0), check=False)
    return tuple(res.peak_activations)


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
                  bandwidth_gbps: dict | float, activation_bytes: float) -> tuple[float, list[float]]:
    """(makespan ms, busy ms per rank) of one step with per-stage costs in ms."""
    key = (schedule, pp, vpp, m, _key(f), _key(b), _key(i), _key(w),
           _key(latency_ms.values()) if isinstance(latency_ms, dict) else latency_ms,
           _key(bandwidth_gbps.values()) if isinstance(bandwidth_gbps, dict) else bandwidth_gbps,
           activation_bytes)
    hit = _SIM_CACHE.get(key)
    if hit is not None:
        return hit
    ms = representative_ms(pp, m)
    if len(ms) == 1:
        out = _run(key, m, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes)
    else:
        # extend the line once two consecutive periods agree (unbalanced stages can take a few
        # periods to settle); if they never do below m, simulate m itself
        m1 = ms[0]
        while True:
            if m1 + 2 * pp > m:
                out = _run(key, m, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes)
                break
            runs = [_run(key, m1 + k * pp, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes)
                    for k in range(3)]
            d1, d2 = runs[1][0] - runs[0][0], runs[2][0] - runs[1][0]
            # the makespan cannot grow slower than the busiest rank's work: until it does, the
            # bottleneck is still absorbing idle time and the plateau is not the steady state
            work = max(c - a for a, c in zip(runs[1][1], runs[2][1]))
            if abs(d2 - d1) <= 1e-9 * runs[2][0] and d2 >= work * (1 - 1e-9):
                steps = (m - m1) / pp
                out = (runs[0][0] + steps * d2,
                       [a + steps * (c - a) for a, c in zip(runs[0][1], runs[1][1])])
                break
            m1 += 2 * pp
    if len(_SIM_CACHE) > 20000:
        _SIM_CACHE.clear()
    _SIM_CACHE[key] = out
    return out


def _run(key, mm, f, b, i, w, latency_ms, bandwidth_gbps, activation_bytes):
    sub_key = key[:3] + (mm,) + key[4:]
    sub = _SIM_CACHE.get(sub_key)
    if sub is None:
        prog = lowered_program(key[0], key[1], mm, key[2])
        costs = CostTable(f=list(f), b=list(b), i=list(i), w=list(w), latency_ms=latency_ms,
                          bandwidth_gbps=bandwidth_gbps, activation_bytes=activation_bytes)
        res = simulate(prog, costs, check=False)
        sub = (res.makespan, list(res.busy))
        _SIM_CACHE[sub_key] = sub
    return sub


def cache_clear() -> None:
    _SIM_CACHE.clear()
    _peak_at.cache_clear()
    lowered_program.cache_clear()


def busy_overlap(schedule: str, pp: int, vpp: int, m: int, f: list[float], b: list[float],
                 i: list[float], w: list[float], latency_ms: dict | float,
                 bandwidth_gbps: dict | float, activation_bytes: float,
                 cpu_share: dict[str, list[float]] | None = None) -> float:
    """Pipeline ranks using the CPU at once, as a CPU-using rank sees it: the integral of
    n(t)^2 over that of n(t), where each compute action contributes its CPU share (`cpu_share`
    per op letter F/B/I/W and stage, default 1: the whole action) to n(t) while it runs (1 for
    a single rank; p in a pipeline whose stages always overlap). Long runs use a
    representative m (the steady state repeats), like `simulate_step`."""
    mm = min(m, max(M_CAP_PER_STAGE * pp, M_CAP_MIN) + pp)
    prog = lowered_program(schedule, pp, mm, vpp)
    costs = CostTable(f=list(f), b=list(b), i=list(i), w=list(w), latency_ms=latency_ms,
                      bandwidth_gbps=bandwidth_gbps, activation_bytes=activation_bytes)
    res = simulate(prog, costs, check=False)
    edges = []
    for rank, k, start, end in res._compute:
        act = prog.actions[rank][k]
        share = cpu_share[act.op][act.stage] if cpu_share else 1.0
        edges += [(start, share), (end, -share)]
    edges.sort()
    n, last, first, second = 0.0, 0.0, 0.0, 0.0
    for t, step in edges:
        first += n * (t - last)
        second += n * n * (t - last)
        n, last = n + step, t
    return second / first if first > 0 else 1.0
