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


class _Linear(torch.autograd.Function):
    """y = x W^T. Under autocast the GEMMs run in the autocast dtype, as F.linear's would: x
    and W are cast on the way in and x is saved in that dtype, so the deferred dW GEMM multiplies
    two tensors of one dtype (bf16 x bf16) and its result is cast to the fp32 master weight's
    gradient. The autocast state is read off the input's device, so CPU autocast takes this
    path too (custom_fwd/custom_bwd only know CUDA's)."""

    @staticmethod
    def forward(ctx, x, weight, store: WeightGradStore):
        w = weight
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            x, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.store = store
        with torch.autocast(device, enabled=False):
            return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(x.dtype)                         # [..., out] in the GEMM dtype
        grad_in = grad_out @ weight.to(x.dtype)                 # [..., in]
        if ctx.store.deferring:
            ctx.store.pending.append((weight, x, grad_out))
            return grad_in, None, None
        gw = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_in, gw.to(weight.dtype), None


def enable_weight_grad_split(module: nn.Module, store: WeightGradStore) -> None:
    """Route every bias-free Linear in `module` through the deferrable autograd function."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.bias is None:
            m.forward = (lambda mod: lambda x: _Linear.apply(x, mod.weight, store))(m)
