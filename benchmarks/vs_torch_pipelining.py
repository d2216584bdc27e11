"""Our pipeline runtime against torch.distributed.pipelining on the same stages and data.

    torchrun --nproc-per-node 2 benchmarks/vs_torch_pipelining.py
    torchrun --nproc-per-node 2 benchmarks/vs_torch_pipelining.py --schedule 1f1b --pairs 60

Both sides run identical copies of the same stage modules (tiny preset unless --preset), on the
same micro-batches, in the same processes. Only the pipeline step (forward, backward,
communication) is timed; no optimizer. Steps are taken in pairs, one of each runtime, the pair's
order alternating (commpipe first, then torch first, ...), so a slow spell of a shared machine
lands on both sides of a pair. Per schedule it prints the median step times and the median of
the per-pair ratios commpipe/torch with its interquartile range and range (below 1.0 means
commpipe is faster), the same median of the steps' CPU seconds summed over the ranks (what a
step costs, however loaded the machine), and whether the losses agree.

Schedules compared (ours -> theirs): 1f1b -> Schedule1F1B, gpipe -> ScheduleGPipe,
interleaved -> ScheduleInterleaved1F1B, zbh1 -> ScheduleInterleavedZeroBubble (given one stage
per rank, the zero-bubble H1 case), zbv -> ScheduleZBVZeroBubble.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import pipelining as tpp

from commpipe.models.spec import resolve_model
from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.pipeline import build_stages
from commpipe.parallel.tensor import make_loss_fn
from commpipe.runtime.executor import PipelineRuntime
from commpipe.schedules import generate

THEIRS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
          "interleaved": "ScheduleInterleaved1F1B", "zbh1": "ScheduleInterleavedZeroBubble",
          "zbv": "ScheduleZBVZeroBubble"}
WARMUP_PAIRS = 3   # shape inference (torch), allocator, first-touch


def compare(schedule: str, args, comm: Comm, rank: int, world: int) -> dict:
    """Step times of both runtimes, `args.pairs` pairs after the warm-up, and their losses."""
    spec = resolve_model(args.preset)
    m, b, s = args.microbatches, args.micro_batch_size, args.seq_len
    program = generate(schedule, world, m, args.vpp if schedule == "interleaved" else 1)
    device = torch.device("cpu")

    ours = build_stages(spec, program, rank, seed=0)
    theirs_modules = build_stages(spec, program, rank, seed=0)
    last = program.num_stages - 1
    loss_fn = make_loss_fn(comm, None)
    runtime = PipelineRuntime(program, ours, comm, loss_fn, (b, s, spec.hidden), device)

    # torch.distributed.pipelining: one PipelineStage per stage this rank holds
    # (shapes are inferred by torch at the first step, which is a warm-up step here)
    stages = [tpp.PipelineStage(theirs_modules[idx], idx, program.num_stages, device)
              for idx in program.stages_of(rank)]

    def ce_mean(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    cls = getattr(tpp, THEIRS[schedule])
    their_schedule = cls(stages if len(stages) > 1 or schedule in ("interleaved", "zbh1", "zbv")
                         else stages[0], m, loss_fn=ce_mean, scale_grads=True)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (m * b, s + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s)
    holds_first, holds_last = 0 in program.stages_of(rank), last in program.stages_of(rank)

    def run_ours():
        loss = runtime.run_step(list(inputs.split(b)), list(labels.split(b)), positions,
                                1.0 / (m * b * s))
        return loss.item()

    def run_theirs():
        losses: list = []
        kwargs = {"target": labels, "losses": losses} if holds_last else {}
        if holds_first:
            their_schedule.step(inputs, **kwargs)
        else:
            their_schedule.step(**kwargs)
        return sum(x.item() for x in losses) / m if losses else 0.0

    times = {"ours": [], "theirs": []}
    cpu = {"ours": [], "theirs": []}     # this process's CPU seconds (all its threads) per step
    loss_vals = {"ours": 0.0, "theirs": 0.0}
    side = {"ours": (run_ours, ours), "theirs": (run_theirs, theirs_modules)}
    for it in range(args.pairs + WARMUP_PAIRS):
        for name in (("ours", "theirs") if it % 2 == 0 else ("theirs", "ours")):
            fn, modules = side[name]
            for mod in modules.values():
                mod.zero_grad(set_to_none=True)
            comm.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss_vals[name] = fn()
            c1 = time.process_time()
            comm.barrier()
            if it >= WARMUP_PAIRS:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)

    # the loss lives on the rank holding the last stage; share it through the chokepoint
    both = torch.tensor([loss_vals["ours"], loss_vals["theirs"]], dtype=torch.float64)
    comm.all_reduce(both, "world")
    # CPU seconds of each step summed over the ranks: what the step cost, whatever else the
    # machine ran meanwhile (wall times on a shared host also measure the other load)
    cpu_all = torch.tensor([cpu["ours"], cpu["theirs"]], dtype=torch.float64)
    comm.all_reduce(cpu_all, "world")
    return {"times": times, "cpu": {"ours": cpu_all[0].tolist(), "theirs": cpu_all[1].tolist()},
            "loss": (both[0].item(), both[1].item())}


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b,interleaved,zbv",
                    help=f"comma-separated, from {', '.join(sorted(THEIRS))}")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--vpp", type=int, default=2, help="chunks per rank for interleaved")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=40,
                    help="timed step pairs per schedule (one step of each runtime)")
    args = ap.parse_args()
    schedules = args.schedule.split(",")
    unknown = [x for x in schedules if x not in THEIRS]
    if unknown:
        ap.error(f"unknown schedule {unknown[0]!r}; use one of {', '.join(sorted(THEIRS))}")
    if args.pairs < 4:
        ap.error("--pairs must be at least 4 for quartiles")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(ParallelDims(pp=world), rank)
    results = {x: compare(x, args, comm, rank, world) for x in schedules}
    if rank == 0:
        print(f"pp={world} m={args.microbatches} preset={args.preset} seq={args.seq_len} "
              f"mbs={args.micro_batch_size} pairs={args.pairs} (+{WARMUP_PAIRS} warm-up)")
        print(f"{'schedule':<12} {'commpipe ms':>11} {'torch ms':>9} {'ratio':>6} "
              f"{'IQR':>13} {'range':>13} {'cpu ratio':>9}  losses agree")
        for x, r in results.items():
            ours, theirs = r["times"]["ours"], r["times"]["theirs"]
            ratios = [o / t for o, t in zip(ours, theirs)]
            q1, med, q3 = quartiles(ratios)
            cpu_ratio = statistics.median(o / t for o, t in zip(r["cpu"]["ours"], r["cpu"]["theirs"]))
            lo, hi = r["loss"]
            agree = abs(lo - hi) <= 1e-5 * abs(hi)
            print(f"{x:<12} {statistics.median(ours) * 1e3:>11.2f} "
                  f"{statistics.median(theirs) * 1e3:>9.2f} {med:>6.3f} "
                  f"{f'{q1:.3f}-{q3:.3f}':>13} {f'{min(ratios):.3f}-{max(ratios):.3f}':>13} "
                  f"{cpu_ratio:>9.3f}  {agree} ({lo:.6f} / {hi:.6f})")
        print("ratio: median over pairs of commpipe/torch step time (below 1.0: commpipe faster); "
              "cpu ratio: the same of the CPU seconds a step took, summed over the ranks")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
