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

Whoever waits for a parameter's gradient (the DP reducer, commpipe.parallel.data) watches it
with `watch_grad`, which tells it each time a gradient was added, by autograd or by a flush.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(eq=False)
class _Watch:
    """One watched parameter (`watch_grad`)."""

    on_added: Callable[[nn.Parameter], None]
    # the running backward stashed this parameter's gradient GEMM (or bias sum): autograd's
    # accumulation call for it adds nothing, and the flush will tell instead
    deferred: bool = False


# id(parameter) -> its _Watch, so a parameter carries nothing from outside. An entry goes when
# its parameter is freed (a finalizer), before the id can be reused; a plain dict because the
# backward looks it up for every stashed GEMM (a weak id-keyed dictionary costs ~30x more)
_watches: dict[int, _Watch] = {}


def _forget(key: int, watch: _Watch) -> None:
    if _watches.get(key) is watch:
        del _watches[key]


class GradWatch:
    """The handle `watch_grad` returns: `remove()` stops the calls."""

    def __init__(self, key: int, watch: _Watch, hook):
        self._key, self._watch, self._hook = key, watch, hook

    def remove(self) -> None:
        self._hook.remove()
        _forget(self._key, self._watch)


def watch_grad(p: nn.Parameter, on_added: Callable[[nn.Parameter], None]) -> GradWatch:
    """Call `on_added(p)` each time a gradient is added to `p.grad`: after autograd
    accumulated it (a post-accumulate-grad hook) or, where a `DeferrableLinear` stashed the
    GEMM, after the flush that wrote it. Autograd still runs the hook when the stash left it
    nothing to add; that call is skipped. One watcher per parameter: a later one replaces it."""
    watch = _Watch(on_added)
    _watches[id(p)] = watch
    weakref.finalize(p, _forget, id(p), watch)

    def accumulated(p: nn.Parameter) -> None:
        if watch.deferred:      # nothing added: the flush calls on_added
            watch.deferred = False
            return
        watch.on_added(p)

    return GradWatch(id(p), watch, p.register_post_accumulate_grad_hook(accumulated))


def _ready(p: nn.Parameter) -> None:
    """Gradients written by a flush do not pass AccumulateGrad: tell p's watcher."""
    watch = _watches.get(id(p))
    if watch is not None:
        watch.on_added(p)


def _stash_of(owner: DeferrableLinear) -> list | None:
    """Where `owner`'s weight-gradient work goes at backward time: its `wg_store` deferring (an
    I action) -> stashed for the W action; else its `wg_region` (a tensor-parallel region with
    overlap on) -> stashed until that region's input-gradient collective is in flight
    (commpipe.parallel.functional); else None, computed now."""
    store, region = owner.wg_store, owner.wg_region
    return store.pending if store is not None and store.deferring else \
        region.pending if region is not None else None


def _mark_deferred(*params) -> None:
    # autograd still runs the parameters' post-accumulate-grad hooks, with no gradient added:
    # their watchers skip that call (the gradient arrives with the flush)
    for p in params:
        watch = _watches.get(id(p)) if p is not None else None
        if watch is not None:
            watch.deferred = True


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


class DeferrableLinear(nn.Linear):
    """A model's nn.Linear run through `_Linear`, so its weight (and bias) gradients can be
    deferred to a W action or stashed behind a TP collective. `route_linear` makes one from the
    model's own Linear by changing its class in place (as FSDP2's `fully_shard` does), so its
    parameters, hooks and state-dict names stay the model's.

      wg_store   the stage's WeightGradStore (zero-bubble schedules): deferring during I actions
      wg_region  the TP region (commpipe.parallel.functional.TPRegion) whose input-gradient
                 collective its weight-gradient GEMMs run beside, with TP overlap on
      reduce     a row-parallel reduction of x W^T, before the bias (`_BiasAdd`); None: none
      ready      (input, output) computed for this Linear by its TP entry hook beside the
                 sequence-parallel all-gather (commpipe.parallel.tensor): returned, once, for
                 that very input
    """

    wg_store: WeightGradStore | None = None
    wg_region: object = None
    reduce: object = None
    ready: tuple | None = None

    def forward(self, x):
        ready = self.ready
        if ready is not None and ready[0] is x:
            self.ready = None
            return ready[1]
        if self.reduce is None:
            return _Linear.apply(x, self.weight, self.bias, self)
        y = self.reduce(_Linear.apply(x, self.weight, None, self))
        return y if self.bias is None else _BiasAdd.apply(y, self.bias, self)


def route_linear(m: nn.Linear, reduce=None) -> DeferrableLinear:
    """Make `m` a `DeferrableLinear` in place (idempotent: a routed Linear keeps its reduce);
    its routes start empty. With `reduce` (a row-parallel all-reduce), y = reduce(x W^T) + b."""
    if isinstance(m, DeferrableLinear):
        return m
    if type(m) is not nn.Linear:
        raise TypeError(f"route_linear takes a plain nn.Linear, got {type(m).__name__}")
    m.__class__ = DeferrableLinear
    m.reduce = reduce
    return m


def enable_weight_grad_split(module: nn.Module, store: WeightGradStore) -> None:
    """Route every Linear in `module` (weight and bias) through the deferrable autograd
    functions."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            route_linear(m).wg_store = store
