"""Autograd functions around the chokepoint's collectives (forward op, and its adjoint backward).

Naming follows Megatron-LM (Shoeybi et al., 2019, sec. 3): `f` copies into the tensor-parallel
region (identity forward, all-reduce backward) and `g` reduces out of it (all-reduce forward,
identity backward). For context parallelism, K/V are all-gathered along the sequence forward
and their gradients reduce-scattered backward.
"""

from __future__ import annotations

import torch

from commpipe.parallel.comm import Comm


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str):
        ctx.comm, ctx.dim = comm, dim
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.dim)
        return grad, None, None


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's `g`: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str):
        x = x.contiguous().clone()
        comm.all_reduce(x, dim)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherSeq(torch.autograd.Function):
    """All-gather along dim 1 (sequence) forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str):
        ctx.comm, ctx.dim = comm, dim
        xt = x.transpose(0, 1).contiguous()                 # [s_local, b, ...]
        return comm.all_gather(xt, dim).transpose(0, 1)     # [b, n * s_local, ...]

    @staticmethod
    def backward(ctx, grad):
        gt = grad.transpose(0, 1).contiguous()
        return ctx.comm.reduce_scatter(gt, ctx.dim).transpose(0, 1), None, None


def copy_to(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else CopyToParallelRegion.apply(x, comm, dim)


def reduce_from(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else ReduceFromParallelRegion.apply(x, comm, dim)


def gather_seq(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else GatherSeq.apply(x, comm, dim)
