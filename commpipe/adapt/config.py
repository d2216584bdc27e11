"""Thresholds of the adaptive controller, and the `--slow-rank` fault drill's spec (no torch).

Defaults and why:
  min_steps=5     a change must hold for 5 steps (max_gap_steps below). Production fail-slows last
                  minutes to hours, i.e. hundreds of steps or more, while one-off stalls
                  (a checkpoint write, a neighbour's burst, garbage collection) last a step or
                  two: 5 steps ignores those and still reacts within a few percent of a
                  minutes-long event. Lower it for very long steps.
  max_gap_steps=1 a run of shifted steps survives one step back inside the band that stays at
                  least half the band on the change's side: a mild fault (a 1.5x straggler on
                  one of two stages) leaves the occasional step within 25% of the baseline, and
                  restarting the count there delayed its detection from 5 steps to 11. A step
                  back near the baseline (within half the band) ends the run, as a transient's
                  end does (a link slowed for 3 steps, then steps at +30-40% and one at +5%:
                  counting the +5% step as a gap confirmed a change that was not there). A
                  confirmed change still needs min_steps shifted steps. Links, whose series
                  is already a median of 3 (link_smooth_steps), get no gap: a healthy pp2 run's
                  sampled link spikes chained into a false change through one. 0: every step of
                  the run must be shifted.
  min_shift=0.25  a relative shift of 25% against the baseline. Step and compute times on a
                  shared host wander by ~5-10% step to step (measured on our 2-core CI box), so
                  25% stays clear of noise; a change smaller than that rarely pays for a switch.
  warmup_steps=2  the first 2 steps of a plan (at the start, after a switch or a resume) are not
                  observed: they carry one-off costs (allocations, first process-group calls).
  baseline_steps=4 observations (their median) that set the reference level, at the start and
                  again after every switch, once warmup_steps have passed; between changes the
                  level is followed as the median of the last 2 x baseline_steps observations
                  within the band (commpipe.adapt.detect).
  horizon=100     steps over which a switch must pay back (capped by the steps left): the saving
                  is predicted for the remaining run, but degrades may end, so we do not count
                  on more than this.
  margin=2.0      the predicted saving over the horizon must be at least twice the switch cost
                  (the cost estimate and the predictions are uncertain; a 2x margin keeps a
                  wrong prediction from costing more than it could gain).
  min_gain=0.05   a candidate predicted less than 5% faster is not worth a switch whatever the
                  horizon: that is within the simulator's error on measured costs. A slower
                  link or collective adding less than this share to the step is not acted on
                  (detect.costs_the_step): it cannot be what makes a switch worth it.
  step_share=0.5 a rank whose compute got slower is acted on only when the step rose by at least
                  half its extra busy time over the healthy step (detect.step_followed): a rank
                  on the critical path passes all of it to the step, host noise and peers that
                  speed up on the cores it frees take some back; a rank whose busy time rose
                  where it would have waited anyway moves the step by little or nothing.
  trials=3, trial_steps=3
                  an admitted switch is confirmed by measurement: up to 2 x 3 candidates whose
                  prediction interval overlaps the best prediction's run 3 steps each after a
                  warm-up step, and the fastest measured wins (commpipe.adapt.trial says why).
  trial_warmup_steps=1
                  the first step after a switch rebuilds buffers and process-group state; it is
                  discarded from a trial's measurement.
  link_smooth_steps=3
                  a link's time comes from a few sampled calls per step: the detector sees the
                  median of its last 3 values (collectives are timed on every large call and
                  compute on every action, so they are not smoothed).
  rebatch_base_s, rebalance_base_s, resplit_base_s, reshard_base_s (None: measured)
                  before a switch of a kind has been measured, the time to rebuild stages (and,
                  for a new layout, process groups) on top of moving the state. None: this run's
                  own, timed when it started: the seconds Trainer.build spent on its stages,
                  runtime, reducer and optimizer (`Trainer.build_s`), plus for a new layout
                  (reshard, replace) the seconds its process groups took (`Comm.groups_s`;
                  NCCL creates communicators at their first collective, which the first trial
                  step, discarded as warm-up, pays). A number overrides it. Replaced by the
                  measured time after the first switch of that kind.
  collective_min_bytes=65536
                  collectives smaller than 64 KiB per call (a loss, a norm) measure latency, not
                  bandwidth: they are neither timed as signals nor used for the bus rate; nor
                  do pipeline messages that small give a link's rate to price other traffic.
  max_microbatches_per_stage=4
                  re-batching considers micro-batch counts from pp to 4 x max(pp, 2): beyond it
                  the bubble is already small and per-micro-batch overheads dominate.
  default_intra_gbps=10.0, default_inter_gbps=1.0
                  a link class no transfer was measured on is priced at these rates (GB/s):
                  shared memory between processes of a host, a 10 Gbit/s network.
  logged_candidates=100
                  the decision record lists the 100 best predicted candidates (all are
                  counted): every candidate of a few ranks (63 in the adaptive demo, whose
                  summary compares them with the layouts its oracle measured).
  lagged=True     each step's summaries are gathered in the background and read after the
                  next step: a rank that finishes a step first goes on instead of waiting at
                  the gather for the slowest (what made --adapt cost ~3% of a healthy step on
                  2 ranks, benchmarks/adapt_overhead.py), for one step more of detection
                  latency. False gathers them at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptConfig:
    min_steps: int = 5
    min_shift: float = 0.25
    max_gap_steps: int = 1
    baseline_steps: int = 4
    warmup_steps: int = 2
    horizon: int = 100
    margin: float = 2.0
    min_gain: float = 0.05
    step_share: float = 0.5
    layouts: bool = True              # also consider tp/cp/pp/dp changes, not only re-splits
    rebalance: bool = True            # also consider uneven micro-batches across DP replicas
    switch_cost_s: float | None = None  # fixed switch cost; default: predicted, then measured
    trials: int = 3                   # candidates trialled by measurement (0: trust the model)
    trial_steps: int = 3              # measured steps per trial (after one warm-up step)
    relaunch: bool = False            # switch by checkpoint and relaunch instead of in memory
    trial_warmup_steps: int = 1
    link_smooth_steps: int = 3
    rebatch_base_s: float | None = None
    rebalance_base_s: float | None = None
    resplit_base_s: float | None = None
    reshard_base_s: float | None = None
    collective_min_bytes: int = 65536
    max_microbatches_per_stage: int = 4
    default_intra_gbps: float = 10.0
    default_inter_gbps: float = 1.0
    logged_candidates: int = 100
    lagged: bool = True               # read each step's summaries after the next step
    resumed_from: dict | None = None  # set at start when resuming a relaunch request
    resume_state: dict | None = None  # the checkpoint's adaptive state (commpipe.adapt.resume)

    def step_hook(self, trainer, out, log):
        """commpipe.train.hooks.Steering: the controller that drives this run."""
        from commpipe.adapt.controller import Controller

        return Controller(trainer, out, log=log)

    def validate(self) -> AdaptConfig:
        if self.min_steps < 1:
            raise ValueError(f"--adapt-min-steps {self.min_steps} must be >= 1")
        if not 0.0 < self.min_shift < 10.0:
            raise ValueError(f"--adapt-min-shift {self.min_shift} must be a fraction > 0 "
                             "(0.25 means a 25% change)")
        if self.baseline_steps < 1 or self.warmup_steps < 0 or self.max_gap_steps < 0:
            raise ValueError("baseline_steps must be >= 1, warmup_steps and max_gap_steps >= 0")
        if self.horizon < 1:
            raise ValueError(f"--adapt-horizon {self.horizon} must be >= 1 step")
        if self.margin < 1.0:
            raise ValueError(f"--adapt-margin {self.margin} must be >= 1 (the saving must at "
                             "least pay for the switch)")
        if self.min_gain < 0:
            raise ValueError(f"min_gain {self.min_gain} must be >= 0")
        if not 0.0 <= self.step_share <= 1.0:
            raise ValueError(f"step_share {self.step_share} must be between 0 and 1")
        if self.trials < 0 or self.trial_steps < 1:
            raise ValueError(f"--adapt-trials {self.trials} must be >= 0 (0 turns trials off) "
                             f"and trial_steps {self.trial_steps} >= 1")
        if self.switch_cost_s is not None and self.switch_cost_s < 0:
            raise ValueError(f"switch_cost_s {self.switch_cost_s} must be >= 0")
        if self.trial_warmup_steps < 0 or self.link_smooth_steps < 1:
            raise ValueError("trial_warmup_steps must be >= 0 and link_smooth_steps >= 1")
        if min(x for x in (self.rebatch_base_s, self.rebalance_base_s, self.resplit_base_s,
                           self.reshard_base_s, 0.0) if x is not None) < 0:
            raise ValueError("rebatch_base_s, rebalance_base_s, resplit_base_s and "
                             "reshard_base_s must be >= 0")
        if self.max_microbatches_per_stage < 1 or self.logged_candidates < 0 \
                or self.collective_min_bytes < 0:
            raise ValueError("max_microbatches_per_stage must be >= 1, logged_candidates and "
                             "collective_min_bytes >= 0")
        if self.default_intra_gbps <= 0 or self.default_inter_gbps <= 0:
            raise ValueError("default_intra_gbps and default_inter_gbps must be > 0")
        return self

    def base_switch_s(self, kind: str, build_s: float = 0.0, groups_s: float = 0.0) -> float:
        """The allowance for rebuilding under a switch of `kind` before one was measured: the
        configured one, else `build_s` (the run's own stage build) plus `groups_s` (its
        process groups) where the layout changes."""
        new_layout = kind in ("reshard", "replace")
        fixed = {"rebatch": self.rebatch_base_s, "rebalance": self.rebalance_base_s,
                 "resplit": self.resplit_base_s, "reshard": self.reshard_base_s,
                 "replace": self.reshard_base_s}[kind]
        if fixed is not None:
            return fixed
        return build_s + (groups_s if new_layout else 0.0)


@dataclass(frozen=True)
class SlowRank:
    """--slow-rank RANK:FACTOR[@STEP]: rank RANK's compute takes FACTOR times as long from
    step STEP on (default 0)."""

    rank: int
    factor: float
    step: int = 0

    def active(self, rank: int, step: int) -> bool:
        return rank == self.rank and step >= self.step

    def install(self, trainer) -> None:
        """commpipe.train.hooks.Drill: slow this rank's compute down."""
        from commpipe.adapt.drills import install_slow_rank

        install_slow_rank(trainer)


def parse_slow_rank(text: str | None) -> SlowRank | None:
    if not text:
        return None
    body, _, at = text.partition("@")
    rank, sep, factor = body.partition(":")
    try:
        spec = SlowRank(int(rank), float(factor), int(at) if at else 0)
    except ValueError:
        spec = None
    if not sep or spec is None:
        raise ValueError(f"--slow-rank {text!r}: write RANK:FACTOR[@STEP], e.g. 1:3@20 "
                         "(rank 1 three times slower from step 20)")
    if spec.rank < 0 or spec.factor < 1.0 or spec.step < 0:
        raise ValueError(f"--slow-rank {text!r}: RANK and STEP must be >= 0 and FACTOR >= 1")
    return spec
