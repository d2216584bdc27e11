"""What the training loop asks of the parts that steer a run from outside: a step hook.

The loop knows no controller. A configuration field that wants to act on the run (`--adapt`:
commpipe.adapt's `AdaptConfig`; the `--slow-rank` drill: `SlowRank`) implements
`Steering` or `Drill`: the loop calls a drill's `install` once a trainer is built and a steering
field's `step_hook` before the first step, and drives the hook it gets back
(commpipe.adapt.controller.Controller is one).
"""

from __future__ import annotations

from typing import Protocol


class StepHook(Protocol):
    decisions: list    # what the hook decided so far (logged beside the metrics)
    # set by every after_step on every rank alike: did any rank ask to stop (its `stop`)? The
    # hook's own exchange carries the flags, sparing the loop its all-reduce of them
    stop_agreed: bool

    def after_step(self, trainer, rec: dict, metrics_file, stop: bool = False):
        """Called after every step; returns (trainer, metrics_file), either may be replaced
        (a switch to another layout builds a new trainer in the same processes). `stop`: this
        rank was signalled to stop."""

    def close(self, together: bool = True) -> None:
        """The run ends (normally or not; `together`: every rank ends here alike)."""


class Steering(Protocol):
    """A configuration field that steers the run (TrainConfig.adapt)."""

    def validate(self):
        """Checked when the configuration resolves (raises ValueError naming the fix)."""

    def step_hook(self, trainer, out, log) -> StepHook:
        """The hook the loop drives from the first step on."""


class Drill(Protocol):
    """A configuration field that changes a built trainer (TrainConfig.slow_rank)."""

    rank: int    # the rank it acts on (checked against the world size)

    def install(self, trainer) -> None:
        """Called on every built trainer (also one a switch builds)."""
