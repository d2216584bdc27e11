"""Switch a running job to another layout (commpipe.layout.Layout) in the same processes, losing nothing.

1. Each rank holds full tensors of what it has: its parameters and AdamW states (exp_avg,
   exp_avg_sq, step), TP shards all-gathered within the TP group (as a checkpoint save does),
   a MoE layer's routed experts ([E, ...], E/ep rows on each rank) all-gathered within the EP
   group (commpipe.train.checkpoint_shards.gather_ep). DP replicas already hold full copies,
   so a layout change often needs no transfer at all.
2. Same tp/cp/pp/dp and ep: the Comm is kept; otherwise a new Comm builds the new layout's
   process groups (every rank creates every group, in the same order).
3. `Trainer.build` makes this rank's stages under the new plan. What a rank needs and does not
   hold is sent to it point-to-point by a rank of its own node holding it, else by the lowest
   rank holding it (`commpipe.adapt.plan.nearest_holder`: a degraded link between nodes is not
   crossed where a node holds the item; `Comm.isend`/`irecv`, one tag per transfer); every
   rank then keeps its slice of the full tensors. Step counter,
   history, data source (a pure function of step and rank) and the LR schedule (a function of
   the step) carry over; RNG states are kept as they were.
Only commpipe.parallel.comm touches torch.distributed: everything here goes through Comm.
Full tensors of one rank's stages pass through its memory once; for models too large for that,
a checkpoint (`commpipe.train.checkpoint`, which reshards across layouts too) and a relaunch
is the fallback.
"""

from __future__ import annotations

import time

import torch

from commpipe.parallel.placement import placement
from commpipe.train.checkpoint import adam_and_holder, full_state_here, gather_tp, shard_tp
from commpipe.train.checkpoint_shards import gather_ep, shard_ep


def optimizer_of(trainer):
    """(the AdamW stepping this rank's parameters, predicate: does it keep p's state here).
    Without ZeRO-1 every DP replica keeps every state of its stages (checkpoints write only
    dp=0's copy); with ZeRO-1 only the owner does."""
    from commpipe.parallel.data import Zero1

    adam, holds = adam_and_holder(trainer)
    return (adam, holds) if isinstance(trainer.optimizer, Zero1) else (adam, lambda p: True)


def gather_state(trainer) -> dict[str, torch.Tensor]:
    """Full parameters and optimizer states of the whole model, on every rank (collective)."""
    merged: dict[str, torch.Tensor] = {}
    for part in trainer.comm.gather_objects(full_state_here(trainer), "world"):
        merged.update(part)
    return merged


def load_state(trainer, state: dict[str, torch.Tensor]) -> None:
    """Give every parameter of `trainer` (and its optimizer state) its slice of `state`: its TP
    slice, or of a routed expert tensor the rows of its experts under the new ep."""
    comm = trainer.comm
    adam, holds = optimizer_of(trainer)
    with torch.no_grad():
        for name, p in trainer.named_params:
            key = f"model.{name}"
            if key not in state:
                raise RuntimeError(f"switch: no gathered value for parameter {name}")
            tp_dim = placement(p).tp_dim
            p.copy_(shard_ep(shard_tp(state[key], tp_dim, comm), p, comm).to(p.device))
            if holds(p) and f"optim.{name}.step" in state:
                adam.state[p] = {
                    "step": state[f"optim.{name}.step"].clone(),
                    **{k: shard_ep(shard_tp(state[f"optim.{name}.{k}"], tp_dim, comm), p,
                                   comm).to(p.device).clone() for k in ("exp_avg", "exp_avg_sq")},
                }


