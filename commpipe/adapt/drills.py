"""Fault drills that exercise the controller, usable on real clusters too.

`--slow-rank RANK:FACTOR[@STEP]`: from step STEP on, every compute action of rank RANK is
stretched to FACTOR times its own measured duration (the runtime calls the drill inside the
timed interval, so timelines, the monitor and the controller all see the slower compute, as
they would see a throttled GPU). Link drills change a node's rate on the emulated cluster
(`commpipe.cluster.netns.EmulatedCluster.set_rate`) while training runs.
"""

from __future__ import annotations

import time


class SlowCompute:
    def __init__(self, spec, trainer):
        self.spec, self.trainer = spec, trainer

    def __call__(self, t0) -> None:
        if self.trainer.step < self.spec.step or not isinstance(t0, float):
            return   # not yet, or a CUDA event clock (the drill stretches host time)
        time.sleep((self.spec.factor - 1.0) * (time.perf_counter() - t0))


def install_slow_rank(trainer) -> None:
    spec = getattr(trainer.cfg, "slow_rank", None)
    if spec is not None and trainer.comm.rank == spec.rank:
        trainer.runtime.slowdown = SlowCompute(spec, trainer)
