"""What a CPU host's cores deliver when more ranks than cores share them: N processes at once.

    python benchmarks/cpu_oversubscription.py                   # ~4 min on 2 cores
    python benchmarks/cpu_oversubscription.py --processes 2,4,8 --rounds 3 --seconds 3

The planner prices ranks that share a host's cores by processor sharing (commpipe.plan.host):
n busy ranks on `host_cores` cores each run at host_cores / n of a lone rank, `host_cores` being
what `plan --host-cores auto` measures (commpipe.plan.cpu.measure_core_capacity: its op
micro-benchmark, one process per core). With more busy processes than cores the scheduler also
switches between them, and each switch refills caches the others evicted; processor sharing
does not price that. Here N processes run one workload for --seconds at once, process 0 also
alone just before (a lone rate to divide by, from the same moment of the host's speed), and the
capacity is the together rates' sum over the lone rate, for two workloads:
  - layer: the forward and backward of the planned model's embedding and first layer at 4
    samples (the demo's 8-layer, 64-wide LLaMA; commpipe.plan.pass_split measures the pass on
    the same stage), one thread;
  - ops: the planner's op micro-benchmark (commpipe.plan.cpu.op_step), one thread.
Rounds interleave the process counts so that the host's drift hits all alike; the table gives
the median capacity over rounds and each count's median against the one-process-per-core count.
No assertion; prints ratios.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"


def _workload(kind: str):
    import torch

    torch.set_num_threads(1)
    if kind == "ops":
        from commpipe.plan.cpu import op_step

        return op_step()
    from commpipe.models.family import family_of
    from commpipe.models.spec import resolve_model

    spec = resolve_model(MODEL)
    torch.manual_seed(0)
    stage = family_of(spec).build_stages(spec, [range(0, 1), range(1, spec.layers)], 0,
                                         torch.device("cpu"))[0]
    tokens = torch.randint(0, spec.vocab, (4, 32))
    return lambda: stage(tokens).float().sum().backward()


def _worker(index: int, kind: str, seconds: float, barrier, results) -> None:
    step = _workload(kind)
    for _ in range(3):
        step()                                      # warm-up
    rates = []
    for phase in ("alone", "together"):
        barrier.wait()
        if phase == "alone" and index != 0:
            continue
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        rates.append(n / (time.perf_counter() - t0))
    barrier.wait()
    results.put((index, rates))


def capacity(processes: int, kind: str, seconds: float) -> float:
    """The together rates' sum over process 0's lone rate (commpipe.plan.cpu.capacity_of's
    measure, without its clamp to the core count)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, kind, seconds, barrier, results))
             for i in range(processes)]
    for p in procs:
        p.start()
    try:
        rates = dict(results.get(timeout=120 + 4 * seconds) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    alone = rates[0][0]
    return (rates[0][1] + sum(r[0] for i, r in rates.items() if i)) / alone


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", default=None, help="counts, comma-separated (default: cores, "
                                                      "2x and 4x cores)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="per phase (alone, together)")
    p.add_argument("--workloads", default="layer,ops")
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    counts = ([int(x) for x in args.processes.split(",")] if args.processes
              else [cores, 2 * cores, 4 * cores])
    kinds = args.workloads.split(",")
    got: dict = {(k, n): [] for k in kinds for n in counts}
    print(f"{cores} cores; {args.rounds} rounds of {', '.join(map(str, counts))} processes, "
          f"{args.seconds:g} s each phase", flush=True)
    for r in range(args.rounds):
        order = counts if r % 2 == 0 else counts[::-1]
        for kind in kinds:
            for n in order:
                got[(kind, n)].append(capacity(n, kind, args.seconds))
        print(f"round {r + 1}: " + "; ".join(f"{k} x{n} {got[(k, n)][-1]:.2f}" for k in kinds
                                            for n in counts), flush=True)
    base = counts[0]
    print(f"\n{'workload':<8} {'processes':>9} {'capacity (median)':>18} {'range':>12} "
          f"{'vs ' + str(base):>8}")
    for kind in kinds:
        ref = statistics.median(got[(kind, base)])
        for n in counts:
            v = got[(kind, n)]
            med = statistics.median(v)
            print(f"{kind:<8} {n:>9} {med:>18.2f} {min(v):>5.2f}-{max(v):<6.2f} {med / ref:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
