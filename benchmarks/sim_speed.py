"""Wall time of the pipeline simulator on large programs (goal: < 1 s per simulate call).

    python benchmarks/sim_speed.py [--repeats 3]

For 1F1B p=64 m=1024 and ZB-V p=32 m=512 it prints the best-of-N time of each phase:
generating the compute-only program, `simulate` end to end (which lowers, validates and
walks), and, separately, materializing the `events` timeline (lazy, only when asked for),
plus the end-to-end time as a ratio of the 1 s goal. On a shared machine wall time swings
with other load, so the CPU time of the end-to-end call (time.process_time) is printed too.
"""

from __future__ import annotations

import argparse
import time

from commpipe.schedules import check_program, generate, lower
from commpipe.sim import simulate

CASES = [("1f1b", 64, 1024, 1), ("zbv", 32, 512, 2)]


def best_of(n, fn, *args, clock=time.perf_counter, **kw):
    best, out = float("inf"), None
    for _ in range(n):
        t0 = clock()
        out = fn(*args, **kw)
        best = min(best, clock() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'case':<22}{'actions':>9}{'generate':>10}{'lower':>8}{'check':>8}{'walk':>8}"
          f"{'simulate':>10}{'/1s goal':>9}{'cpu':>8}{'events':>8}  bubble")
    for name, p, m, v in CASES:
        t_gen, prog = best_of(args.repeats, generate, name, p, m, v)
        t_low, low = best_of(args.repeats, lower, prog)
        t_chk, _ = best_of(args.repeats, check_program, low)
        t_walk, _ = best_of(args.repeats, simulate, low, check=False)
        t_sim, res = best_of(args.repeats, simulate, prog)      # lower + check + walk
        t_cpu, _ = best_of(args.repeats, simulate, prog, clock=time.process_time)
        t0 = time.perf_counter()
        n_events = len(res.events)
        t_ev = time.perf_counter() - t0
        n_act = sum(len(a) for a in low.actions)
        print(f"{f'{name} p={p} m={m}':<22}{n_act:>9}{t_gen:>9.3f}s{t_low:>7.3f}s{t_chk:>7.3f}s"
              f"{t_walk:>7.3f}s{t_sim:>9.3f}s{t_sim:>8.2f}x{t_cpu:>7.3f}s{t_ev:>7.2f}s  "
              f"{res.bubble_fraction:.4f} ({n_events} events)")


if __name__ == "__main__":
    main()
