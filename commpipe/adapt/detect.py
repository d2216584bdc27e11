"""Persistent-change detection with hysteresis (pure Python).

Each signal (a link's transfer time, a rank's compute time, ...) is one series. Its baseline
is the median of its first `baseline_steps` observations. An observation is *shifted* when it
differs from the baseline by at least `min_shift` (relative). A change is detected once
`min_steps` observations are shifted in the same direction with at most `max_gap` observations
back inside the band among them, each at least half the band on the change's side (a noisy step
of a mild fault does not restart the count; a step back near the baseline, as when a transient
ends, does); then the baseline moves to the new level (the median of the
shifted observations), so a lasting change fires once and a later recovery fires again. A blip
shorter than `min_steps` resets the run and is ignored; so does a run that falls back inside the
band for more than `max_gap` observations or nearer the baseline than half the band, which the
level then follows.
Between changes the baseline follows the level: it is the median of the last
2 x `baseline_steps` observations within the band (a run's first steps are often slower than
its steady state, as allocators, caches and the host settle; a baseline fixed on them would
hide a fault of up to their excess). A drift slower than the band per window is followed, not
detected; the faults the controller acts on are steps, not ramps.
Missing observations (None: nothing was sampled that step) neither extend nor break a run.
Series of sampled, noisy values (a link's few timed calls per step) can be smoothed first:
`smooth=k` feeds the median of the last k raw observations instead of the raw value; a smoothed
series allows no gap (its occasional spikes, a few steps apart, would chain into a run).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class Detection:
    kind: str            # "link" | "compute" | "collective" | "step"
    key: str             # what changed: "pp 1->2", "rank 3", ...
    baseline: float      # level before (ms)
    current: float       # level now (median of the shifted run, ms)
    shift: float         # (current - baseline) / baseline
    onset_step: int      # first step of the shifted run
    step: int            # step at which the change was confirmed

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.kind} {self.key}: {self.baseline:.3g} -> {self.current:.3g} ms "
                f"({self.shift:+.0%}) since step {self.onset_step}")


@dataclass
class _Series:
    start: list = field(default_factory=list)   # observations that set the baseline
    raw: list = field(default_factory=list)     # last `smooth` raw observations
    baseline: float | None = None
    first: float | None = None                  # the baseline until the series' first detection
    run: list = field(default_factory=list)     # (step, value) shifted the same way
    sign: int = 0
    level: list = field(default_factory=list)   # the last observations within the band
    held: list = field(default_factory=list)    # in-band observations inside a shifted run
    fired: bool = False                         # a detection has moved the baseline


class Detector:
    def __init__(self, min_steps: int, min_shift: float, baseline_steps: int, max_gap: int = 0):
        if min_steps < 1 or min_shift <= 0 or baseline_steps < 1 or max_gap < 0:
            raise ValueError("min_steps and baseline_steps must be >= 1, min_shift > 0 and "
                             "max_gap >= 0")
        self.min_steps, self.min_shift, self.baseline_steps = min_steps, min_shift, baseline_steps
        self.max_gap = max_gap
        self.series: dict[tuple[str, str], _Series] = {}

    def reset(self) -> None:
        """Forget every baseline (after a switch the levels are those of another layout)."""
        self.series.clear()

    def baseline(self, kind: str, key: str) -> float | None:
        s = self.series.get((kind, key))
        return s.baseline if s else None

    def firsts(self) -> dict[tuple[str, str], float]:
        """Each series' baseline before its first detection since the last reset (or `arm`):
        the level it followed while nothing changed."""
        return {k: s.first for k, s in self.series.items() if s.first is not None}

    def baselines(self) -> dict[str, float]:
        """Every settled baseline, as {"kind|key": ms} (JSON: it travels in checkpoints)."""
        return {f"{k}|{n}": s.baseline for (k, n), s in sorted(self.series.items())
                if s.baseline is not None}

    def arm(self, baselines: dict[str, float]) -> None:
        """Take `baselines` (from `baselines()`) as the reference levels: a change against
        them is detected without first collecting new ones."""
        for name, value in baselines.items():
            kind, _, key = name.partition("|")
            self.series[(kind, key)] = _Series(baseline=float(value), first=float(value))

    def observe(self, step: int, kind: str, key: str, value: float | None,
                smooth: int = 1) -> Detection | None:
        if value is None:
            return None
        s = self.series.setdefault((kind, key), _Series())
        if smooth > 1:
            s.raw = (s.raw + [value])[-smooth:]
            value = statistics.median(s.raw)
        if s.baseline is None:
            s.start.append(value)
            if len(s.start) >= self.baseline_steps:
                s.baseline = s.first = statistics.median(s.start)
                s.level = list(s.start)
            return None
        base = s.baseline
        shift = (value - base) / base if base > 0 else (0.0 if value == base else float("inf"))
        sign = (shift > 0) - (shift < 0)
        if abs(shift) < self.min_shift:
            # a smoothed series (a link's few sampled calls) has its median for noise: sparse
            # spikes must not chain into a run through gaps
            gap = self.max_gap if smooth <= 1 else 0
            if s.run and len(s.held) < gap and shift * s.sign >= self.min_shift / 2:
                s.held.append(value)       # a noisy step of the change, not the end of it
                return None
            s.run, s.sign = [], 0          # back within the band: a blip ends here
            self._follow(s, s.held + [value])
            return None
        if sign != s.sign:
            s.run, s.sign = [], sign
            self._follow(s, s.held)
        s.run.append((step, value))
        if len(s.run) < self.min_steps:
            return None
        current = statistics.median(v for _, v in s.run)
        det = Detection(kind, key, base, current, (current - base) / base if base > 0 else shift,
                        s.run[0][0], step)
        s.baseline, s.level, s.fired = current, [v for _, v in s.run], True
        s.run, s.sign, s.held = [], 0, []
        return det

    def _follow(self, s: _Series, values: list[float]) -> None:
        """In-band observations: the level (and the baseline) follows them."""
        s.held = []
        if not values:
            return
        s.level = (s.level + values)[-2 * self.baseline_steps:]
        if len(s.level) >= self.baseline_steps:
            s.baseline = statistics.median(s.level)
            if not s.fired:
                s.first = s.baseline

    def observe_all(self, step: int, signals: dict[tuple[str, str], float | None],
                    smooth: dict[str, int] | None = None) -> list[Detection]:
        """Observe every series; `smooth` gives the smoothing per kind (default 1)."""
        out = []
        for (kind, key), value in sorted(signals.items()):
            det = self.observe(step, kind, key, value, (smooth or {}).get(kind, 1))
            if det is not None:
                out.append(det)
        return out


def where(d: Detection, ranks_per_node: int) -> dict:
    """The nodes and link class a link or collective detection spans ({} for other kinds)."""
    import re

    if d.kind not in ("link", "collective"):
        return {}
    ranks = [int(x) for x in re.findall(r"\d+", d.key.split(" ", 1)[1].split("]")[0])]
    nodes = sorted({r // ranks_per_node for r in ranks})
    return {"nodes": nodes, "link_class": "intra_node" if len(nodes) == 1 else "inter_node"}


def worth_replanning(d: Detection, stragglers: set[str]) -> bool:
    """Whether a detection calls for re-planning. Links count both ways (a degrade, a repair).
    A rank whose compute got slower is a straggler. One that got faster only matters when it
    recovers from a slowdown detected before (the split made room for it); otherwise it is the
    host becoming less busy: the detector has already taken the new level as its baseline, and
    re-planning on it would reset the baselines the next real change is measured against.
    Step-time changes follow from the others and are not acted on themselves."""
    if d.kind == "step":
        return False
    if d.kind != "compute":
        return True
    if d.shift > 0:
        stragglers.add(d.key)
        return True
    if d.key in stragglers:
        stragglers.discard(d.key)
        return True
    return False


def slower_than_peers(d: Detection, signals: dict[tuple[str, str], float | None],
                      first: dict[tuple[str, str], float], min_shift: float) -> bool:
    """Whether rank `d.key`, whose compute got slower, got slower than its peers: its level over
    its first baseline under this plan (`Detector.firsts`), against the median of the other
    ranks' current compute over theirs, differs by at least `min_shift`. A straggler is slow
    against its peers (as fail-slow detectors in the field define it); every rank slowing alike
    is the host (other work on a shared machine, a slower clock), which no layout takes work
    away from. A world of one rank has no peers: its slowdown counts."""
    mine = first.get(("compute", d.key))
    peers = [v / first[k] for k, v in signals.items()
             if k[0] == "compute" and k[1] != d.key and v and first.get(k)]
    if not mine or not peers:
        return True
    return d.current / mine / statistics.median(peers) - 1 >= min_shift


def moved_the_job(d: Detection, step_ms: dict[int, float], first_step_ms: float | None,
                  min_shift: float) -> bool:
    """Whether the steps over which `d` held (`d.onset_step` to `d.step`) moved with it: their
    median step time at least `min_shift` above the plan's first step-time baseline for a
    series that got slower, at least `min_shift` below it for one that got faster. The Watch
    asks it of a link or collective that got faster (a rank that got slower answers to
    `step_followed`). A change saves the job what it moves the step: a link whose transfers got
    faster while the step did not was not what the step waited for (a sub-millisecond
    activation send whose time is mostly the host's scheduling). A run with no step baseline
    yet counts the change."""
    during = [ms for s, ms in step_ms.items() if d.onset_step <= s <= d.step]
    if not first_step_ms or not during:
        return True
    change = statistics.median(during) / first_step_ms - 1
    return change >= min_shift if d.shift > 0 else change <= -min_shift


def step_followed(d: Detection, step_ms: dict[int, float], first_step_ms: float | None,
                  min_gain: float, share: float = 0.5) -> bool:
    """Whether the step rose with rank `d.key`'s compute, which got slower: over the steps the
    detection held (`d.onset_step` to `d.step`) the median step is above the healthy step by at
    least `share` (AdaptConfig.step_share, half) of the rank's rise (`d.current - d.baseline`)
    and by at least `min_gain` of itself.
    The healthy step is the lower of the plan's first step baseline and the median of the steps
    just before the onset (when at least 3 were seen): a fault only slows steps, and each can be
    too high, the first when the step's level drifted up inside the band, the second when an
    in-band blip restarted the detector's run and those steps were already the fault's.
    A rank on the critical path of every step passes its extra busy time to the step (a 1F1B
    pipeline goes at its slowest stage's pace, data parallelism waits for its slowest replica);
    half leaves room for host noise and for peers that run faster once the straggler frees the
    cores they share. A rank whose busy time rose where it would have waited anyway (its compute
    filled a pipeline bubble, the host descheduled it) moves the step by little or nothing, and
    a rise under `min_gain` is less than any switch must win. (Against the step's level alone,
    a straggler that moves the step by less than the detector's band, a 1.5x rank on one of two
    stages: 20-40% on this host, was missed: its step observations stay in the band and the
    level follows them up.) A run with no step seen yet counts the change."""
    before = [ms for s, ms in step_ms.items() if s < d.onset_step]
    during = [ms for s, ms in step_ms.items() if d.onset_step <= s <= d.step]
    refs = [first_step_ms] if first_step_ms else []
    if len(before) >= 3:
        refs.append(statistics.median(before))
    if not refs or not during:
        return True
    ref = min(refs)
    rise = statistics.median(during) - ref
    return rise >= share * (d.current - d.baseline) and rise >= min_gain * ref


def costs_the_step(d: Detection, calls: int, first_step_ms: float | None, min_gain: float) -> bool:
    """Whether a link or collective that got slower adds at least `min_gain` of the plan's first
    step time to every step: (current - baseline) per call times its `calls` per step. A change
    that costs the step less cannot be what makes a switch worth `min_gain`; whatever gain a
    re-plan finds then was there before it (the running layout was slower than another all
    along, which is `commpipe plan`'s to say before the run, not a fault's to react to). In a
    healthy 200-step dp2 run the gradient all-reduce read +40-67% (4 -> 6 ms in a 90 ms step)
    and the re-plan it called switched the micro-batching. A run with no step baseline yet
    counts the change."""
    if not first_step_ms:
        return True
    return (d.current - d.baseline) * calls >= min_gain * first_step_ms


def record_levels(store: dict[str, dict[str, float]], plan: str, detector: Detector,
                  first_visit: bool) -> None:
    """Keep `plan`'s healthy levels in `store` (plan name -> {"kind|key": ms}), what a resumed
    run re-arms its detector with. On the plan's first visit, the level each series followed
    until its first change (`Detector.firsts`): not the median of the plan's first steps, which
    may run slower than its steady state and would hide a fault after the resume. On a later
    visit, only series not yet recorded: the levels measured then may already be a fault's."""
    levels = store.setdefault(plan, {})
    if first_visit:
        levels.update({f"{k}|{n}": v for (k, n), v in detector.firsts().items()})
    else:
        for key, level in detector.baselines().items():
            levels.setdefault(key, level)


class Watch:
    """What the controller acts on, from the per-step signals of the running plan: nothing in
    the first `warmup_steps` steps of a plan, links smoothed over `link_smooth_steps`, then the
    detections that call for re-planning (`worth_replanning`), a rank's slowdown only when it is
    slower than its peers (`slower_than_peers`) and the step slowed with it (`step_followed`),
    and a link or collective that got faster only when it recovers from a slowdown detected
    before or the step got faster with it (`moved_the_job`). Pure: the controller feeds it the
    same numbers on every rank, so every rank reaches the same verdict."""

    def __init__(self, acfg):
        self.acfg = acfg
        self.detector = Detector(acfg.min_steps, acfg.min_shift, acfg.baseline_steps,
                                 acfg.max_gap_steps)
        self.stragglers: set[str] = set()
        self.slow_links: set[str] = set()       # links and collectives detected slower
        self.steps_in_plan = 0
        self.step_ms: dict[int, float] = {}     # the step times of the last few steps
        self.calls: dict[tuple[str, str], int] = {}   # calls per step of the step observed

    def observe(self, step: int, signals: dict[tuple[str, str], float | None],
                calls: dict[tuple[str, str], int] | None = None) -> list[Detection]:
        """The detections to act on at `step`; `calls`: each link and collective series' calls
        per step (signals.step_calls; a series not in it counts once)."""
        self.calls = calls or {}
        self.steps_in_plan += 1
        if self.steps_in_plan <= self.acfg.warmup_steps:
            return []
        ms = signals.get(("step", "step"))
        if ms:
            self.step_ms[step] = ms
            self.step_ms = {s: v for s, v in self.step_ms.items()
                            if s > step - 2 * self.acfg.min_steps}
        found = self.detector.observe_all(step, signals, {"link": self.acfg.link_smooth_steps})
        first = self.detector.firsts() if found else {}
        return [d for d in found if self._acts_on(d, signals, first)]

    def _acts_on(self, d: Detection, signals: dict, first: dict) -> bool:
        acfg, first_step = self.acfg, first.get(("step", "step"))
        if d.kind == "compute" and d.shift > 0 and not (
                slower_than_peers(d, signals, first, acfg.min_shift)
                and step_followed(d, self.step_ms, first_step, acfg.min_gain, acfg.step_share)):
            return False
        if d.kind in ("link", "collective"):
            if d.shift > 0:
                if not costs_the_step(d, self.calls.get((d.kind, d.key), 1), first_step,
                                      acfg.min_gain):
                    return False
                self.slow_links.add(d.key)
            elif d.key in self.slow_links:
                self.slow_links.discard(d.key)
            elif not moved_the_job(d, self.step_ms, first_step, acfg.min_shift):
                return False
        return worth_replanning(d, self.stragglers)

    def new_plan(self) -> None:
        """A switch: the levels are those of another plan; collect new baselines."""
        self.detector.reset()
        self.steps_in_plan = 0
        self.step_ms = {}

    def state(self) -> dict:
        """The baselines and stragglers a resumed run re-arms with (JSON)."""
        return {"baselines": self.detector.baselines(), "stragglers": sorted(self.stragglers)}

    def restore(self, state: dict) -> None:
        self.detector.arm(state.get("baselines") or {})
        self.stragglers = set(state.get("stragglers") or ())
