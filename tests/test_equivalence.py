"""Every layout computes what one device computes: loss of each of 3 optimizer steps, the last
step's gradients and the final parameters, against tests/reference.py (fp32, CPU, gloo).

Layouts: every (tp, cp, pp, dp) in {1, 2}^4 with world size <= 8, plus pp=4, under GPipe and
1F1B, with 8 sequences per step split into micro-batches (so averaging bugs cannot hide).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import OptimConfig, TrainConfig
from tests.dist_harness import run_jobs
from tests.reference import reference_run

LOSS_RTOL = 1e-5
TENSOR_RTOL, TENSOR_ATOL = 1e-5, 1e-6   # gradients are O(1e-2), parameters O(1e-1)
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
# Adam divides each gradient by its running RMS, so an entry whose gradient is near zero (an
# embedding row seen once) turns a rounding-level difference from another summation order
# (~1e-9 here) into an update difference of about lr * 1e-9 / eps. eps=1e-4 keeps that below
# 1e-7 so parameters can be compared at 1e-5 after several steps; gradients and losses are
# compared independently of the optimizer.
ADAM_EPS = 1e-4


def make_cfg(dims: ParallelDims, schedule: str, zero1: bool = False, model: str = "tiny",
             **kw) -> TrainConfig:
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, clip=1.0, eps=ADAM_EPS, zero1=zero1)
    return TrainConfig(model=model, dims=dims, schedule=schedule, global_batch=GLOBAL_BATCH,
                       micro_batch_size=1, seq_len=SEQ, steps=STEPS, seed=3, optim=optim, **kw)


def layouts_of(world: int) -> list[ParallelDims]:
    out = [ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp)
           for tp, cp, pp, dp in itertools.product((1, 2), repeat=4) if tp * cp * pp * dp == world]
    if world == 4:
        out.append(ParallelDims(pp=4))
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_cfg(ParallelDims(), "1f1b"))


def check_against(reference: dict, got: dict, label: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{label} loss: {m}")
    assert got["replicas_equal"], f"{label}: DP/CP replicas diverged"
    assert set(got["params"]) == set(reference["params"]), label
    for name, ref in reference["grads"].items():
        torch.testing.assert_close(got["grads"][name], ref, rtol=TENSOR_RTOL, atol=TENSOR_ATOL,
                                   msg=lambda m, n=name: f"{label} grad {n}: {m}")
    for name, ref in reference["params"].items():
        torch.testing.assert_close(got["params"][name], ref, rtol=TENSOR_RTOL, atol=TENSOR_ATOL,
                                   msg=lambda m, n=name: f"{label} param {n}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_layouts_match_single_device(world, reference):
    jobs = [(f"{d}-{sched}", make_cfg(d, sched)) for d in layouts_of(world)
            for sched in ("gpipe", "1f1b")]
    # ZeRO-1: optimizer states sharded across DP, updated parameters broadcast by their owner
    jobs += [(f"{d}-zero1", make_cfg(d, "1f1b", zero1=True)) for d in layouts_of(world)
             if d.dp == 2 and d.pp <= 2 and d.cp == 1]
    results = run_jobs(world, jobs)
    for key, got in results.items():
        check_against(reference, got, key)
