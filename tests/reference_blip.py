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
from commpipe.train.multimodal import SyntheticCaptions
from tests.reference import reference_loop


def blip_reference_run(cfg: TrainConfig) -> dict:
    cfg.resolve(cfg.dims.world_size)
    model = build_model(cfg.spec, cfg.seed)
    source = SyntheticCaptions(cfg.spec, cfg.seed)

    def loss_at(step: int) -> torch.Tensor:
        batch = source.batch(step, cfg.global_batch)
        logits = model(pixels=batch["pixels"], tokens=batch["tokens"])["logits"]
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)

    return reference_loop(cfg, model, loss_at)
