"""Deferred weight gradients for zero-bubble schedules (the I/W split).

ZB-H1 and ZB-V (Qi et al., ICLR 2024) split a stage's backward into I (gradient of the input,
on the critical path) and W (gradients of the weights, scheduled later into bubbles). As in
DualPipe, this is done with a custom autograd function for every Linear, not with surgery on
the autograd graph: while a `WeightGradStore` is deferring, the backward of each Linear
computes only its input gradient and stashes (weight, input, grad_output); `flush` later runs
the weight-gradient GEMMs. Parameters outside Linears (norms, embedding) get their gradients
during I, which is cheap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    def __init__(self):
        self.deferring = False
        self.pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []

    def take(self) -> list:
        out, self.pending = self.pending, []
        return out

    @staticmethod
    @torch.no_grad()       # W actions run with grad mode on; a gradient is not differentiated
    def flush(items: list) -> None:
        """Run the stashed weight-gradient GEMMs: dW = grad_out^T x, accumulated."""
        for weight, x, grad_out in items:
            go2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            if weight.grad is None:
                weight.grad = (go2.t() @ x2).to(weight.dtype)
            elif weight.grad.dtype == go2.dtype:
                weight.grad.addmm_(go2.t(), x2)      # accumulate without a temporary
            else:
                weight.grad += (go2.t() @ x2).to(weight.dtype)
            ready = getattr(weight, "_grad_ready_hook", None)   # gradients written here do not
            if ready is not None:                               # pass AccumulateGrad: tell the
                ready(weight)                                   # DP reducer (parallel/data.py)


class _Linear(torch.autograd.Function):
    """y = x W^T. Under autocast the GEMMs run in the autocast dtype, as F.linear's would: x
    and W are cast on the way in and x is saved in that dtype, so the deferred dW GEMM multiplies
    two tensors of one dtype (bf16 x bf16) and its result is cast to the fp32 master weight's
    gradient. The autocast state is read off the input's device, so CPU autocast takes this
    path too (custom_fwd/custom_bwd only know CUDA's).

    Where the weight gradient goes is read off the owning Linear at backward time:
    `_wg_store` deferring (an I action) -> stashed for the W action; else `_wg_region` (a
    tensor-parallel region with overlap on) -> stashed until that region's input-gradient
    collective is in flight (commpipe.parallel.functional); else computed now."""

    @staticmethod
    def forward(ctx, x, weight, owner: nn.Module):
        w = weight
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x)
        # the Parameter itself, not a saved copy: under saved-tensor hooks (the activation
        # meter) an unpacked saved leaf is another tensor object, and the deferred GEMMs must
        # write `.grad` of the parameter
        ctx.weight, ctx.owner = weight, owner
        with torch.autocast(device, enabled=False):
            return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_out = grad_out.to(x.dtype)                         # [..., out] in the GEMM dtype
        grad_in = grad_out @ weight.to(x.dtype)                 # [..., in]
        store, region = ctx.owner._wg_store, ctx.owner._wg_region
        stash = store.pending if store is not None and store.deferring else \
            region.pending if region is not None else None
        if stash is not None:
            stash.append((weight, x, grad_out))
            # autograd still runs the weight's post-accumulate-grad hooks, with no gradient
            # added: the DP reducer skips that call (the gradient arrives with the flush)
            weight._grad_deferred = True
            return grad_in, None, None
        gw = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_in, gw.to(weight.dtype), None


def route_linear(m: nn.Linear) -> None:
    """Send a bias-free Linear through `_Linear` (idempotent); its routes start empty."""
    if getattr(m, "_wg_routed", False):
        return
    m._wg_store, m._wg_region, m._wg_routed = None, None, True
    m.forward = (lambda mod: lambda x: _Linear.apply(x, mod.weight, mod))(m)


def enable_weight_grad_split(module: nn.Module, store: WeightGradStore) -> None:
    """Route every bias-free Linear in `module` through the deferrable autograd function."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is None:
            route_linear(m)
            m._wg_store = store
