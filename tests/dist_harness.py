"""Run training configurations on real gloo processes and reassemble full tensors.

All layouts of one world size run in the same set of processes (one spawn per world size),
each with its own process groups, to keep the suite fast on a 2-core machine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commpipe.cluster.ports import free_port  # the rendezvous port of every launch here


def _worker(rank: int, world: int, port: int, jobs: list, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    results = {}
    try:
        for key, cfg, *plant in jobs:
            cfg.resolve(world)
            trainer = Trainer.build(cfg, Comm(cfg.dims, rank))
            trainer.capture_grads = True
            # tests of the tests: a deliberate bug, e.g. test_equivalence.py's PLANTED
            for bug in plant:
                bug(trainer)
            records = [trainer.train_step() for _ in range(cfg.steps)]
            results[key] = {
                "coords": trainer.comm.coords,
                "losses": [r["loss"] for r in records],
                "grad_norms": [r["grad_norm"] for r in records],
                "params": {n: (p.detach().clone(), getattr(p, "_tp_dim", None))
                           for n, p in trainer.named_params},
                "grads": trainer.last_grads,
                "activation_mb": [r.get("activation_mb") for r in records],
                "log": getattr(trainer, "test_log", None),    # what a planted probe recorded
            }
        torch.save(results, Path(outdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_jobs(world: int, jobs: list) -> dict:
    """jobs: [(key, TrainConfig[, plant])] -> {key: {"losses", "grad_norms", "params", "grads",
    "replicas_equal"}}; `plant(trainer)`, a module-level function, changes the built trainer
    (a deliberate bug, to show that a comparison fails)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, free_port(), jobs, tmp), nprocs=world,
                           start_method="spawn")
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {key: assemble([pr[key] for pr in per_rank]) for key, *_ in jobs}


def assemble(rank_results: list) -> dict:
    """Full parameters and gradients from TP shards on every pipeline stage; also checks that
    DP and CP replicas hold identical values."""
    params: dict = {}
    grads: dict = {}
    replicas_equal = True
    by_name: dict = {}
    for res in rank_results:
        c = res["coords"]
        for name, (tensor, tp_dim) in res["params"].items():
            by_name.setdefault(name, {}).setdefault((c["dp"], c["cp"]), {})[c["tp"]] = (
                tensor, res["grads"][name], tp_dim)
    for name, replicas in by_name.items():
        full = {}
        for rep, shards in replicas.items():
            tp_dim = shards[0][2]
            order = [shards[t] for t in sorted(shards)]
            if tp_dim is None:
                full[rep] = (order[0][0], order[0][1])
            else:
                full[rep] = (torch.cat([s[0] for s in order], tp_dim),
                             torch.cat([s[1] for s in order], tp_dim))
        first = full[min(full)]
        # bit-equal by construction: every DP/CP replica takes its gradients from the same
        # all-reduce (or its parameters from ZeRO-1's broadcast) and runs the same update
        for value in full.values():
            replicas_equal &= torch.equal(value[0], first[0])
        params[name], grads[name] = first
    loss_holder = next(r for r in rank_results if r["losses"])
    return {"losses": loss_holder["losses"], "grad_norms": loss_holder["grad_norms"],
            "params": params, "grads": grads,
            "replicas_equal": replicas_equal, "activation_mb": loss_holder.get("activation_mb"),
            "logs": [r.get("log") for r in rank_results]}
