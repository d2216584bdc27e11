"""The single-device reference every parallel layout is checked against.

A plain loop on one whole model: mean token cross-entropy over the global batch, backward,
global-norm clipping and AdamW with the same learning-rate schedule. It shares no parallel code
with commpipe's runtime (no Comm, no schedule, no stage split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commpipe.models.llama import build_model
from commpipe.train.config import TrainConfig
from commpipe.train.optim import lr_at
from commpipe.train.source import make_source


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, eps_factor: float,
                    label: str, floor: float = 0.0) -> None:
    """|actual - expected| <= rtol |expected| + eps_factor * eps * max(max|expected|, floor),
    elementwise (eps of expected's dtype): the two computed the same values with their sums in
    another order. Summing in another order (micro-batches, shards, a kernel's blocking, fused or
    separate accumulation: each CPU's BLAS picks its own) changes the rounding by a few eps of the
    magnitudes summed, which the tensor's largest entry measures; an entry near zero can be the
    difference of large terms, so a tolerance relative to each entry alone would not do. `floor`:
    for a tensor that is zero in exact arithmetic and holds only the rounding of larger terms."""
    scale = max(expected.abs().max().item(), floor)
    atol = eps_factor * torch.finfo(expected.dtype).eps * scale
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{label}: {m}")


def reference_run(cfg: TrainConfig) -> dict:
    """Losses and pre-clip gradient norms per step, final parameters, and the gradients of the
    last step before clipping."""
    cfg.resolve(cfg.dims.world_size)
    model = build_model(cfg.spec, cfg.seed)
    source = make_source(cfg, cfg.spec)

    def loss_at(step: int) -> torch.Tensor:
        inputs, labels = source.batch(step, cfg.global_batch, 0, 1)
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())

    return reference_loop(cfg, model, loss_at)


def reference_loop(cfg: TrainConfig, model, loss_at) -> dict:
    """cfg.steps steps of `loss_at(step)`, backward, global-norm clipping and AdamW with the
    trainer's learning-rate schedule; what reference_run returns."""
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    losses, norms, grads = [], [], {}
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = loss_at(step)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        max_norm = o.clip if o.clip > 0 else float("inf")   # commpipe: clip=0 is off
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "grads": grads}
