"""The I/W split of zero-bubble schedules (commpipe.parallel.weight_grad) for Linears with a bias:
the deferred dW and db equal autograd's own gradients (fp32 and bf16 autocast), for a bias
inside the GEMM and one added after a reduction (row-parallel TP); and under ZB-H1 every Linear
weight and bias of blip-tiny is deferred to the W actions, with 1F1B's gradients.

Bit for bit where the operations are the same: one micro-batch's dW is the GEMM autograd runs
(grad_out^T x, same operands and shapes), db the same sum, and bf16 gradients are accumulated
by the same fp32 add. An fp32 dW accumulated over micro-batches is not: the flush folds the
running gradient into the GEMM (addmm_), whose kernel adds it at a point of the sum of its own
choosing (the CPU's BLAS decides), where autograd adds two finished products; those are
compared within WGRAD_EPS_FACTOR eps of the tensor's largest entry.

    python -m pytest -q tests/test_weight_grad_split.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.weight_grad import (
    WeightGradStore,
    enable_weight_grad_split,
    route_linear,
    watch_grad,
)
from commpipe.train.loop import Trainer
from tests.reference import assert_close_to
from tests.test_equivalence import make_cfg

# fp32 accumulation in another order: a few eps of the largest entry (measured: 2 on the Linears
# below, K = 15 tokens per micro-batch; 3 on blip-tiny's); a gradient off by 1e-4 is 100x that
WGRAD_EPS_FACTOR = 8


def _pair(row_style: bool):
    torch.manual_seed(0)
    split = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    plain.load_state_dict(split.state_dict())
    if row_style:          # bias added after a (here: doubling) reduction, as tensor_blip's rows
        route_linear(split[2], reduce=lambda y: y * 2)
        plain[2].forward = lambda x, m=plain[2]: nn.functional.linear(x, m.weight) * 2 + m.bias
    return split, plain


@pytest.mark.parametrize("row_style", [False, True], ids=["bias-in-gemm", "bias-after-reduce"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deferred_weight_and_bias_grads_equal_autograd(dtype, row_style):
    split, plain = _pair(row_style)
    store = WeightGradStore()
    enable_weight_grad_split(split, store)
    for mb in range(2):                            # two micro-batches: the flush accumulates
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(mb))
        for module, defer in ((split, True), (plain, False)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = module(x)
            store.deferring = defer
            y.float().square().sum().backward()
            store.deferring = False
        items = store.take()
        # one entry per weight GEMM, one per bias; nothing reached .grad during I
        assert sum(w is not None for w, *_ in items) == 2 and sum(b is not None for _, b, *_ in items) == 2
        if mb == 0:
            assert all(p.grad is None for p in split.parameters())
        WeightGradStore.flush(items)
        for (name, a), b in zip(split.named_parameters(), plain.parameters()):
            assert a.grad.dtype == torch.float32, name
            if mb == 1 and dtype == torch.float32 and name.endswith("weight"):
                # accumulated by addmm_ against autograd's separate add (module docstring)
                assert_close_to(a.grad, b.grad, rtol=0, eps_factor=WGRAD_EPS_FACTOR, label=name)
            else:
                torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0,
                                           msg=lambda m, n=f"{name} after micro-batch {mb}": f"{n}: {m}")


def test_watch_grad_tells_once_per_added_gradient_deferred_or_not():
    """A watcher (the DP reducer's bucket counting) is told once per micro-batch for every
    parameter, whether autograd or a flush added the gradient, and only once that gradient is
    in `.grad`: what it sees then equals plain autograd's gradient so far."""
    split, plain = _pair(row_style=True)
    store = WeightGradStore()
    enable_weight_grad_split(split, store)
    seen = {name: [] for name, _ in split.named_parameters()}
    names = {id(p): name for name, p in split.named_parameters()}
    def told(p):
        seen[names[id(p)]].append(None if p.grad is None else p.grad.clone())

    handles = [watch_grad(p, told) for p in split.parameters()]
    for mb, defer in enumerate((True, False, True)):   # W flushed, then autograd, then W again
        x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(mb))
        plain(x).square().sum().backward()
        store.deferring = defer
        split(x).square().sum().backward()
        store.deferring = False
        WeightGradStore.flush(store.take())
        for (name, _), ref in zip(split.named_parameters(), plain.parameters()):
            told_n = len(seen[name])
            assert told_n == mb + 1, f"{name}: told {told_n} times after {mb + 1} micro-batches"
            assert_close_to(seen[name][-1], ref.grad, rtol=0, eps_factor=WGRAD_EPS_FACTOR,
                            label=f"{name} as told after micro-batch {mb}")
    for h in handles:
        h.remove()
    split(x).sum().backward()
    assert all(len(v) == 3 for v in seen.values())    # removed: no further calls


def _blip(schedule: str):
    cfg = make_cfg(ParallelDims(), schedule, model="blip-tiny")
    cfg.resolve(1)
    trainer = Trainer.build(cfg, Comm(cfg.dims, 0))
    trainer.capture_grads = True
    return trainer


def test_blip_zbh1_defers_every_linear_weight_and_bias():
    zb, ref = _blip("zbh1"), _blip("1f1b")
    linear = {id(p) for m in zb.stages.values() for lin in m.modules()
              if isinstance(lin, nn.Linear) for p in lin.parameters()}
    taken, take = [], zb.runtime.wstore.take

    def counting_take():
        items = take()
        taken.append(items)
        return items

    zb.runtime.wstore.take = counting_take
    zb_loss, ref_loss = zb.train_step()["loss"], ref.train_step()["loss"]
    assert taken and len(taken) == zb.cfg.microbatches     # one I action per micro-batch
    for items in taken:
        deferred = {id(p) for item in items for p in item[:2] if p is not None}
        assert deferred == linear, "an I action computed some Linear weight or bias gradient itself"
        assert sum(w is not None for w, *_ in items) >= 50    # weight GEMMs per micro-batch
    assert zb_loss == ref_loss          # the forward runs the same operations in the same order
    for name, g in ref.last_grads.items():
        # W's addmm_ accumulates micro-batches where 1F1B's autograd adds (module docstring)
        assert_close_to(zb.last_grads[name], g, rtol=0, eps_factor=WGRAD_EPS_FACTOR, label=name)
