"""What the pipeline executor itself costs per action: thread CPU of a step on a trivial stage,
less the same stage's forward and backward run by hand.

    python benchmarks/executor_overhead.py
    python benchmarks/executor_overhead.py --schedule interleaved --microbatches 16

One process (pp=1 has no messages; the point-to-point path is `Comm`'s, timed by
vs_torch_pipelining.py), a stage that is one 16 x 4 embedding, so the module work is a few
microseconds and the difference is the executor's dispatch, bookkeeping and autograd calls.
Thread CPU time, best of 7 rounds: a loaded machine slows the wall clock, not this.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.runtime.executor import PipelineRuntime
from commpipe.schedules import generate


class TinyStage(nn.Module):
    """tokens [b, s] -> 'logits' [b, s, 4]: one embedding lookup, the least a stage can do."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, x, positions=None):
        return self.emb(x)


def best_seconds(fn, rounds: int = 7, calls: int = 200) -> float:
    """Thread CPU seconds per call, the best of `rounds` rounds."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b", help="a schedule that runs on one rank")
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}",
                                rank=0, world_size=1)
        m, b, s = args.microbatches, 2, 8
        program = generate(args.schedule, 1, m, 1)
        tokens = list(torch.randint(0, 16, (m * b, s)).split(b))
        positions = torch.arange(s)
        stage = TinyStage()
        runtime = PipelineRuntime(program, {0: stage}, Comm(ParallelDims(pp=1), 0),
                                  lambda logits, labels: logits.sum(), (b, s, 4),
                                  torch.device("cpu"))

        def step():
            runtime.run_step(tokens, tokens, positions, 1.0)

        def by_hand():
            for mb in tokens:
                (stage(mb, positions).sum() * 1.0).backward()

        for _ in range(50):
            step()
        ours, modules = best_seconds(step), best_seconds(by_hand)
        actions = len(runtime.actions)
        print(f"{args.schedule}, {m} micro-batches, {actions} actions: step {ours * 1e6:.0f} us, "
              f"the stage by hand {modules * 1e6:.0f} us -> executor "
              f"{(ours - modules) / actions * 1e6:.1f} us per action (thread CPU)")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
