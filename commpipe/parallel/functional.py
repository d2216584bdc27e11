"""Autograd functions around the chokepoint's collectives (forward op, and its adjoint backward).

Naming follows Megatron-LM (Shoeybi et al., 2019, sec. 3): `f` copies into the tensor-parallel
region (identity forward, all-reduce backward) and `g` reduces out of it (all-reduce forward,
identity backward). For context parallelism, K/V are all-gathered along the sequence forward
and their gradients reduce-scattered backward. Sequence parallelism (Korthikanti et al. 2022,
sec. 4.2.2) replaces `f` by an all-gather along the sequence (`g-bar`'s adjoint: reduce-scatter
backward) and `g` by a reduce-scatter along the sequence (all-gather backward).

Asynchronous TP (Megatron's async grad all-reduce / reduce-scatter): an entry function (`f`, or
the SP all-gather) may carry a `TPRegion`. The column-parallel Linears behind it then stash their
weight-gradient GEMMs in the region instead of running them; the entry's backward issues the
input-gradient collective as a handle, runs the stashed GEMMs while it travels, then waits.
Without a region the same GEMMs run first and the collective after: identical results.
"""

from __future__ import annotations

import torch

from commpipe.parallel.comm import Comm
from commpipe.runtime.weight_grad import WeightGradStore


class TPRegion:
    """The weight-gradient GEMMs of the column-parallel Linears fed by one entry function."""

    def __init__(self):
        self.pending: list = []

    def flush(self) -> None:
        items, self.pending = self.pending, []
        WeightGradStore.flush(items)


def _overlapped(handle, region: TPRegion | None):
    """Run the region's weight-gradient GEMMs while `handle`'s collective is in flight."""
    if region is not None:
        region.flush()
    return handle.wait()


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's `f`: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str, region: TPRegion | None = None):
        ctx.comm, ctx.dim, ctx.region = comm, dim, region
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        _overlapped(ctx.comm.all_reduce(grad, ctx.dim, async_op=True), ctx.region)
        return grad, None, None, None


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
    def forward(ctx, x, comm: Comm, dim: str, region: TPRegion | None = None):
        ctx.comm, ctx.dim, ctx.region = comm, dim, region
        xt = x.transpose(0, 1).contiguous()                 # [s_local, b, ...]
        return comm.all_gather(xt, dim).transpose(0, 1)     # [b, n * s_local, ...]

    @staticmethod
    def backward(ctx, grad):
        gt = grad.transpose(0, 1).contiguous()
        out = _overlapped(ctx.comm.reduce_scatter(gt, ctx.dim, async_op=True), ctx.region)
        return out.transpose(0, 1), None, None, None


class ScatterSeq(torch.autograd.Function):
    """Sequence parallelism's `g`: reduce-scatter along dim 1 forward (sum of the TP ranks'
    partial outputs, each rank keeping its sequence shard); all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str):
        ctx.comm, ctx.dim = comm, dim
        xt = x.transpose(0, 1).contiguous()                 # [s, b, ...]
        return comm.reduce_scatter(xt, dim).transpose(0, 1)  # [b, s / n, ...]

    @staticmethod
    def backward(ctx, grad):
        gt = grad.transpose(0, 1).contiguous()
        return ctx.comm.all_gather(gt, ctx.dim).transpose(0, 1), None, None


def copy_to(x, comm: Comm, dim: str, region: TPRegion | None = None):
    return x if comm.size(dim) == 1 else CopyToParallelRegion.apply(x, comm, dim, region)


def reduce_from(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else ReduceFromParallelRegion.apply(x, comm, dim)


def gather_seq(x, comm: Comm, dim: str, region: TPRegion | None = None):
    return x if comm.size(dim) == 1 else GatherSeq.apply(x, comm, dim, region)


def scatter_seq(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else ScatterSeq.apply(x, comm, dim)
