"""Overhead of `--adapt` on a healthy run, measured inside one launch: controller on vs off.

    python benchmarks/adapt_overhead.py                    # 2 local ranks, dp2, the suite's model
    python benchmarks/adapt_overhead.py --pp 2 --dp 1 --blocks 24

One process tree trains the adaptive suite's model (commpipe.adapt.demo.MODEL, seq 32, global
batch 8, fp32, the monitor sampling as `train` does by default) and switches the adaptive
controller on and off every few steps, alternating which mode goes first in each pair of blocks
so that drift in machine load hits both alike. "on" is what `--adapt` adds to a run: the step's
timeline, the collective timer, the monitor's exchange every step and the controller's turn
after each step (its gather, detection and, were anything found, a decision). "off" is the same
trainer without them. Both agree on a stop request after every step, as `train` does: "off" in
an all-reduce of the ranks' flags, "on" in the controller's gather. Each block starts with a
barrier (untimed) and lasts until its slowest rank is done, so its wall time per step holds
everything between steps too.

Prints the median over pairs of on/off time per step, with its interquartile range, the medians
of each mode, and where an "on" step's extra time goes (inside the step, in the controller's
turn); and the same ratio of the CPU seconds a block cost, summed over the ranks (on a shared
machine the wall clock also measures the other load; CPU seconds what the step cost).
Healthy means nothing should switch: a switch here is reported and ends the run. No
assertion; tests/test_adapt_*.py check the controller's behaviour.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--blocks", type=int, default=40, help="blocks (an even number: on/off pairs)")
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed steps first, with the controller on (it learns its baselines)")
    return p.parse_args(argv)


class Modes:
    """Switch what `--adapt` adds to a trainer on and off (Controller.prepare is the 'on')."""

    def __init__(self, trainer, controller):
        self.trainer, self.controller = trainer, controller
        self.mode = None

    def set(self, mode: str) -> None:
        t, c = self.trainer, self.controller
        if mode == "on":
            c.prepare(t)
        else:
            t.runtime.events = None
            if c.timer in t.comm.observers:
                t.comm.observers.remove(c.timer)
            if t.monitor is not None:     # the monitor exchanges on its own, as without --adapt
                c._drain()                  # after reading the summary (and records) in flight
                t.monitor.exchange_by_caller = False
        self.mode = mode


def rank_main(args) -> None:
    from commpipe.adapt.config import AdaptConfig
    from commpipe.adapt.demo import MODEL
    from commpipe.monitor import unmonitored
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.failures import StopSignals
    from commpipe.train.loop import Trainer

    out = Path(tempfile.mkdtemp(prefix="adapt_overhead_"))
    sched = {"schedule": "1f1b"} if args.pp > 1 else {}
    cfg = TrainConfig(model=MODEL, dims=ParallelDims(dp=args.dp, pp=args.pp), seq_len=32,
                      global_batch=8, seed=0, steps=10**6, out=str(out), adapt=AdaptConfig(),
                      **sched)
    trainer = Trainer.build(cfg)
    comm = trainer.comm
    controller = cfg.adapt.step_hook(trainer, out, None)
    modes = Modes(trainer, controller)
    stop_flags = StopSignals()
    inside = {"on": [], "off": []}     # train_step's own time (step_time_s)
    turn = []                          # the controller's after_step
    switched = None

    def step(timed: bool) -> None:
        nonlocal switched
        if trainer.runtime.events is not None:
            trainer.runtime.events.clear()
        rec = trainer.train_step()
        if timed:
            inside[modes.mode].append(rec["step_time_s"])
        # as commpipe.train.loop: the ranks agree every step on whether one was asked to stop,
        # in the controller's gather when it runs, else in an all-reduce of their flags
        if modes.mode == "on":
            t0 = time.perf_counter()
            new, _ = controller.after_step(trainer, rec, None, stop=False)
            if timed:
                turn.append(time.perf_counter() - t0)
            if new is not trainer:
                switched = rec["step"]
        else:
            with unmonitored(trainer):
                stop_flags.agreed(comm)

    modes.set("on")
    for _ in range(args.warmup_steps):
        step(False)
    times = {"on": [], "off": []}
    cpu = {"on": [], "off": []}
    for block in range(args.blocks):
        pair, second = divmod(block, 2)
        mode = ("on", "off")[(pair + second) % 2]    # on-off, off-on, on-off, ...
        modes.set(mode)
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.steps_per_block):
            step(True)
            if switched is not None:
                break
        cpu[mode].append((time.process_time() - c0) / args.steps_per_block)
        times[mode].append((time.perf_counter() - t0) / args.steps_per_block)
        if switched is not None:
            break
    controller.close()
    everyone = comm.gather_objects((times, inside, turn, switched, cpu), "world")
    if comm.rank == 0:
        report(args, comm.dims.world_size, everyone)
        for d in controller.decisions:    # what the controller saw, if it acted at all
            if d.get("action") == "host":    # the host measured before step 0, not a decision
                continue
            found = "; ".join(f"{x['kind']} {x['key']} {x['shift']:+.0%}"
                              for x in d.get("detections") or ())
            print(f"  step {d.get('step')}: {d.get('action')} ({found}) {d.get('reason', '')}")
    comm.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


def _q(values, q):
    return statistics.quantiles(values, n=4)[q] if len(values) > 1 else values[0]


def report(args, world, everyone) -> None:
    switched = [r[3] for r in everyone if r[3] is not None]
    if switched:
        print(f"the controller switched at step {switched[0]} on a healthy run: a false switch; "
              "the overhead measurement stops there")
    blocks = {m: [max(col) for col in zip(*(r[0][m] for r in everyone))] for m in ("on", "off")}
    pairs = min(len(blocks["on"]), len(blocks["off"]))
    if pairs == 0:
        print("no on/off pair of blocks was measured before the switch")
        return
    ratios = [blocks["on"][i] / blocks["off"][i] for i in range(pairs)]
    print(f"adaptive suite model, {world} ranks (dp{args.dp} pp{args.pp}), {pairs} on/off pairs "
          f"of {args.steps_per_block}-step blocks; time per step = a block's wall time (ranks "
          "start together, it ends with its last rank) / steps")
    for m in ("on", "off"):
        print(f"  --adapt {m:<3}  median {statistics.median(blocks[m]) * 1e3:7.2f} ms/step   "
              f"min {min(blocks[m]) * 1e3:7.2f}   train_step median "
              f"{statistics.median(everyone[0][1][m]) * 1e3:7.2f} ms (rank 0)")
    turns = [t for r in everyone for t in r[2]]
    print(f"  controller's turn after a step: median {statistics.median(turns) * 1e3:.2f} ms "
          f"(all ranks; reading the last step's gathered summaries, the monitor's records, "
          "detection, posting this step's)")
    med = statistics.median(ratios)
    print(f"  overhead, wall (median of per-pair on/off - 1): {med - 1:+.1%}  "
          f"IQR {_q(ratios, 0) - 1:+.1%} to {_q(ratios, 2) - 1:+.1%}")
    cpu = {m: [sum(col) for col in zip(*(r[4][m] for r in everyone))] for m in ("on", "off")}
    cr = [cpu["on"][i] / cpu["off"][i] for i in range(pairs)]
    print(f"  overhead, CPU seconds summed over the ranks: {statistics.median(cr) - 1:+.1%}  "
          f"IQR {_q(cr, 0) - 1:+.1%} to {_q(cr, 2) - 1:+.1%}  (on {statistics.median(cpu['on']) * 1e3:.1f}"
          f" ms, off {statistics.median(cpu['off']) * 1e3:.1f} ms a step)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.blocks % 2:
        raise SystemExit(f"--blocks {args.blocks}: use an even number (on/off pairs)")
    if args.dp * args.pp != args.nproc and "WORLD_SIZE" not in os.environ:
        raise SystemExit(f"--dp {args.dp} x --pp {args.pp} must equal --nproc {args.nproc}")
    from _local_ranks import run_ranks

    run_ranks(rank_main, parse_args, args, args.nproc, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
