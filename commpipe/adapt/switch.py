"""Switch a running job to another `Plan` in the same processes, losing nothing.

1. Every parameter and its AdamW state (exp_avg, exp_avg_sq, step) is gathered as a full tensor
   (TP shards all-gathered through Comm, as a checkpoint save does) by its holder and shared
   with every rank (`Comm.gather_objects`): the training state, in memory, in logical names.
2. Same tp/cp/pp/dp: the Comm is kept; otherwise a new Comm builds the new layout's process
   groups (every rank creates every group, in the same order).
3. `Trainer.build` makes this rank's stages under the new plan; each takes its slice of the
   full tensors. Step counter, history, data source (a pure function of step and rank) and
   the LR schedule (a function of the step) carry over; RNG states are kept as they were.
Only commpipe.parallel.comm touches torch.distributed: everything here goes through Comm.
The whole state passes through every rank's memory once: fine for the models one trains on
an emulated cluster; a large model would stream tensor by tensor or fall back to a checkpoint
(`commpipe.train.checkpoint` reshards across layouts too).
"""

from __future__ import annotations

import time

import torch

from commpipe.train.checkpoint import adam_and_holder, gather_tp, shard_tp


def gather_state(trainer) -> dict[str, torch.Tensor]:
    """Full parameters and optimizer states of the whole model, on every rank (collective)."""
    comm = trainer.comm
    c = comm.coords
    local: dict[str, torch.Tensor] = {}
    if c["dp"] == 0 and c["cp"] == 0:
        for name, p in trainer.named_params:
            full = gather_tp(p, getattr(p, "_tp_dim", None), comm)
            if c["tp"] == 0:
                local[f"model.{name}"] = full.cpu()
    adam, holds = adam_and_holder(trainer)
    for name, p in trainer.named_params:
        st = adam.state.get(p) if holds(p) and c["cp"] == 0 else None
        if not st:
            continue   # the same answer on every rank of this TP group: gathers stay matched
        tp_dim = getattr(p, "_tp_dim", None)
        for key in ("exp_avg", "exp_avg_sq"):
            full = gather_tp(st[key], tp_dim, comm)
            if c["tp"] == 0:
                local[f"optim.{name}.{key}"] = full.cpu()
        if c["tp"] == 0:
            step = st["step"]
            local[f"optim.{name}.step"] = step.detach().clone().cpu() if torch.is_tensor(step) \
                else torch.tensor(float(step))
    merged: dict[str, torch.Tensor] = {}
    for part in comm.gather_objects(local, "world"):
        merged.update(part)
    return merged


def load_state(trainer, state: dict[str, torch.Tensor]) -> None:
    """Give every parameter of `trainer` (and its optimizer state) its slice of `state`."""
    comm = trainer.comm
    adam, holds = adam_and_holder(trainer)
    with torch.no_grad():
        for name, p in trainer.named_params:
            key = f"model.{name}"
            if key not in state:
                raise RuntimeError(f"switch: no gathered value for parameter {name}")
            tp_dim = getattr(p, "_tp_dim", None)
            p.copy_(shard_tp(state[key], tp_dim, comm).to(p.device))
            if holds(p) and f"optim.{name}.step" in state:
                adam.state[p] = {
                    "step": state[f"optim.{name}.step"].clone(),
                    "exp_avg": shard_tp(state[f"optim.{name}.exp_avg"], tp_dim,
                                        comm).to(p.device).clone(),
                    "exp_avg_sq": shard_tp(state[f"optim.{name}.exp_avg_sq"], tp_dim,
                                           comm).to(p.device).clone(),
                }


def switch(trainer, plan):
    """A Trainer running `plan` with `trainer`'s full state (collective); (trainer, seconds)."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    t0 = time.perf_counter()
    rng = torch.get_rng_state()
    old = trainer.comm
    if trainer.monitor is not None:
        trainer.monitor.detach()    # the state's transfer is not training traffic
    state = gather_state(trainer)
    if trainer.monitor is not None:
        trainer.monitor.close()     # collective: writes what it holds; the new one appends
    cfg = plan.apply(trainer.cfg)
    same = cfg.dims == old.dims
    comm = old if same else Comm(cfg.dims, old.rank, device=old.device,
                                 timeout_s=cfg.timeout_s, strict_order=old.strict_order)
    new = Trainer.build(cfg, comm, source=trainer.source)
    load_state(new, state)
    new.step, new.history = trainer.step, trainer.history
    new.capture_grads = trainer.capture_grads
    torch.set_rng_state(rng)
    comm.barrier()
    return new, time.perf_counter() - t0
