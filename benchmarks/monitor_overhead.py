"""Overhead of the communication monitor on real training steps: off vs 10% vs 100% sampled.

    python benchmarks/monitor_overhead.py                       # spawns 4 local ranks, tp2 pp2
    torchrun --nproc-per-node 4 benchmarks/monitor_overhead.py --tp 2 --pp 2 --blocks 12
    python benchmarks/monitor_overhead.py --nproc 2 --tp 1 --pp 2 --steps-per-block 3

One process tree trains the tiny preset (commpipe.train.loop.Trainer) and toggles the monitor
every few steps, rotating the order off -> 10% -> 100% each round so that drift in machine
load hits every mode alike. Each block starts with a barrier (untimed) and lasts until its
slowest rank is done, so its wall time per step includes everything the monitor adds: the hot
path, and end_step's exchange (which also synchronises the ranks once per step).
Also prints the hot-path cost per call (begin + end) measured in isolation.
Prints medians and minima with their ratios to "off" (the minimum is the steadier estimate on
a shared machine); no assertion (see tests/test_monitor.py for correctness).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "sample=0.1", "all")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn without torchrun")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--blocks", type=int, default=24, help="monitor toggles (multiple of 3)")
    p.add_argument("--steps-per-block", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    return p.parse_args(argv)


def hot_path_ns(sample: float, steps: int = 200, calls_per_step: int = 100) -> float:
    """Extra ns per call that begin + end add on one rank, next to creating the CommCall the
    chokepoint creates anyway (no process group; end_step runs between steps, untimed)."""
    from commpipe.monitor import Monitor
    from commpipe.parallel.comm import Comm, CommCall
    from commpipe.parallel.dims import ParallelDims

    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(Comm(ParallelDims(), 0), d, sample=sample).attach()
        extra = []
        for step in range(steps):
            t0 = time.perf_counter()
            for i in range(calls_per_step):
                seq = step * calls_per_step + i   # one size class: its position is seq too
                CommCall("pp", "send", 4096, peer=1, seq=seq, size_class=13, size_seq=seq)
            t1 = time.perf_counter()
            for i in range(calls_per_step):
                seq = step * calls_per_step + i
                call = CommCall("pp", "send", 4096, peer=1, seq=seq, size_class=13, size_seq=seq)
                ctx = mon.begin(call)
                mon.end(ctx, call)
            t2 = time.perf_counter()
            extra.append((t2 - t1) - (t1 - t0))
            mon.end_step(step)
        mon.close()
    return statistics.median(extra) / calls_per_step * 1e9   # median: robust to a busy machine


def rank_main(args) -> None:
    from commpipe.monitor import Monitor
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.loop import Trainer

    world = int(os.environ["WORLD_SIZE"])
    dp = world // (args.tp * args.pp)
    cfg = TrainConfig(model="tiny", dims=ParallelDims(dp=dp, pp=args.pp, tp=args.tp),
                      microbatches=args.microbatches, seq_len=args.seq_len, steps=10**6)
    trainer = Trainer.build(cfg)
    comm = trainer.comm
    out = Path(tempfile.mkdtemp(prefix="monitor_overhead_"))
    monitors = {"sample=0.1": Monitor(comm, out / "m10", sample=0.1),
                "all": Monitor(comm, out / "m100", sample=1.0)}
    in_end_step = {m: [] for m in MODES}
    for mode, m in monitors.items():   # clock alignment once, outside the timed steps
        m.attach()
        m.detach()
        m.end_step = _timed(m.end_step, in_end_step[mode])
    for _ in range(args.warmup_steps):
        trainer.train_step()
    times = {m: [] for m in MODES}
    for block in range(args.blocks):
        rnd, pos = divmod(block, len(MODES))
        mode = MODES[(pos + rnd) % len(MODES)]
        for m in monitors.values():
            m.detach()
        trainer.monitor = monitors.get(mode)
        if trainer.monitor is not None:
            trainer.monitor.attach()
        comm.barrier()      # blocks start together; a block ends when its last rank is done
        t0 = time.perf_counter()
        for _ in range(args.steps_per_block):
            trainer.train_step()
        times[mode].append((time.perf_counter() - t0) / args.steps_per_block)
    trainer.monitor = None
    for m in monitors.values():
        m.close()
    everyone = comm.gather_objects((times, in_end_step), "world")
    if comm.rank == 0:
        report(args, world, everyone, out)
    comm.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


def _timed(fn, sink):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        fn(*a, **kw)
        sink.append(time.perf_counter() - t0)
    return wrapper


def report(args, world, everyone, out) -> None:
    print(f"tiny preset, {world} ranks (tp{args.tp} pp{args.pp}), {args.blocks} blocks of "
          f"{args.steps_per_block} steps; time per step = a block's wall time (all ranks start "
          f"together, it ends with its last rank) / steps, incl. end_step")
    base = None
    for mode in MODES:
        blocks = [r[0][mode] for r in everyone]
        slowest = [max(col) for col in zip(*blocks)]      # per block: its last rank
        med, low = statistics.median(slowest), min(slowest)
        base = base or (med, low)
        ends = [t for r in everyone for t in r[1][mode]]
        inside = f"  end_step median {statistics.median(ends) * 1e3:6.2f} ms" if ends else ""
        print(f"  monitor {mode:<11} median {med * 1e3:8.2f} ms/step (x{med / base[0]:.3f})"
              f"  min {low * 1e3:8.2f} ms/step (x{low / base[1]:.3f})  blocks={len(slowest)}{inside}")
    for sample in (0.1, 1.0):
        print(f"  hot path (begin+end per call, sample={sample}): {hot_path_ns(sample):8.0f} ns")
    print(f"  (monitor output of the timed blocks in {out})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.blocks % len(MODES):
        raise SystemExit(f"--blocks {args.blocks}: use a multiple of 3 so every mode runs equally often")
    from _local_ranks import run_ranks

    run_ranks(rank_main, parse_args, args, args.nproc, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
