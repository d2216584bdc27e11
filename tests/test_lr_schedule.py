"""The learning-rate schedule (commpipe.train.optim.lr_at) against hand-computed values, and the
trainer applying it step by step. The multi-rank tests' reference imports lr_at, so only these
tests see a wrong schedule.

    python -m pytest tests/test_lr_schedule.py -q
"""

from __future__ import annotations

import math

import pytest

from commpipe.parallel.comm import Comm
from commpipe.train.config import OptimConfig, TrainConfig
from commpipe.train.loop import Trainer
from commpipe.train.optim import lr_at

C = math.cos(math.pi / 4)           # 0.7071...: a quarter and three quarters of the cosine


def schedule(steps: int, warmup: int, lr: float = 1.0, min_lr: float = 0.1) -> list[float]:
    cfg = TrainConfig(steps=steps, optim=OptimConfig(lr=lr, min_lr=min_lr, warmup_steps=warmup))
    return [lr_at(step, cfg) for step in range(steps)]


@pytest.mark.parametrize("steps, warmup, want", [
    # warm-up 1/2, 2/2 of lr; then the cosine from the peak (step 1) to min_lr at the last step
    # (step 5) in quarters: 0.1 + 0.45 (1 + cos(k pi / 4)), k = 1..4
    (6, 2, [0.5, 1.0, 0.1 + 0.45 * (1 + C), 0.55, 0.1 + 0.45 * (1 - C), 0.1]),
    # no warm-up: the first step is the peak
    (5, 0, [1.0, 0.1 + 0.45 * (1 + C), 0.55, 0.1 + 0.45 * (1 - C), 0.1]),
    # one warm-up step is the peak; two steps: the peak, then min_lr
    (3, 1, [1.0, 0.55, 0.1]),
    (2, 0, [1.0, 0.1]),
    # a warm-up as long as the run never decays
    (3, 3, [1 / 3, 2 / 3, 1.0]),
    (1, 0, [1.0]),
])
def test_lr_against_hand_values(steps, warmup, want):
    assert schedule(steps, warmup) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("steps, warmup", [(10, 0), (10, 1), (10, 3), (100, 10), (7, 6)])
def test_warmup_rises_to_one_peak_and_the_last_step_is_min_lr(steps, warmup):
    lrs = schedule(steps, warmup, lr=3e-3, min_lr=3e-4)
    peak = max(warmup - 1, 0)
    assert lrs[0] == pytest.approx(3e-3 / max(warmup, 1))       # never a step at lr 0
    assert lrs[peak] == pytest.approx(3e-3, rel=1e-12)
    # strictly up to the peak and strictly down after it: the peak is one step
    assert all(a < b for a, b in zip(lrs[:peak], lrs[1:peak + 1]))
    assert all(a > b for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-12)
    cfg = TrainConfig(steps=steps, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=warmup))
    assert lr_at(steps + 5, cfg) == pytest.approx(3e-4, rel=1e-12)   # past the end: min_lr


def test_trainer_sets_each_steps_lr():
    # 4 steps, 1 warm-up step, lr 1e-2 to 1e-3: 1e-2, then 1e-3 + 4.5e-3 (1 + cos(k pi / 3)),
    # k = 1..3: 7.75e-3, 3.25e-3, 1e-3
    cfg = TrainConfig(model="tiny", steps=4, global_batch=2, micro_batch_size=1, seq_len=8,
                      device="cpu", optim=OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1))
    cfg.resolve(1)
    trainer = Trainer.build(cfg, Comm(cfg.dims, 0))
    got = []
    for _ in range(cfg.steps):
        rec = trainer.train_step()
        assert {g["lr"] for g in trainer.optimizer.param_groups} == {rec["lr"]}
        got.append(rec["lr"])
    assert got == pytest.approx([1e-2, 7.75e-3, 3.25e-3, 1e-3], rel=1e-12)
