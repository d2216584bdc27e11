"""GPU path: bf16 autocast on CUDA, the gradient norm on the device, and (with two GPUs) a
pipeline over NCCL. Skipped without CUDA; the same code paths run on CPU in test_precision.py
and test_strict_order.py."""

from __future__ import annotations

import pytest
import torch

from commpipe.parallel.comm import Comm
from commpipe.parallel.data import clip_grad_norm_
from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import TrainConfig
from commpipe.train.loop import Trainer
from tests.dist_harness import spawn
from tests.reference import reference_run
from tests.test_equivalence import make_cfg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
MODEL = "arch=llama,layers=8,hidden=32,heads=4,kv_heads=2,ffn_hidden=64,vocab=128"


@pytest.mark.parametrize("model, schedule", [("tiny", "1f1b"), ("tiny", "zbh1"),
                                             ("tiny", "stp"),    # stp: unit by unit, braided
                                             ("moe-tiny", "1f1b"), ("blip-tiny", "1f1b")])
def test_bf16_autocast_training_tracks_fp32_cpu(model, schedule):
    losses = {}
    for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
        cfg = TrainConfig(model=model, seq_len=32, global_batch=4, steps=3, device=device,
                          schedule=schedule, seed=1, precision=precision)
        cfg.resolve(1)
        trainer = Trainer.build(cfg, Comm(ParallelDims(), 0, device=torch.device(device)))
        losses[device] = [trainer.train_step()["loss"] for _ in range(cfg.steps)]
        assert {p.dtype for p in trainer.params} == {torch.float32}
    for cpu, gpu in zip(losses["cpu"], losses["cuda"]):
        assert abs(cpu - gpu) <= 0.02 * abs(cpu), losses


def test_grad_norm_is_computed_on_the_parameters_device():
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.zeros(3, device=device)) for _ in range(2)]
    for p, value in zip(params, (3.0, 4.0)):
        p.grad = torch.full((3,), value, device=device)
    norm = clip_grad_norm_(params, 1.0, Comm(ParallelDims(), 0, device=device))
    assert norm == pytest.approx((3 * 9 + 3 * 16) ** 0.5)
    total = torch.cat([p.grad for p in params]).norm().item()
    assert total == pytest.approx(1.0, rel=1e-5)


def _nccl_worker(rank: int, world: int, dim: str, schedule: str) -> list:
    cfg = make_cfg(ParallelDims(**{dim: world}), schedule, model=MODEL, device="auto",
                   precision="fp32")
    trainer = Trainer.build(cfg)          # init_distributed: NCCL, cuda:LOCAL_RANK
    assert trainer.comm.backend == "nccl" and trainer.comm.strict_order
    assert torch.cuda.current_device() == rank
    return [trainer.train_step()["loss"] for _ in range(cfg.steps)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dim, schedule", [("pp", "zbv"), ("pp", "stp"), ("tp", "stp")])
def test_over_nccl_matches_single_device(dim, schedule):
    # ("tp", "stp"): the braids' TP collectives issued asynchronously on NCCL's stream
    # backend=None: the trainer starts the group itself, from torchrun's variables
    losses = spawn(_nccl_worker, 2, dim, schedule, backend=None)[0]
    reference = reference_run(make_cfg(ParallelDims(), "1f1b", model=MODEL))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]),
                               rtol=1e-4, atol=0)
