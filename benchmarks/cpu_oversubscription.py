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
capacity is the together rates' sum over the lone rate (commpipe.plan.cpu.
measure_core_capacity, which keeps it within [1, cores]), for two workloads:
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
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"


def capacity(processes: int, kind: str, seconds: float) -> float:
    """commpipe.plan.cpu.measure_core_capacity of `processes` on this host's cores, stepping
    the model's first stage ("layer") or the op micro-benchmark ("ops")."""
    from commpipe.plan.cpu import measure_core_capacity

    return measure_core_capacity(len(os.sched_getaffinity(0)), seconds, processes=processes,
                                 model=MODEL if kind == "layer" else None, seq_len=32)


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
