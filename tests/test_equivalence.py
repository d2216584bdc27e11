"""Every layout computes what one device computes: loss and pre-clip gradient norm of each of 3
optimizer steps, the last step's gradients *before clipping* and the final parameters, against
tests/reference.py (fp32, CPU, gloo).

Layouts: every (tp, cp, pp, dp) in {1, 2}^4 with world size <= 8, plus pp=4, under GPipe and
1F1B, with 8 sequences per step split into micro-batches (so averaging bugs cannot hide), and
ZeRO-1 with dp=2 beside every other dimension.

Why pre-clip: every step of these runs has a gradient norm above the clip threshold, so clipped
gradients (and hence parameters, and losses) are blind to a gradient scaled uniformly, e.g. a DP
or CP reduction that counts twice. test_planted_bugs_are_caught shows the comparison failing on
such bugs, planted into the same process launch.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from commpipe.parallel.dims import ParallelDims
from commpipe.train.config import OptimConfig, TrainConfig
from tests.dist_harness import run_jobs
from tests.reference import assert_close_to, reference_run

LOSS_RTOL = 1e-5
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
# Tensors: rtol plus an absolute allowance of eps_factor fp32 eps of the tensor's largest entry
# (tests/reference.py's assert_close_to). A layout sums each gradient's 128 token terms (8
# sequences x 16) in another order (micro-batches, CP and DP shards, TP partial sums); one eps per
# addition gives GRAD_EPS_FACTOR = 128; measured: at most 30 (60 with rtol=0).
TENSOR_RTOL, GRAD_EPS_FACTOR = 1e-5, 128
# Adam divides each gradient by its running RMS, so an entry whose gradient is near zero (an
# embedding row seen once) turns a rounding-level gradient difference into an update difference
# of up to lr / eps = 100 times it; eps=1e-4 (not 1e-8) keeps that factor small, so parameters
# are compared at PARAM_EPS_FACTOR = 512 after 3 steps; measured: at most 98 (tok_embeddings,
# 1.05e-6 of 0.09). Gradients and losses are compared independently of the optimizer.
ADAM_EPS = 1e-4
PARAM_EPS_FACTOR = 512
# A tensor is measured by its largest entry, but at least SCALE_FLOOR of the largest entry of
# all gradients (parameters): a key bias's gradient is zero in exact arithmetic (softmax ignores
# a shift shared by every key), so it and the bias hold only rounding noise of larger terms
# (blip-tiny: 1e-12, against 5e-2 gradients).
SCALE_FLOOR = 1e-4


def _floor(tensors: dict) -> float:
    return SCALE_FLOOR * max(t.abs().max().item() for t in tensors.values())


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
    if world == 8:   # the other rank placement: stages inside, DP replicas across (dims.order)
        out.append(ParallelDims(pp=2, dp=2, tp=2, order="tp-cp-pp-dp"))
    return out


@pytest.fixture(scope="module")
def reference():
    return reference_run(make_cfg(ParallelDims(), "1f1b"))


def check_losses(reference: dict, got: dict, label: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                               torch.tensor(reference["losses"], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{label} loss: {m}")


def check_grads(reference: dict, got: dict, label: str) -> None:
    """Pre-clip global gradient norms of every step, and the last step's pre-clip gradients."""
    torch.testing.assert_close(torch.tensor(got["grad_norms"], dtype=torch.float64),
                               torch.tensor(reference["grad_norms"], dtype=torch.float64),
                               rtol=LOSS_RTOL, atol=0, msg=lambda m: f"{label} grad norm: {m}")
    floor = _floor(reference["grads"])
    for name, ref in reference["grads"].items():
        assert_close_to(got["grads"][name], ref, rtol=TENSOR_RTOL, eps_factor=GRAD_EPS_FACTOR,
                        label=f"{label} grad {name}", floor=floor)


def check_params(reference: dict, got: dict, label: str) -> None:
    assert got["replicas_equal"], f"{label}: DP/CP replicas diverged"
    assert set(got["params"]) == set(reference["params"]), label
    floor = _floor(reference["params"])
    for name, ref in reference["params"].items():
        assert_close_to(got["params"][name], ref, rtol=TENSOR_RTOL, eps_factor=PARAM_EPS_FACTOR,
                        label=f"{label} param {name}", floor=floor)


def check_against(reference: dict, got: dict, label: str) -> None:
    check_losses(reference, got, label)
    check_grads(reference, got, label)
    check_params(reference, got, label)


# -- planted bugs: each must make the comparison fail ------------------------------------------
def plant_doubled_reduction(trainer) -> None:
    """The DP/CP gradient reduction counts every contribution twice."""
    reduce = trainer.reducer.reduce

    def doubled():
        reduce()
        for p in trainer.params:
            if p.grad is not None:
                p.grad.mul_(2)

    trainer.reducer.reduce = doubled


def plant_dropped_microbatch(trainer) -> None:
    """Micro-batch 0 of every step adds its loss but none of its gradient."""
    loss_fn, calls, m = trainer.runtime.loss_fn, itertools.count(), trainer.cfg.microbatches

    def dropping(logits, labels):
        loss = loss_fn(logits, labels)
        return loss.detach() + 0 * loss if next(calls) % m == 0 else loss

    trainer.runtime.loss_fn = dropping


PLANTED = {  # world 4: (layout, bug)
    "doubled-dp": (ParallelDims(pp=2, dp=2), plant_doubled_reduction),
    "doubled-cp": (ParallelDims(pp=2, cp=2), plant_doubled_reduction),
    "dropped-mb": (ParallelDims(tp=2, pp=2), plant_dropped_microbatch),
}


@functools.cache
def results_of(world: int) -> dict:
    """Every job of one world size in one launch of `world` processes."""
    jobs = [(f"{d}-{sched}", make_cfg(d, sched)) for d in layouts_of(world)
            for sched in ("gpipe", "1f1b")]
    # ZeRO-1: optimizer states sharded across DP, updated parameters broadcast by their owner
    jobs += [(f"{d}-zero1", make_cfg(d, "1f1b", zero1=True)) for d in layouts_of(world)
             if d.dp == 2 and d.pp <= 2]
    if world == 4:
        jobs += [(f"planted-{name}", make_cfg(d, "1f1b"), bug) for name, (d, bug) in PLANTED.items()]
    return run_jobs(world, jobs)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_layouts_match_single_device(world, reference):
    results = results_of(world)
    for key, got in results.items():
        if not key.startswith("planted-"):
            check_against(reference, got, key)


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bugs_are_caught(name, reference):
    got = results_of(4)[f"planted-{name}"]
    with pytest.raises(AssertionError, match="grad"):
        check_grads(reference, got, name)
    if name.startswith("doubled"):
        # clipping hides it: the norm is exactly twice the reference, losses still agree
        ratios = torch.tensor(got["grad_norms"]) / torch.tensor(reference["grad_norms"])
        torch.testing.assert_close(ratios, torch.full_like(ratios, 2.0), rtol=1e-5, atol=0)
        check_losses(reference, got, name)
    else:
        with pytest.raises(AssertionError, match="loss"):
            check_losses(reference, got, name)
