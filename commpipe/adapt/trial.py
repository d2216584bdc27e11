"""Confirming a switch by measurement (pure Python): the TRIAL phase.

The cost model ranks candidates on simulated step times; on a host whose ranks share cores its
errors (pipeline bubbles free cores, tp/cp ranks compete for them) are larger than the gaps
between the cheap layouts. An in-memory switch costs ~0.1 s and every layout computes the same
values, so once the payback rule admits a switch the controller runs the best few candidates
for a few real training steps each, and settles on the fastest *measured* one (the current
plan included, measured as a candidate is: the median of its last `trial_steps` steps, the
slowest rank's, when the switch was decided: `present_ms`).

Defaults and why:
  trials=3          at most 2 x 3 candidates are trialled, and only those the model cannot tell
                    from the best: a candidate whose prediction interval overlaps the best
                    prediction's. The interval is the 80% interval of the model's relative
                    error (`commpipe.plan.interval.trial_factors`: a candidate's measured over
                    predicted against the others of its trial phase, from a suite run's trials
                    on a CPU; the planner's interval on GPUs), so a candidate predicted p runs
                    in [p * low, p * high] four times in five, relative to the others. Where
                    the best prediction's high end lies below a candidate's low end, the model
                    is sure enough: trialling it would spend steps on a plan that loses. After
                    each trial the same test drops candidates against the fastest measured,
                    their predictions corrected by the run's measured bias (`Trials.prune`),
                    and so does payback: a trial whose best case cannot save, over the steps
                    left after it, what the trial is expected to cost (a switch and its steps).
  trial_steps=3     measured steps per candidate, after one warm-up step (the first step after a
                    switch rebuilds buffers and process-group state); the median of 3 survives
                    one noisy step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from commpipe.adapt.signals import slowest_step_ms


def present_ms(window: list[list[dict]], steps: int) -> float:
    """The running plan's step time measured as a trial measures a candidate's: the median of
    the slowest rank's step (`step_ms` of each rank's summary) over the last `steps` steps of
    `window` (per step, every rank's summary). Not the decision's calibration window (the last
    `min_steps` steps): a change that began a few steps before the detection fired would mix
    steps from before it into the figure the candidates must beat."""
    recent = [slowest_step_ms(summaries) for summaries in window[-steps:]]
    return statistics.median(recent)


def overlaps_best(predicted_ms: float, best_ms: float, interval: tuple[float, float]) -> bool:
    """Whether a prediction's interval [p * low, p * high] overlaps the best prediction's."""
    low, high = interval
    return predicted_ms * low <= best_ms * high


def trial_rows(rows: list[dict], chosen: dict, k: int, interval: tuple[float, float]) -> list[dict]:
    """The candidates to trial: `chosen` (the admitted switch) first, then, best predicted
    first, every candidate whose prediction interval overlaps the best prediction's; 2k at most.
    `interval`: (low, high) factors of measured over predicted step time."""
    if k <= 0:
        return [chosen]
    ranked = sorted(rows, key=lambda r: r["predicted_ms"])
    best = ranked[0]["predicted_ms"]
    picked = [chosen]
    for r in ranked:
        if len(picked) >= 2 * k:
            break
        if r is not chosen and r["plan"] != chosen["plan"] and \
                overlaps_best(r["predicted_ms"], best, interval):
            picked.append(r)
    return picked


def trial_cost_s(picked: list[dict], steps_per_trial: int) -> float:
    """Predicted cost of trialling `picked` beyond the plain switch to picked[0]: the switches to
    the others and one more to settle (each at its switch cost), and the steps run on
    candidates slower than the best prediction."""
    if len(picked) <= 1:
        return 0.0
    best = min(r["predicted_ms"] for r in picked)
    switches = sum(r["switch_cost_s"] for r in picked[1:]) + max(r["switch_cost_s"] for r in picked)
    slower = sum(r["predicted_ms"] - best for r in picked) * steps_per_trial / 1e3
    return switches + slower


def plan_trials(rows: list[dict], chosen: dict, current_ms: float, steps_left: int, acfg,
                interval: tuple[float, float]):
    """The trial list for an admitted switch to `chosen` (trial_rows, with the prediction
    `interval`) and the payback verdict with the trials' predicted cost added to the switch
    cost; candidates are dropped from the end of the list (the worst predicted last) until it
    pays. Returns (picked, trial cost s, verdict)."""
    from commpipe.adapt.plan import payback

    picked = trial_rows(rows, chosen, acfg.trials, interval)
    while True:
        cost = trial_cost_s(picked, acfg.trial_steps + 1)
        verdict = payback(current_ms, chosen["predicted_ms"], chosen["switch_cost_s"] + cost,
                          steps_left, acfg.horizon, acfg.margin, acfg.min_gain)
        if verdict.admit or len(picked) == 1:
            return picked, cost, verdict
        picked = picked[:-1]


@dataclass
class Trials:
    """The running trial phase: `plans` in order, each measured for `steps` steps after
    `warmup` discarded steps; `current` is the plan before the trials and its measured ms."""

    plans: list          # [(plan, predicted_ms)]
    current: tuple       # (plan, measured_ms)
    steps: int = 3
    warmup: int = 1
    index: int = 0
    seen: list = field(default_factory=list)       # step times (ms) of the plan on trial
    results: list = field(default_factory=list)    # [(plan, median ms, [ms...])]
    switch_s: list = field(default_factory=list)   # measured switch times during the phase

    @property
    def plan(self):
        return self.plans[self.index][0]

    def observe(self, step_ms: float) -> bool:
        """One step of the plan on trial; True when its measurement is complete."""
        self.seen.append(step_ms)
        return len(self.seen) >= self.warmup + self.steps

    def finish(self) -> dict:
        """Close the plan on trial; its record (median after the warm-up). Advances."""
        warm, kept = self.seen[:self.warmup], self.seen[self.warmup:]
        kept = kept or warm                # the run ended during the warm-up
        med = statistics.median(kept)
        plan, predicted = self.plans[self.index]
        self.results.append((plan, med, kept))
        self.index += 1
        self.seen = []
        return {"plan": plan, "predicted_ms": predicted, "measured_ms": med, "steps_ms": kept,
                "warmup_ms": warm}

    @property
    def done(self) -> bool:
        return self.index >= len(self.plans)

    def settle(self) -> tuple:
        """(plan, measured ms) of the fastest measured, the plan before the trials included
        (it wins ties: staying costs nothing)."""
        best = self.current
        for plan, med, _ in self.results:
            if med < best[1]:
                best = (plan, med)
        return best

    def prune(self, interval: tuple[float, float], steps_left: int | None = None) -> list:
        """Drop the candidates not yet trialled that cannot beat the fastest measured so far:
        the trials measured how far this run lands from the model (the median of their
        measured over predicted, `bias`), and a candidate whose prediction, corrected by that,
        lies above the fastest measured even at the low end of the model's `interval` of
        relative error would spend its steps on a plan that loses. With `steps_left` (the
        run's steps after this one), also one whose trial cannot pay for itself: the most it
        can save, at that low end over the steps left after its trial, is no more than what
        its trial is expected to cost (a switch, at the phase's measured switch time, and its
        warm-up and measured steps at its corrected prediction beyond the fastest measured).
        Returns the dropped plans."""
        if not self.results or self.done:
            return []
        ratios = [med / predicted for (_, predicted), (_, med, _) in
                  zip(self.plans, self.results)]
        bias = statistics.median(ratios)
        best = self.settle()[1]
        rest = self.plans[self.index:]
        switch_ms = 1e3 * statistics.fmean(self.switch_s) if self.switch_s else 0.0
        steps = self.warmup + self.steps

        def loses(predicted: float) -> bool:
            low, likely = predicted * bias * interval[0], predicted * bias
            if low > best:
                return True
            if steps_left is None:
                return False
            saves = (best - low) * max(steps_left - steps, 0)
            return saves <= switch_ms + steps * max(likely - best, 0.0)

        lost = [loses(p) for _, p in rest]
        self.plans = self.plans[:self.index] + [x for x, out in zip(rest, lost) if not out]
        return [plan for (plan, _), out in zip(rest, lost) if out]

    def cost_s(self, best_ms: float) -> float:
        """Measured cost of the phase: the switches it made plus the time its measured steps
        took beyond the settled plan's speed (s)."""
        extra = sum(max(ms - best_ms, 0.0) for _, _, kept in self.results for ms in kept)
        return sum(self.switch_s) + extra / 1e3
