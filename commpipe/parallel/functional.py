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

Forward all-gather/GEMM overlap (the forward half of torchtitan's async TP, one step of it): with
sequence parallelism, `GatherSeqColumns` fuses the all-gather with the column-parallel GEMMs it
feeds. The gather is issued as a handle, the GEMMs over this rank's own sequence rows run while
the other shards travel, then the GEMMs over the other rows; outputs are assembled in sequence
order. Its backward is `GatherSeq`'s with the Linears' (`_Linear`'s) folded in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commpipe.parallel.comm import Comm
from commpipe.parallel.weight_grad import WeightGradStore, _mark_deferred, _stash_of


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


class _BatchFirst:
    """A sequence collective in flight (`all_gather_seq` or `reduce_scatter_seq` with
    async_op): `wait()` returns its result batch-first again."""

    def __init__(self, handle):
        self.handle = handle

    def wait(self) -> torch.Tensor:
        return self.handle.wait().transpose(0, 1)


def _along_seq(collective, x, dim: str, async_op: bool):
    # Comm gathers and scatters along dim 0: the sequence goes first ([s, b, ...]) and the
    # result comes back batch-first ([b, s', ...])
    out = collective(x.transpose(0, 1).contiguous(), dim, async_op=async_op)
    return _BatchFirst(out) if async_op else out.transpose(0, 1)


def all_gather_seq(x, comm: Comm, dim: str, async_op: bool = False):
    """All-gather along dim 1, the sequence: [b, s, ...] -> [b, n * s, ...], or with async_op a
    handle whose `wait()` returns that. The collective alone, no autograd (GatherSeq's
    forward, ScatterSeq's backward)."""
    return _along_seq(comm.all_gather, x, dim, async_op)


def reduce_scatter_seq(x, comm: Comm, dim: str, async_op: bool = False):
    """Sum over the group, each rank keeping its shard of dim 1: [b, s, ...] -> [b, s / n, ...],
    or with async_op a handle whose `wait()` returns that. No autograd (ScatterSeq's forward,
    GatherSeq's backward)."""
    return _along_seq(comm.reduce_scatter, x, dim, async_op)


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
        return all_gather_seq(x, comm, dim)                 # [b, n * s_local, ...]

    @staticmethod
    def backward(ctx, grad):
        out = _overlapped(reduce_scatter_seq(grad, ctx.comm, ctx.dim, async_op=True), ctx.region)
        return out, None, None, None


class GatherSeqColumns(torch.autograd.Function):
    """SP's all-gather along dim 1 fused with the column-parallel Linears that read its output.

    Forward: issue the all-gather of the sequence shards (a handle), compute every Linear on this
    rank's own rows while it travels, wait, compute the rows before and after, and assemble each
    output in sequence order. Returns the gathered input (for any other use the module makes of
    it) and one output per Linear, each equal to `linear(gather_seq(x))`. Backward: the input
    gradient of every Linear (summed, plus the gathered input's own), then the reduce-scatter,
    with the weight-gradient GEMMs routed as `_Linear` routes them (the W action, the region while
    the reduce-scatter travels, or now). Under autocast the GEMMs run in the autocast dtype as
    `_Linear`'s do."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str, region: TPRegion | None, linears: list, *params):
        n, r, s = comm.size(dim), comm.local_rank(dim), x.shape[1]
        handle = comm.all_gather(x.transpose(0, 1).contiguous(), dim, async_op=True)
        device = x.device.type
        cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

        def gemm(rows, lin):
            w, b = lin.weight, lin.bias
            if cast is not None:
                rows, w, b = rows.to(cast), w.to(cast), None if b is None else b.to(cast)
            with torch.autocast(device, enabled=False):
                return F.linear(rows, w, b)

        own = [gemm(x, lin) for lin in linears]              # [b, s, out]: while the gather travels
        gathered = handle.wait()                             # [n * s, b, h], sequence first
        outs = []
        for lin, y_own in zip(linears, own):
            y = y_own.new_empty((x.shape[0], n * s, y_own.shape[-1]))   # [b, n * s, out]
            y[:, r * s:(r + 1) * s] = y_own
            for lo, hi in ((0, r * s), ((r + 1) * s, n * s)):          # rows before and after
                if hi > lo:
                    y[:, lo:hi] = gemm(gathered[lo:hi], lin).transpose(0, 1)
            outs.append(y)
        full = gathered.transpose(0, 1)                      # [b, n * s, h]
        ctx.save_for_backward(full if cast is None else full.to(cast))
        ctx.comm, ctx.dim, ctx.region, ctx.linears, ctx.x_dtype = comm, dim, region, linears, x.dtype
        ctx.set_materialize_grads(False)
        return (full, *outs)

    @staticmethod
    def backward(ctx, grad_full, *grad_outs):
        (xs,) = ctx.saved_tensors                            # gathered input, GEMM dtype
        grad_in, param_grads = grad_full, []
        # input gradients summed in the order autograd sums separate Linears' (last one first)
        for lin, go in reversed(list(zip(ctx.linears, grad_outs))):
            if go is None:
                continue
            go = go.to(xs.dtype)
            gi = (go @ lin.weight.to(xs.dtype)).to(ctx.x_dtype)
            grad_in = gi if grad_in is None else grad_in + gi
        for lin, go in zip(ctx.linears, grad_outs):
            w, b = lin.weight, lin.bias
            if go is None:
                param_grads += [None] * (1 if b is None else 2)
                continue
            go = go.to(xs.dtype)
            stash = _stash_of(lin)
            if stash is not None:
                stash.append((w, b, xs, go))
                _mark_deferred(w, b)
                param_grads += [None] * (1 if b is None else 2)
                continue
            go2 = go.reshape(-1, go.shape[-1])
            param_grads.append((go2.t() @ xs.reshape(-1, xs.shape[-1])).to(w.dtype))
            if b is not None:
                param_grads.append(go2.sum(0).to(b.dtype))
        if grad_in is None:
            grad_in = xs.new_zeros(xs.shape, dtype=ctx.x_dtype)
        out = _overlapped(reduce_scatter_seq(grad_in, ctx.comm, ctx.dim, async_op=True), ctx.region)
        return (out, None, None, None, None, *param_grads)


class ScatterSeq(torch.autograd.Function):
    """Sequence parallelism's `g`: reduce-scatter along dim 1 forward (sum of the TP ranks'
    partial outputs, each rank keeping its sequence shard); all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Comm, dim: str):
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter_seq(x, comm, dim)             # [b, s / n, ...]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.comm, ctx.dim), None, None


def copy_to(x, comm: Comm, dim: str, region: TPRegion | None = None):
    return x if comm.size(dim) == 1 else CopyToParallelRegion.apply(x, comm, dim, region)


def reduce_from(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else ReduceFromParallelRegion.apply(x, comm, dim)


def gather_seq(x, comm: Comm, dim: str, region: TPRegion | None = None):
    return x if comm.size(dim) == 1 else GatherSeq.apply(x, comm, dim, region)


def scatter_seq(x, comm: Comm, dim: str):
    return x if comm.size(dim) == 1 else ScatterSeq.apply(x, comm, dim)


def gather_seq_columns(x, comm: Comm, dim: str, region: TPRegion | None, linears: list):
    """(gather_seq(x), [linear(gather_seq(x)) for linear in linears]), the GEMMs over this rank's
    rows overlapped with the gather (GatherSeqColumns)."""
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    full, *outs = GatherSeqColumns.apply(x, comm, dim, region, linears, *params)
    return full, outs
