"""Our pipeline runtime against torch.distributed.pipelining on the same stages and data.

    torchrun --nproc-per-node 2 benchmarks/vs_torch_pipelining.py --schedule 1f1b --microbatches 8
    torchrun --nproc-per-node 4 benchmarks/vs_torch_pipelining.py --schedule zbv --microbatches 8

Both sides run identical copies of the same stage modules (tiny preset unless --preset), on the
same micro-batches, one step alternating with the other in the same processes. Only the
pipeline step (forward, backward, communication) is timed; no optimizer. Prints the median step
times, the ratio ours/theirs (below 1.0 means commpipe is faster) and whether the losses agree.

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b", choices=sorted(THEIRS))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--vpp", type=int, default=2, help="chunks per rank for interleaved")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = resolve_model(args.preset)
    m, b, s = args.microbatches, args.micro_batch_size, args.seq_len
    program = generate(args.schedule, world, m, args.vpp if args.schedule == "interleaved" else 1)
    comm = Comm(ParallelDims(pp=world), rank)
    device = torch.device("cpu")

    ours = build_stages(spec, program, rank, seed=0)
    theirs_modules = build_stages(spec, program, rank, seed=0)
    last = program.num_stages - 1
    loss_fn = make_loss_fn(comm, None)
    runtime = PipelineRuntime(program, ours, comm, loss_fn, (b, s, spec.hidden), device)

    # torch.distributed.pipelining: one PipelineStage per stage this rank holds
    # (shapes are inferred by torch at the first step, which is a warm-up iteration here)
    stages = [tpp.PipelineStage(theirs_modules[idx], idx, program.num_stages, device)
              for idx in program.stages_of(rank)]

    def ce_mean(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    cls = getattr(tpp, THEIRS[args.schedule])
    their_schedule = cls(stages if len(stages) > 1 or args.schedule in ("interleaved", "zbh1", "zbv")
                         else stages[0], m, loss_fn=ce_mean, scale_grads=True)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (m * b, s + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s)

    def run_ours():
        loss = runtime.run_step(list(inputs.split(b)), list(labels.split(b)), positions,
                                1.0 / (m * b * s))
        return loss.item()

    def run_theirs():
        losses: list = []
        kwargs = {}
        holds_first = 0 in program.stages_of(rank)
        holds_last = last in program.stages_of(rank)
        if holds_last:
            kwargs.update(target=labels, losses=losses)
        if holds_first:
            their_schedule.step(inputs, **kwargs)
        else:
            their_schedule.step(**kwargs)
        return sum(x.item() for x in losses) / m if losses else 0.0

    times = {"ours": [], "theirs": []}
    loss_vals = {"ours": 0.0, "theirs": 0.0}
    for it in range(args.iters + 2):
        order = (("ours", run_ours), ("theirs", run_theirs))
        for name, fn in (order if it % 2 == 0 else order[::-1]):
            for mod in (ours if name == "ours" else theirs_modules).values():
                mod.zero_grad(set_to_none=True)
            comm.barrier()
            t0 = time.perf_counter()
            loss_vals[name] = fn()
            comm.barrier()
            if it >= 2:  # the first two iterations warm up (shape inference, allocator)
                times[name].append(time.perf_counter() - t0)

    # the loss lives on the rank holding the last stage; share it through the chokepoint
    both = torch.tensor([loss_vals["ours"], loss_vals["theirs"]], dtype=torch.float64)
    comm.all_reduce(both, "world")
    if rank == 0:
        med_o, med_t = statistics.median(times["ours"]), statistics.median(times["theirs"])
        agree = abs(both[0] - both[1]) <= 1e-5 * abs(both[1])
        print(f"schedule={args.schedule} pp={world} m={m} preset={args.preset} seq={s} "
              f"mbs={b} iters={args.iters}")
        print(f"  commpipe                       median {med_o * 1e3:8.2f} ms")
        print(f"  torch.distributed.pipelining   median {med_t * 1e3:8.2f} ms ({THEIRS[args.schedule]})")
        print(f"  ratio ours/theirs = {med_o / med_t:.3f}   (goal <= 1.0)")
        print(f"  loss ours={both[0].item():.6f} theirs={both[1].item():.6f} agree={bool(agree)}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
