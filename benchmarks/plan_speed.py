"""Planner speed: the full layout search for llama3-405b on 16,384 H100s.

    python benchmarks/plan_speed.py [--sample 60]

Searches every (tp, cp, pp, dp, vpp, micro-batch size, schedule, recompute) for llama3-405b on
16,384 H100s (8 per node), global batch 2048 sequences of 8192 tokens, and prints the time,
the counts (considered / fit in memory / simulated) and the top 5. Side by side it times
`estimate` (a full simulation) on a random sample of the layouts that fit, and extrapolates
what simulating all of them would cost, to show what the bound-and-prune search saves.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from commpipe.models.spec import resolve_model
from commpipe.plan.cluster import default_cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import resolve_gpu
from commpipe.plan.layout import Job, enumerate_layouts
from commpipe.plan.pipeline import cache_clear
from commpipe.plan.report import HEADER, row
from commpipe.plan.search import _prepare, search


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=60, help="feasible layouts to simulate one by one")
    args = ap.parse_args()
    spec = resolve_model("llama3-405b")
    job = Job(global_batch=2048, seq_len=8192)
    cluster = default_cluster(resolve_gpu("h100"), 16384, 8)

    cache_clear()
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(spec, job, cluster, top=5)
    t_search, c_search = time.perf_counter() - t0, time.process_time() - c0
    print("llama3-405b, 16384 x H100 (8/node), global batch 2048 x 8192 tokens")
    # the search is single-threaded: its CPU time is what the wall time is on an idle core
    print(f"full search: {t_search:.2f} s wall, {c_search:.2f} s CPU; layouts considered "
          f"{res.considered}, fit in memory {res.feasible}, simulated {res.simulated} (incl. the "
          "alternatives' searches)")
    print(HEADER)
    for n, e in enumerate(res.top, 1):
        print(row(n, e))

    # side by side: simulate a random sample of the feasible layouts one by one
    feasible = [lay for lay in enumerate_layouts(spec, job, cluster.num_gpus)
                if not isinstance(_prepare(spec, job, cluster, Efficiency(), lay), str)]
    sample = random.Random(0).sample(feasible, min(args.sample, len(feasible)))
    cache_clear()
    t0 = time.perf_counter()
    for lay in sample:
        estimate(spec, lay, job, cluster, detail=False)
    per = (time.perf_counter() - t0) / len(sample)
    every = per * len(feasible)
    print(f"\nsimulating every feasible layout: {per * 1e3:.1f} ms each (sample of {len(sample)}) x "
          f"{len(feasible)} = ~{every:.0f} s; the search took {t_search:.2f} s "
          f"({every / t_search:.0f}x less)")
    print(f"budget: < 10 s -> {'ok' if t_search < 10 else 'OVER'} (wall); "
          f"{'ok' if c_search < 10 else 'OVER'} (CPU, what an idle machine would take)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
