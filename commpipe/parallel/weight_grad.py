"""Deferred weight gradients for zero-bubble schedules (the I/W split).

ZB-H1 and ZB-V (Qi et al., ICLR 2024) split a stage's backward into I (gradient of the input,
on the critical path) and W (gradients of the weights, scheduled later into bubbles). As in
DualPipe, this is done with a custom autograd function for every Linear, not with surgery on
the autograd graph: while a `WeightGradStore` is deferring, the backward of each Linear
computes only its input gradient and stashes (weight, input, grad_output); `flush` later runs
the weight-gradient GEMMs. A Linear's bias belongs to W as well: its gradient is the output
gradient summed over tokens, computed in the flush from the same stashed output gradient (a
bias added after a row-parallel all-reduce goes through `_BiasAdd`, deferred the same way).

Parameters outside Linears get their gradients during I. For LayerNorm's affine weight and bias
that is deliberate: their gradients come out of the same fused kernel as the input gradient and
are vector-sized (O(tokens x hidden), no GEMM); deferring them would need a hand-written norm
backward and the normalized input kept alive until W, for no bubble worth filling. The same holds
for embeddings, [CLS]/position parameters and BLIP's patch-projection Conv2d (one small GEMM per
image). Either way the numbers are identical: the split only moves where each gradient is
computed, and the deferred GEMMs and sums are the ones autograd would run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    def __init__(self):
        self.deferring = False
        # (weight or None, bias or None, input or None, output gradient)
        self.pending: list[tuple] = []

    def take(self) -> list:
        out, self.pending = self.pending, []
        return out

    @staticmethod
    @torch.no_grad()       # W actions run with grad mode on; a gradient is not differentiated
    def flush(items: list) -> None:
        """Run the stashed weight-gradient work: dW = grad_out^T x and db = sum of grad_out over
        tokens, accumulated."""
        for weight, bias, x, grad_out in items:
            go2 = grad_out.reshape(-1, grad_out.shape[-1])
            if weight is not None:
                x2 = x.reshape(-1, x.shape[-1])
                if weight.grad is None:
                    weight.grad = (go2.t() @ x2).to(weight.dtype)
                elif weight.grad.dtype == go2.dtype:
                    weight.grad.addmm_(go2.t(), x2)      # accumulate without a temporary
                else:
                    weight.grad += (go2.t() @ x2).to(weight.dtype)
                _ready(weight)
            if bias is not None:
                db = go2.sum(0).to(bias.dtype)
                if bias.grad is None:
                    bias.grad = db
                else:
                    bias.grad += db
                _ready(bias)


def _ready(p: nn.Parameter) -> None:
    """Gradients written by a flush do not pass AccumulateGrad: tell the DP reducer
    (parallel/data.py) that `p`'s gradient is final."""
    ready = getattr(p, "_grad_ready_hook", None)
    if ready is not None:
        ready(p)


def _stash_of(owner: nn.Module) -> list | None:
    """Where `owner`'s weight-gradient work goes at backward time: `_wg_store` deferring (an I
    action) -> stashed for the W action; else `_wg_region` (a tensor-parallel region with
    overlap on) -> stashed until that region's input-gradient collective is in flight
    (commpipe.parallel.functional); else None, computed now."""
    store, region = owner._wg_store, owner._wg_region
    return store.pending if store is not None and store.deferring else \
        region.pending if region is not None else None


def _mark_deferred(*params) -> None:
    # autograd still runs the parameters' post-accumulate-grad hooks, with no gradient added:
    # the DP reducer skips that call (the gradient arrives with the flush)
    for p in params:
        if p is not None:
            p._grad_deferred = True


class _Linear(torch.autograd.Function):
    """y = x W^T (+ b). Under autocast the GEMMs run in the autocast dtype, as F.linear's would: x
    and W are cast on the way in and x is saved in that dtype, so the deferred dW GEMM multiplies
    two tensors of one dtype (bf16 x bf16) and its result is cast to the fp32 master weight's
    gradient. The bias, as in F.linear under autocast, is added in that dtype too, and its
    gradient (summed in the GEMM dtype) is cast to the fp32 bias's. The autocast state is read
    off the input's device, so CPU autocast takes this path too (custom_fwd/custom_bwd only
    know CUDA's). Where the weight and bias gradients go: `_stash_of(owner)`."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner: nn.Module):
        w, b = weight, bias
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x)
        # the Parameters themselves, not saved copies: under saved-tensor hooks (the activation
        # meter) an unpacked saved leaf is another tensor object, and the deferred GEMMs must
        # write `.grad` of the parameter
        ctx.weight, ctx.bias, ctx.owner = weight, bias, owner
        with torch.autocast(device, enabled=False):
            return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight, bias = ctx.saved_tensors, ctx.weight, ctx.bias
        grad_out = grad_out.to(x.dtype)                         # [..., out] in the GEMM dtype
        grad_in = grad_out @ weight.to(x.dtype)                 # [..., in]
        stash = _stash_of(ctx.owner)
        if stash is not None:
            stash.append((weight, bias, x, grad_out))
            _mark_deferred(weight, bias)
            return grad_in, None, None, None
        go2 = grad_out.reshape(-1, grad_out.shape[-1])
        gw = go2.t() @ x.reshape(-1, x.shape[-1])
        gb = None if bias is None else go2.sum(0).to(bias.dtype)
        return grad_in, gw.to(weight.dtype), gb, None


class _BiasAdd(torch.autograd.Function):
    """y + b for a bias added apart from its Linear's GEMM (after a row-parallel all-reduce);
    dtype promotion as a plain `+`. The bias gradient, the output gradient summed over tokens,
    is W work: stashed as `_Linear`'s is (`_stash_of(owner)`)."""

    @staticmethod
    def forward(ctx, y, bias, owner: nn.Module):
        ctx.bias, ctx.owner = bias, owner
        return y + bias

    @staticmethod
    def backward(ctx, grad_out):
        bias, stash = ctx.bias, _stash_of(ctx.owner)
        if stash is not None:
            stash.append((None, bias, None, grad_out))
            _mark_deferred(bias)
            return grad_out, None, None
        return grad_out, grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(bias.dtype), None


def route_linear(m: nn.Linear, reduce=None) -> None:
    """Send a Linear through `_Linear` (idempotent); its routes start empty. With `reduce` (a
    row-parallel all-reduce), y = reduce(x W^T) + b, the bias added after the reduction by
    `_BiasAdd`."""
    if getattr(m, "_wg_routed", False):
        return
    m._wg_store, m._wg_region, m._wg_routed = None, None, True
    if reduce is None:
        m.forward = (lambda mod: lambda x: _Linear.apply(x, mod.weight, mod.bias, mod))(m)
        return

    def forward(x, mod=m):
        y = reduce(_Linear.apply(x, mod.weight, None, mod))
        return y if mod.bias is None else _BiasAdd.apply(y, mod.bias, mod)

    m.forward = forward


def enable_weight_grad_split(module: nn.Module, store: WeightGradStore) -> None:
    """Route every Linear in `module` (weight and bias) through the deferrable autograd
    functions."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            route_linear(m)
            m._wg_store = store
