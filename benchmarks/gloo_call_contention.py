"""A gloo collective call's host time while the other ranks on the machine compute, against while
they wait: what the adaptive controller's per-call time (`Measured.call_ms`, timed before the
first step by ranks 0 and 1 while the others wait) is worth during training.

    python benchmarks/gloo_call_contention.py              # 4 local ranks, 8 rounds, ~1 min

Ranks 0 and 1 make the controller's probe calls (commpipe.monitor.probe.calls_after_compute:
all-reduce, all-gather and reduce-scatter of 8 KiB, each after 0.5 ms of compute, no barrier) in
rounds; in every other round ranks 2.. compute (matrix products, one thread each, as training
does) until the round ends, else they sleep in a barrier. Rounds alternate which mode goes
first in each pair, so drift in machine load hits both alike. Prints, per op, the median
per-call time of each mode and their ratio (median over pairs), beside the processor-sharing
factor commpipe.plan.host uses for the same situation: ranks using the CPU at once over the
cores, max(1, busy / cores) (here the pair alone, then all ranks). No assertion.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIR = "call_pair"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (not under torchrun)")
    p.add_argument("--rounds", type=int, default=8, help="rounds (an even number: busy/idle pairs)")
    p.add_argument("--calls", type=int, default=30, help="timed calls per op and round")
    p.add_argument("--flags", default=None, help=argparse.SUPPRESS)   # the ranks' shared folder
    return p.parse_args(argv)


def _spin(stop: Path) -> None:
    import torch

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    while not stop.exists():
        for _ in range(20):
            a = (a @ b).tanh()


def rank_main(args) -> None:
    import torch.distributed as dist

    from commpipe.monitor.probe import CALL_BYTES, CALL_GAP_S, calls_after_compute
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims
    from commpipe.parallel.world import init_distributed

    rank, world = init_distributed("gloo")
    comm = Comm(ParallelDims(dp=world), rank)
    comm.add_groups(PAIR, [[0, 1]] + [[r] for r in range(2, world)])
    flags = Path(args.flags)
    results = []                                    # (round, mode, {op: median ms}) on rank 0
    for r in range(args.rounds):
        pair, first = divmod(r, 2)
        busy = (first == 0) == (pair % 2 == 0)      # busy first in even pairs, idle first in odd
        stop = flags / f"stop-{r}"
        comm.barrier("world")
        if rank < 2:
            ops = calls_after_compute(comm, CALL_BYTES, args.calls, 5, CALL_GAP_S, dim=PAIR)
            if rank == 0:
                results.append((r, "busy" if busy else "idle",
                                {op: v["median_ms"] for op, v in ops.items()}))
                stop.touch()
        elif busy:
            _spin(stop)
        comm.barrier("world")
    if rank == 0:
        report(results, world)
    dist.destroy_process_group()


def report(results, world: int) -> None:
    cores = len(os.sched_getaffinity(0))
    ops = list(results[0][2])
    print(f"{world} ranks on {cores} cores; ranks 0-1 time {ops} calls, ranks 2-{world - 1} "
          f"compute (busy) or wait (idle)")
    print(f"processor sharing (commpipe.plan.host): idle {max(1.0, 2 / cores):.2f}, busy "
          f"{max(1.0, world / cores):.2f}, ratio {max(1.0, world / cores) / max(1.0, 2 / cores):.2f}")
    print(f"{'op':<15} {'idle ms':>8} {'busy ms':>8} {'busy/idle':>10} {'IQR':>12}")
    for op in ops:
        idle = [m[op] for _, mode, m in results if mode == "idle"]
        busy = [m[op] for _, mode, m in results if mode == "busy"]
        ratios = sorted(b / i for b, i in zip(busy, idle))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"{op:<15} {statistics.median(idle):>8.3f} {statistics.median(busy):>8.3f} "
              f"{statistics.median(ratios):>10.2f} {q[0]:>5.2f}-{q[2]:<5.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.rounds < 2 or args.rounds % 2:
        raise SystemExit("--rounds must be an even number >= 2")
    if "WORLD_SIZE" in os.environ:
        raise SystemExit("run it without torchrun: it spawns its --nproc local ranks itself, which "
                         "share a folder to end each busy round")
    if args.nproc < 3:
        raise SystemExit("--nproc must be at least 3: ranks 0-1 time calls, the others compute")
    from _local_ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="gloo_calls_") as flags:
        argv = (sys.argv[1:] if argv is None else list(argv)) + ["--flags", flags]
        args.flags = flags
        run_ranks(rank_main, parse_args, args, args.nproc, argv)


if __name__ == "__main__":
    main()
