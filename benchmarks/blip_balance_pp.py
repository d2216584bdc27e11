"""blip-tiny on 2 local ranks (pp=2, 1F1B, 8 micro-batches): `--stage-layers auto` against the
even layer split, with real processes, the real trainer and runtime and its per-boundary messages.

    python benchmarks/blip_balance_pp.py                       # 20 steps each, micro-batch 8
    python benchmarks/blip_balance_pp.py --steps 30 --micro-batch-size 4

Two gloo processes (one thread each) build three trainers, the even split [4, 4], the
FLOPs-balanced split of `--stage-layers auto` and the profile-balanced split of
`--stage-layers auto:measured`, and alternate their optimizer steps (the order reverses every
step), so that load from other work on a shared machine hits both alike at
the scale of one step; separate launches measured minutes apart differed by 2-4x here. Prints:
- the median step time of each split (the slower rank's time per step, steps after the first
  two), the ratio of each balanced split's median to the even one's (goal <= 0.9), and the
  median of the per-step paired ratios;
- per stage, the balancer's predicted stage time against the measured one: measured is the
  median forward plus the median backward of one micro-batch over every step's timeline
  (steps after the first two), written as `commpipe train --trace` writes its timeline
  (OUT/<split>/trace/actions_rank<r>.jsonl); predicted is the
  stage's share of FLOPs times one rate (ms per FLOP) fitted on the even split's measured total,
  so the balanced splits' stage times are predictions;
- the simulator's pipeline time for both splits from those predicted stage times and the
  boundary descriptions' message sizes (commpipe.sim.stages), beside the measured step;
- the load average before and after, and each rank's CPU seconds over the steps' wall
  seconds: a pipeline's balance pays off only when each rank has a core to itself; where the
  two ranks together got less than a core they take turns, and a step costs its total work
  whatever the split.
Numbers are noisy on a shared 2-core machine; no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commpipe.models.blip_spec import resolve_blip, stage_io
from commpipe.parallel.balance import blip_layer_costs, stage_costs
from commpipe.schedules import generate
from commpipe.sim import simulate
from commpipe.sim.stages import stage_cost_table

SPLITS = ("even", "auto", "measured")   # even [4, 4]; auto by FLOPs; auto:measured


def worker(rank: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.loop import Trainer

    trainers = {}
    for name in SPLITS:
        cfg = TrainConfig(model=args.model, dims=ParallelDims(pp=2), schedule="1f1b",
                          microbatches=8, micro_batch_size=args.micro_batch_size,
                          steps=args.steps, device="cpu",
                          stage_layers={"even": None, "auto": "auto",
                                        "measured": "auto:measured"}[name]).resolve(2)
        trainers[name] = Trainer.build(cfg, Comm(cfg.dims, rank))
        trainers[name].runtime.events = []
    times = {name: [] for name in SPLITS}
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step in range(args.steps):
        for name in (SPLITS if step % 2 == 0 else SPLITS[::-1]):   # order alternates
            t = trainers[name]
            dist.barrier()
            times[name].append(t.train_step()["step_time_s"])
            if step == 0 and name == "measured" and rank == 0:
                print(f"auto:measured layer costs (s): {t.cfg.stage_balance['layer_costs']}")
    result = {"times": times, "cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0}
    for name, t in trainers.items():
        d = Path(out) / name / "trace"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"actions_rank{rank}.jsonl", "w") as f:
            for e in t.runtime.events:
                f.write(json.dumps(e.to_dict()) + "\n")
        result[name] = t.cfg.stage_layers or [4, 4]
    (Path(out) / f"times_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measured_stage_ms(trace: Path) -> list[float]:
    """Median forward + backward of one micro-batch per stage (rank r holds stage r)."""
    per_stage = []
    for r in range(2):
        rows = [json.loads(x) for x in (trace / f"actions_rank{r}.jsonl").read_text().splitlines()]
        comp = [e for e in rows if e["stream"] == "compute" and e["step"] >= 2]
        f = [e["end_ms"] - e["start_ms"] for e in comp if "F" in e["name"]]
        b = [e["end_ms"] - e["start_ms"] for e in comp if "B" in e["name"]]
        per_stage.append(statistics.median(f) + statistics.median(b))
    return per_stage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="blip-tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--out", default="/tmp/blip_balance_pp")
    args = p.parse_args()
    from commpipe.cluster.ports import free_port

    port = free_port()
    load_before = os.getloadavg()
    mp.start_processes(worker, args=(port, args, args.out), nprocs=2, start_method="spawn")
    load_after = os.getloadavg()
    ranks = [json.loads((Path(args.out) / f"times_rank{r}.json").read_text()) for r in range(2)]
    spec = resolve_blip(args.model)
    splits = {name: ranks[0][name] for name in SPLITS}
    step = {name: [max(a, b) for a, b in zip(ranks[0]["times"][name], ranks[1]["times"][name])][2:]
            for name in SPLITS}
    med = {name: statistics.median(step[name]) for name in SPLITS}
    paired = {name: statistics.median(a / e for a, e in zip(step[name], step["even"]))
              for name in SPLITS}
    print(f"{args.model}: pp=2 1f1b, 8 micro-batches of {args.micro_batch_size}, {args.steps} "
          f"alternating steps each; splits {splits}")
    for name in SPLITS[1:]:
        print(f"median step: even {med['even'] * 1e3:.1f} ms, {name} {med[name] * 1e3:.1f} ms; "
              f"ratio {name}/even {med[name] / med['even']:.3f} (goal <= 0.9); median paired "
              f"per-step ratio {paired[name]:.3f}")
    print(f"load average (1, 5, 15 min) {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
          f"before, {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after, on "
          f"{os.cpu_count()} cores; CPU seconds used / wall seconds of the steps, per rank: "
          + ", ".join(f"{r['cpu_s']:.0f} / {r['wall_s']:.0f} s" for r in ranks))
    flops = blip_layer_costs(spec, "flops")
    measured = {name: measured_stage_ms(Path(args.out) / name / "trace") for name in SPLITS}
    rate = sum(measured["even"]) / sum(flops)
    program = generate("1f1b", 2, 8)
    for name in SPLITS:
        predicted = [c * rate for c in stage_costs(flops, splits[name])]
        table = stage_cost_table(stage_io(spec, splits[name], args.micro_batch_size), flops, rate / 3)
        print(f"{name} {splits[name]}: stage fwd+bwd per micro-batch predicted "
              f"{[round(x, 1) for x in predicted]} ms, measured "
              f"{[round(x, 1) for x in measured[name]]} ms; simulated pipeline "
              f"{simulate(program, table).makespan:.0f} ms vs measured step {med[name] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
