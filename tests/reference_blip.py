"""The single-device reference for the BLIP-style captioner, as tests/reference.py is for LLaMA.

One whole model, one global batch per step: mean cross-entropy over the labelled caption tokens
(torch's ignore_index mean, not commpipe's summed loss and label count), backward, global-norm
clipping, AdamW with the trainer's learning-rate schedule. No Comm, no schedule, no stage split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from commpipe.models.blip import IGNORE, build_model
from commpipe.train.config import TrainConfig
from commpipe.train.loop import lr_at
from commpipe.train.multimodal import SyntheticCaptions


def blip_reference_run(cfg: TrainConfig) -> dict:
    cfg.resolve(cfg.dims.world_size)
    model = build_model(cfg.spec, cfg.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    source = SyntheticCaptions(cfg.spec, cfg.seed)
    losses, norms, grads = [], [], {}
    for step in range(cfg.steps):
        batch = source.batch(step, cfg.global_batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        logits = model(pixels=batch["pixels"], tokens=batch["tokens"])["logits"]
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=IGNORE)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        max_norm = o.clip if o.clip > 0 else float("inf")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "grads": grads}