def held_state(trainer) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter and optimizer state this rank holds (collective within
    each TP and each EP group: every member gathers the same items in the same order)."""
    comm = trainer.comm
    adam, _ = adam_and_holder(trainer)
    out: dict[str, torch.Tensor] = {}
    for name, p in trainer.named_params:
        tp_dim = placement(p).tp_dim
        out[f"model.{name}"] = gather_ep(gather_tp(p, tp_dim, comm), p, comm)
        st = adam.state.get(p)
        if st:   # ZeRO-1 owners are per DP rank: the same answer across a TP (an EP) group
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{name}.{key}"] = gather_ep(gather_tp(st[key], tp_dim, comm), p, comm)
            step = st["step"]
            out[f"optim.{name}.step"] = step.detach().clone() if torch.is_tensor(step) \
                else torch.tensor(float(step))
    return out


def redistribute(new, held: dict[str, torch.Tensor], held_by: list[dict],
                 ranks_per_node: int | None = None) -> tuple[dict, int]:
    """Full tensors of everything `new` (the rebuilt trainer) needs on this rank: local where
    held, else received from its nearest holder (one on this rank's node, else the lowest;
    `ranks_per_node` None: one node). held_by[r]: {item: (shape, dtype)} of rank r. Returns
    (items, bytes received). Collective over the world."""
    from commpipe.adapt.plan import nearest_holder

    comm = new.comm
    rpn = ranks_per_node or len(held_by)
    _, holds = optimizer_of(new)
    want = []
    for name, p in new.named_params:
        want.append(f"model.{name}")
        if holds(p):
            want += [f"optim.{name}.{k}" for k in ("exp_avg", "exp_avg_sq", "step")]
    missing = sorted(k for k in want if k not in held and any(k in h for h in held_by))
    lacking = [k for k in want if k.startswith("model.") and not any(k in h for h in held_by)]
    if lacking:
        raise RuntimeError(f"switch: no rank holds {lacking[:3]}")
    needs = comm.gather_objects(missing, "world")
    handles, got, nbytes, tag = [], {}, 0, 0
    for dst, items in enumerate(needs):
        for item in items:
            src = nearest_holder([r for r, h in enumerate(held_by) if item in h], dst, rpn)
            shape, dtype = held_by[src][item]
            if comm.rank == src:
                handles.append(comm.isend(held[item].contiguous(), dst, dim="world", tag=tag))
            elif comm.rank == dst:
                buf = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                                  device=comm.device)
                got[item] = buf
                nbytes += buf.numel() * buf.element_size()
                handles.append(comm.irecv(buf, src, dim="world", tag=tag))
            tag += 1
    for h in handles:
        h.wait()
    return {k: (held[k] if k in held else got[k]) for k in want if k in held or k in got}, nbytes


def switch(trainer, plan, phases: dict | None = None, ranks_per_node: int | None = None):
    """A Trainer running `plan` with `trainer`'s full state (collective); (trainer, seconds).
    `ranks_per_node` places the ranks on nodes for choosing each item's sender.
    `phases`, when given, receives this rank's seconds of the switch's parts: `state_s` (full
    tensors of what it holds, and receiving what it lacks) and `rebuild_s` (process groups,
    when the layout changes, and the new stages)."""
    from commpipe.parallel.comm import Comm
    from commpipe.train.loop import Trainer

    t0 = time.perf_counter()
    rng = torch.get_rng_state()
    old = trainer.comm
    if trainer.monitor is not None:
        trainer.monitor.detach()    # moving the state is not training traffic
    held = held_state(trainer)
    held_by = old.gather_objects({k: (tuple(v.shape), str(v.dtype)) for k, v in held.items()},
                                 "world")
    if trainer.monitor is not None:
        trainer.monitor.close()     # collective: writes what it holds; the new one appends
    cfg = plan.apply(trainer.cfg)
    t_rebuild = time.perf_counter()
    same = cfg.dims == old.dims and cfg.ep == trainer.cfg.ep    # ep: groups carved from dp
    comm = old if same else Comm(cfg.dims, old.rank, device=old.device,
                                 timeout_s=cfg.timeout_s, strict_order=old.strict_order)
    new = Trainer.build(cfg, comm, source=trainer.source)
    t_state = time.perf_counter()
    observers, comm.observers = comm.observers, []   # the transfer is not training traffic
    state, _ = redistribute(new, held, held_by, ranks_per_node)
    comm.observers = observers
    load_state(new, state)
    new.step, new.history = trainer.step, trainer.history
    new.capture_grads = trainer.capture_grads
    torch.set_rng_state(rng)
    comm.barrier()
    t1 = time.perf_counter()
    if phases is not None:
        phases.update(state_s=(t_rebuild - t0) + (t1 - t_state), rebuild_s=t_state - t_rebuild)
    return new, t1 - t0
