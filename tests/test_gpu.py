"""GPU path (NCCL-free single process: bf16 autocast on CUDA). Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import TrainConfig
from commpipe.train.loop import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_bf16_autocast_training_tracks_fp32_cpu():
    losses = {}
    for device in ("cpu", "cuda"):
        cfg = TrainConfig(model="tiny", seq_len=32, global_batch=4, steps=3, device=device,
                          schedule="1f1b", seed=1)
        cfg.resolve(1)
        trainer = Trainer.build(cfg, Comm(ParallelDims(), 0, device=torch.device(device)))
        losses[device] = [trainer.train_step()["loss"] for _ in range(cfg.steps)]
    # bf16 matmuls keep ~3 significant digits: the loss of a 256-token vocabulary (~5.5)
    # agrees to about 1e-2 with the fp32 CPU run
    for cpu, gpu in zip(losses["cpu"], losses["cuda"]):
        assert abs(cpu - gpu) < 2e-2, losses
