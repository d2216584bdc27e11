"""Data parallelism: bucketed gradient all-reduce, global-norm clipping, optional ZeRO-1.

The loss of every micro-batch is already divided by the number of tokens in the *global*
batch, so gradients are summed (not averaged) across data-parallel and context-parallel ranks:
the sum over DP ranks, CP chunks and micro-batches is then exactly the gradient of the global
mean loss that one device computes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from commpipe.parallel.comm import Comm


class GradReducer:
    """Sum gradients over the dp_cp group in flat buckets of about `bucket_mb` MB, issued
    asynchronously so buckets travel while later ones are packed."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, bucket_mb: float = 25.0):
        self.comm = comm
        self.buckets: list[list[nn.Parameter]] = []
        limit = bucket_mb * 1e6
        cur, size = [], 0
        for p in reversed(params):  # reverse: last layers' grads are ready first in backward
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(cur)
                cur, size = [], 0
        if cur:
            self.buckets.append(cur)

    def reduce(self) -> None:
        if self.comm.size("dp_cp") == 1:
            return
        pending = []
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            pending.append((bucket, flat, self.comm.all_reduce(flat, "dp_cp", async_op=True)))
        for bucket, flat, handle in pending:
            handle.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).clone()
                offset += n


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, comm: Comm) -> float:
    """Clip by the norm of the *whole model's* gradient: squares summed over this rank's
    parameters (TP-replicated ones counted on tp rank 0 only), then over the TP and PP groups."""
    # on the parameters' device: NCCL reduces only device tensors, and one sync per step
    device = next((p.grad.device for p in params if p.grad is not None), comm.device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    tp_rank = comm.local_rank("tp")
    for p in params:
        if p.grad is None or (getattr(p, "_tp_dim", None) is None and tp_rank != 0):
            continue
        sq += p.grad.detach().double().pow(2).sum()
    for dim in ("tp", "pp"):
        comm.all_reduce(sq, dim)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


class Zero1:
    """ZeRO stage 1 (Rajbhandari et al., 2020): each DP rank keeps optimizer state for, and
    updates, only the parameters it owns; owners then broadcast the updated values. Ownership
    is a greedy balance of parameter sizes, identical on every rank."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, make_optimizer):
        self.comm = comm
        n = comm.size("dp")
        loads = [0] * n
        self.owner: list[int] = []
        for p in params:
            r = loads.index(min(loads))
            self.owner.append(r)
            loads[r] += p.numel()
        self.params = params
        mine = [p for p, r in zip(params, self.owner) if r == comm.local_rank("dp")]
        self.optimizer = make_optimizer(mine or [nn.Parameter(torch.zeros(1))])

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.optimizer.step()
        for p, r in zip(self.params, self.owner):
            self.comm.broadcast(p.data, "dp", src_local=r)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)
