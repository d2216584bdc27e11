"""Multi-rank tests: `spawn` runs a function on real gloo processes; `run_jobs` trains
configurations there and reassembles full tensors.

All layouts of one world size run in the same set of processes (one spawn per world size),
each with its own process groups, to keep the suite fast on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from commpipe.cluster.ports import free_port  # the rendezvous port of every launch here
from commpipe.parallel.placement import placement


class RankFailed(RuntimeError):
    """A rank of a `spawn` raised, died or outlived the launch's time limit."""


# Ranks start from a fork server that imported these once (multiprocessing's "forkserver"),
# not as fresh interpreters: a spawned rank spent ~2 CPU-seconds importing torch and commpipe,
# and the test files that launch ranks took 573 s with spawned ranks against 353 s forked from
# the server (2 cores). The server only imports: no CUDA, no process group, no tensor work,
# so forking it is safe for torch. It starts at the first launch and keeps its environment;
# each rank takes the launching process's (`_rank_main`).
PRELOAD = ["torch", "torch.distributed", "commpipe.train.loop", "commpipe.parallel.comm",
           "tests.dist_harness"]


def _rank_main(rank: int, world: int, port: int, backend: str | None, outdir: str, worker,
               args: tuple, environ: dict) -> None:
    os.environ.clear()             # the launching process's environment, not the fork server's
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)       # ranks share the host's cores; a second thread only spins
    if backend is None:            # the worker starts the group itself, as under torchrun
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
    except BaseException:
        # written before the group goes down, so before the peers' own errors (a closed
        # connection) that this one causes: the parent reports the earliest as the cause
        error = {"t": time.monotonic(), "traceback": traceback.format_exc()}
        (Path(outdir) / f"error{rank}.json").write_text(json.dumps(error))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, Path(outdir) / f"rank{rank}.pt")


def _failure(name: str, world: int, outdir: str, launch_error: Exception) -> RankFailed:
    """The first rank that raised, with its traceback; the ranks that failed after it."""
    errors = {int(f.stem[5:]): json.loads(f.read_text()) for f in Path(outdir).glob("error*.json")}
    if not errors:             # killed by a signal or exited without a Python exception
        return RankFailed(f"{name}: {launch_error}")
    order = sorted(errors, key=lambda r: errors[r]["t"])
    after = f" (then ranks {order[1:]} failed too)" if len(order) > 1 else ""
    return RankFailed(f"{name}: rank {order[0]} of {world} raised first{after}:\n"
                      f"{errors[order[0]]['traceback']}")


def spawn(worker, world: int, *args, timeout_s: float = 600.0, backend: str | None = "gloo") -> list:
    """Run `worker(rank, world, *args)` on `world` fresh processes joined in one process group
    and return each rank's return value (anything torch.save takes), in rank order.

    `worker` is a module-level function (the processes start from a fork server, so it is
    pickled by name).
    The harness picks the port, sets the environment, starts the group on `backend` (None: the
    worker starts it, e.g. through commpipe's init_distributed, from torchrun's variables) and
    destroys it. A rank that raises fails the launch at once with RankFailed carrying its
    traceback (its peers, possibly blocked on it in a collective, are terminated); so does a
    launch still running after `timeout_s`."""
    name = getattr(worker, "__qualname__", repr(worker))
    with tempfile.TemporaryDirectory() as tmp:
        mp.set_forkserver_preload(PRELOAD)
        ctx = mp.start_processes(_rank_main, args=(world, free_port(), backend, tmp, worker, args,
                                                   dict(os.environ)),
                                 nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(deadline - time.monotonic(), 0.0)):
                if time.monotonic() >= deadline:
                    running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                        p.join()
                    raise RankFailed(f"{name} on {world} ranks: ranks {running} still running "
                                     f"after timeout_s={timeout_s:g} s (blocked on a peer?)")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise _failure(name, world, tmp, e) from None
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def train_jobs(rank: int, world: int, jobs: list) -> dict:
    """The rank's side of run_jobs: {key: what `assemble` takes}."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    results = {}
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
            "params": {n: (p.detach().clone(), placement(p).tp_dim)
                       for n, p in trainer.named_params},
            "grads": trainer.last_grads,
            "activation_mb": [r.get("activation_mb") for r in records],
            "log": getattr(trainer, "test_log", None),    # what a planted probe recorded
        }
    return results


def first_losses(rank: int, world: int, jobs: list) -> dict:
    """`spawn` worker: for each (key, TrainConfig), the first step's loss of `train` (with the
    config's --init-from, say), as this rank reports it."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import train

    losses = {}
    for key, cfg in jobs:
        cfg.resolve(world)
        losses[key] = train(cfg, Comm(cfg.dims, rank), log=None)[0]["loss"]
    return losses


def run_jobs(world: int, jobs: list) -> dict:
    """jobs: [(key, TrainConfig[, plant])] -> {key: {"losses", "grad_norms", "params", "grads",
    "replicas_equal"}}; `plant(trainer)`, a module-level function, changes the built trainer
    (a deliberate bug, to show that a comparison fails)."""
    per_rank = spawn(train_jobs, world, jobs)
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
