"""The optimizer and its learning-rate schedule: AdamW (ZeRO-1-sharded when the run asks for it)
with Megatron-LM's linear warm-up and cosine decay."""

from __future__ import annotations

import math

import torch

from commpipe.parallel.data import GradReducer, Zero1
from commpipe.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of step `step` (0-based) of a `cfg.steps`-step run: Megatron-LM's
    linear warm-up then cosine decay (OptimizerParamScheduler), counted so that the first step
    does not train at lr 0 and the last one trains at min_lr (Megatron's first iteration has its
    warm-up's lr 0 and it reaches min_lr one step after its last). Warm-up step
    i < warmup_steps trains at lr * (i + 1) / warmup_steps, the last of them at the peak lr
    (without warm-up, step 0 is the peak); the cosine runs from that peak step to min_lr at
    step steps - 1, and stays there after it. A warm-up as long as the run never decays."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    peak = max(o.warmup_steps - 1, 0)
    span = cfg.steps - 1 - peak                         # steps from the peak to the last one
    if span <= 0:
        return o.lr
    progress = min((step - peak) / span, 1.0)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def make_optimizer(params, cfg: TrainConfig, reducer: GradReducer):
    o = cfg.optim

    # foreach=None: torch's own choice, the multi-tensor kernels when every tensor is on a GPU
    # (a few launches a step instead of ~12 per parameter tensor: a host-bound 1.1B step on an
    # H100 went from 1033 to 886 ms, benchmarks/gpu_step_vs_estimate.py --mbs 1) and the
    # per-tensor loop on the CPU, whose results the single-device references reproduce exactly
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=o.lr, betas=o.betas, eps=o.eps,
                                 weight_decay=o.weight_decay, foreach=None)

    if reducer.zero:
        return Zero1(params, reducer, adamw)
    return adamw(params)
