"""Adaptive training without a launch: detection with hysteresis, the payback rule, the trial
phase's selection and settling, flags, signals and the switch-cost estimate (the demo's own:
tests/test_adapt_demo.py).

    python -m pytest tests/test_adapt_logic.py -q
"""

from __future__ import annotations

import statistics

import pytest

from commpipe.adapt.config import AdaptConfig, SlowRank, parse_slow_rank
from commpipe.adapt.detect import Detector
from commpipe.adapt.plan import payback
from commpipe.layout import Layout

# -- detection -------------------------------------------------------------------------------------


def feed(det: Detector, values, start: int = 0):
    found = []
    for i, v in enumerate(values):
        d = det.observe(start + i, "link", "pp 1->2", v)
        if d is not None:
            found.append(d)
    return found


@pytest.mark.parametrize("min_steps", [3, 5])
def test_detection_ignores_a_blip_and_fires_on_a_lasting_change(min_steps):
    det = Detector(min_steps=min_steps, min_shift=0.25, baseline_steps=4)
    base = [10.0, 10.4, 9.8, 10.1]
    blip = [30.0] * (min_steps - 1)                 # one step short of the threshold
    assert feed(det, base + blip + [10.2, 9.9]) == []
    lasting = [25.0, 26.0, 24.0] + [25.0] * min_steps
    found = feed(det, lasting, start=100)
    assert len(found) == 1
    d = found[0]
    assert d.key == "pp 1->2" and d.kind == "link"
    assert d.onset_step == 100 and d.step == 100 + min_steps - 1   # fires once it has persisted
    assert d.baseline == pytest.approx(10.05) and 1.3 < d.shift < 1.6
    # the new level is the baseline now: staying degraded does not fire again, recovery does
    assert feed(det, [25.0] * 10, start=200) == []
    back = feed(det, [10.0] * min_steps, start=300)
    assert len(back) == 1 and back[0].shift < -0.5


def test_detection_needs_the_minimum_shift_and_skips_missing_samples():
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=2)
    assert feed(det, [10.0, 10.0] + [12.0] * 20) == []      # +20%: below the threshold
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=2)
    found = feed(det, [10.0, 10.0, 14.0, None, 14.0, None, 14.0])
    assert [d.step for d in found] == [6]                   # None neither breaks nor counts


def test_one_step_back_in_the_band_does_not_restart_a_run():
    """A mild fault (+50%) with one step that falls back inside the band (+20%, more than half
    the band): with one gap allowed the change is confirmed at its 5th shifted step, onset its
    first; without, the count restarts there. A step back near the baseline (+5%: a transient's
    end) or two steps back in the band end the run, and the level follows them."""
    base = [10.0, 10.0, 10.0, 10.0]
    mild = [15.0, 15.0, 15.0, 12.0, 15.0, 15.0]
    det = Detector(min_steps=5, min_shift=0.25, baseline_steps=4, max_gap=1)
    found = feed(det, base + mild)
    assert [(d.onset_step, d.step) for d in found] == [(4, 9)]
    assert found[0].current == pytest.approx(15.0) and found[0].baseline == pytest.approx(10.0)
    strict = Detector(min_steps=5, min_shift=0.25, baseline_steps=4, max_gap=0)
    assert feed(strict, base + mild) == []
    # a transient of 3 steps, a step back near the baseline, then 2 noisy ones: no change
    det = Detector(min_steps=5, min_shift=0.25, baseline_steps=4, max_gap=1)
    assert feed(det, base + [70.0] * 3 + [10.5, 14.0, 13.0]) == []
    # two steps back in the band: a blip of 3, 1 more, then back; the level takes the two
    det = Detector(min_steps=5, min_shift=0.25, baseline_steps=4, max_gap=1)
    assert feed(det, base + [15.0] * 3 + [12.0, 15.0, 12.0] + [15.0]) == []
    assert det.baseline("link", "pp 1->2") == pytest.approx(10.0)   # median of 10 x4, 12 x2
    # a smoothed series (a link's sampled calls) allows no gap: its spikes, a step or two apart,
    # would chain through one (a healthy pp2 run's link did). Raw calls with spikes of 50 whose
    # medians of 3 read 10, 50, 11.5, 50, 50: fed as they are, the gap completes a run of 3
    raw = [10.0] * 3 + [10.0, 10.0, 50.0, 10.0, 50.0, 11.5, 50.0, 50.0]
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=3, max_gap=1)
    assert [det.observe(i, "link", "x", v, smooth=3) for i, v in enumerate(raw)] == [None] * 11
    medians = [statistics.median(raw[max(0, i - 2):i + 1]) for i in range(len(raw))]
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=3, max_gap=1)
    assert [d.step for d in feed(det, medians)] == [10]
    # a step inside the band is held out of the level while the run may still be a change
    det = Detector(min_steps=5, min_shift=0.25, baseline_steps=4, max_gap=1)
    feed(det, [10.0, 10.0, 12.0, 12.0] + [20.0, 13.0, 20.0])
    assert det.baseline("link", "pp 1->2") == pytest.approx(11.0)


def test_the_baseline_follows_the_level_between_changes():
    """A run's first steps at 100 ms, its steady state at 80 (-20%: within the band, no
    detection), then a fault to 104: +4% against the first steps, +30% against the level the
    series settled at. The baseline follows the in-band level (the median of the last 8), so
    the fault is detected; the first baseline follows it too until that detection, then stays."""
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=4)
    assert feed(det, [100.0, 101.0, 99.0, 100.0] + [80.0] * 8) == []
    assert det.baseline("link", "pp 1->2") == pytest.approx(80.0)
    assert det.firsts()[("link", "pp 1->2")] == pytest.approx(80.0)
    found = feed(det, [104.0] * 3, start=12)
    assert [(d.onset_step, d.step) for d in found] == [(12, 14)]
    assert found[0].baseline == pytest.approx(80.0) and found[0].shift == pytest.approx(0.3)
    # after the detection the new level is the baseline; the first stays the one before it
    feed(det, [104.0] * 5, start=15)
    assert det.baseline("link", "pp 1->2") == pytest.approx(104.0)
    assert det.firsts()[("link", "pp 1->2")] == pytest.approx(80.0)


def test_a_plans_healthy_levels_are_those_it_followed_before_its_first_change():
    """What a resumed run re-arms with: on a plan's first visit, the level each series followed
    (80 after first steps at 100), kept when a fault then moves the baseline (to 130); on a
    later visit of the same plan, levels measured then (possibly a fault's) do not replace it."""
    from commpipe.adapt.detect import record_levels

    store: dict = {}
    det = Detector(min_steps=3, min_shift=0.25, baseline_steps=4)
    for i, v in enumerate([100.0, 101.0, 99.0, 100.0] + [80.0] * 8 + [130.0] * 4):
        det.observe(i, "compute", "rank 1", v)
        record_levels(store, "pp2", det, first_visit=True)
    assert store == {"pp2": {"compute|rank 1": pytest.approx(80.0)}}
    again = Detector(min_steps=3, min_shift=0.25, baseline_steps=4)
    for i, v in enumerate([130.0] * 6):
        again.observe(i, "compute", "rank 1", v)
        again.observe(i, "step", "step", 200.0)
        record_levels(store, "pp2", again, first_visit=False)
    assert store["pp2"] == {"compute|rank 1": pytest.approx(80.0), "step|step": 200.0}


def test_smoothing_keeps_a_single_outlier_from_counting():
    det = Detector(min_steps=2, min_shift=0.25, baseline_steps=3)
    for i, v in enumerate([10.0, 10.0, 10.0, 50.0, 10.0, 50.0, 10.0]):
        assert det.observe(i, "link", "x", v, smooth=3) is None


# -- the payback rule ------------------------------------------------------------------------------


def test_payback_refuses_a_switch_that_costs_more_than_its_horizon_saves():
    # 100 ms -> 80 ms saves 20 ms a step: 2 s over 100 steps
    v = payback(100.0, 80.0, switch_cost_s=1.5, steps_left=1000, horizon=100, margin=2.0,
                min_gain=0.05)
    assert not v.admit and v.saving_s == pytest.approx(2.0) and "does not pay" in v.reason
    assert payback(100.0, 80.0, 0.9, 1000, 100, 2.0, 0.05).admit
    # few steps left: the horizon shrinks to them
    v = payback(100.0, 80.0, 0.9, steps_left=20, horizon=100, margin=2.0, min_gain=0.05)
    assert not v.admit and v.horizon_steps == 20
    # a free switch with a gain inside the noise is still refused
    assert not payback(100.0, 97.0, 0.0, 1000, 100, 2.0, 0.05).admit


def test_flags_and_drill_spec_fail_early_with_a_fix():
    assert parse_slow_rank("1:3@20") == SlowRank(1, 3.0, 20)
    assert parse_slow_rank("2:1.5") == SlowRank(2, 1.5, 0)
    for bad in ("1", "x:2", "1:0.5", "1:2@-1"):
        with pytest.raises(ValueError, match="--slow-rank"):
            parse_slow_rank(bad)
    with pytest.raises(ValueError, match="--adapt-margin"):
        AdaptConfig(margin=0.5).validate()
    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig

    with pytest.raises(ValueError, match="give --out"):
        TrainConfig(dims=ParallelDims(pp=2), adapt=AdaptConfig()).resolve(2)
    with pytest.raises(ValueError, match="only 2 ranks"):
        TrainConfig(dims=ParallelDims(pp=2), slow_rank=SlowRank(5, 2.0)).resolve(2)


def test_collective_time_counts_from_the_last_members_post():
    from commpipe.adapt.signals import collective_rates, collective_times

    key = ("dp", "all_reduce", (0, 1))
    # rank 1 arrives 50 ms late (a straggler); once both posted, the data took 10 ms
    summaries = [{"rank": 0, "timed": {key: [(1e6, 0.000, 0.060)]}},
                 {"rank": 1, "timed": {key: [(1e6, 0.050, 0.060)]}}]
    nbytes, ms = collective_times(summaries)[key]
    assert nbytes == 1e6 and ms == pytest.approx(10.0)
    # bus bandwidth of a 2-rank all-reduce: 2 (n - 1) / n * 1 MB / 10 ms = 0.1 GB/s
    assert collective_rates([summaries], ranks_per_node=2, min_bytes=65536) == \
        {"intra_node": pytest.approx(0.1)}
    assert collective_rates([summaries], ranks_per_node=1, min_bytes=65536) == \
        {"inter_node": pytest.approx(0.1)}
    assert collective_times(summaries[:1]) == {}       # a member missing: no verdict


def test_every_rank_observes_the_slowest_ranks_step():
    """The step series is the slowest rank's step time from the gathered summaries, not the
    observing rank's own (which differs by what it waited): every rank's detector then takes
    the same decisions. With each rank's own time, a gate on the step (moved_the_job) once let
    rank 1 evaluate alone while rank 0 went on training (a hang in suite run L)."""
    from commpipe.adapt.signals import step_signals

    summaries = [{"rank": r, "step_ms": ms, "busy_ms": 30.0, "links": {}, "collectives": {},
                  "timed": {}} for r, ms in ((0, 41.0), (1, 44.5))]
    assert step_signals(summaries)[("step", "step")] == 44.5
    assert step_signals(summaries[::-1]) == step_signals(summaries)


def test_switch_moves_only_what_a_rank_lacks():
    from commpipe.adapt.plan import moved_bytes
    from commpipe.models.spec import layer_param_count, resolve_model

    spec = resolve_model("tiny")
    layer = 12.0 * layer_param_count(spec)       # parameter + two AdamW moments, fp32
    dp4 = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                 micro_batch_size=1)
    assert moved_bytes(dp4, Layout(tp=1, cp=2, pp=2, dp=1, stage_layers=(2, 2), schedule="1f1b",
                                   microbatches=8, micro_batch_size=1), spec) == 0   # replicas
    resplit = moved_bytes(Layout(tp=1, cp=1, pp=2, dp=1, stage_layers=(2, 2), schedule="1f1b", microbatches=8,
                                 micro_batch_size=1),
                          Layout(tp=1, cp=1, pp=2, dp=1, stage_layers=(3, 1), schedule="1f1b", microbatches=8,
                                 micro_batch_size=1), spec)
    assert resplit == layer                      # rank 0 gains layer 2, rank 1 gains nothing
    assert moved_bytes(Layout(tp=1, cp=1, pp=2, dp=1, stage_layers=(2, 2), schedule="1f1b", microbatches=8,
                              micro_batch_size=1), dp4, spec) > 2 * layer




# -- the trial phase: confirming a switch by measurement -------------------------------------------

def _rows():
    """The cost model's ranking at the demo's degrade (predicted ms) against what the layouts
    measured statically: the model's second (pp2 x dp2) is the fastest by far."""
    def row(tp, cp, pp, dp, ms, cost=0.1):
        split = (4 // pp,) * pp
        return {"plan": Layout(tp=tp, cp=cp, pp=pp, dp=dp, stage_layers=split, schedule="1f1b",
                               microbatches=8 // dp, micro_batch_size=1), "predicted_ms": ms,
                "switch_cost_s": cost}
    return [row(1, 2, 2, 1, 386.0), row(1, 1, 2, 2, 392.0), row(2, 1, 2, 1, 414.0),
            row(1, 1, 4, 1, 425.0), row(2, 1, 1, 2, 2000.0)]


def test_trials_settle_on_the_best_measured_even_when_the_model_ranked_it_lower():
    from commpipe.adapt.trial import Trials, trial_rows

    rows = _rows()
    picked = trial_rows(rows, rows[0], k=3, interval=(1.0, 1.1))
    assert [r["predicted_ms"] for r in picked] == [386.0, 392.0, 414.0]   # 425 > 386 x 1.1
    assert [r["predicted_ms"] for r in trial_rows(rows, rows[0], 3, (1.0, 1.12))] == [386, 392, 414,
                                                                                    425]
    assert trial_rows(rows, rows[0], 0, (1.0, 1.1)) == [rows[0]]
    # the admitted switch is trialled first even when it is not the best predicted
    assert trial_rows(rows, rows[2], 2, (1.0, 1.0))[0] is rows[2]
    dp4 = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                 micro_batch_size=1)
    t = Trials([(r["plan"], r["predicted_ms"]) for r in picked], (dp4, 3000.0), steps=3, warmup=1)
    measured = {386.0: [600, 290, 280, 300], 392.0: [500, 100, 400, 105], 414.0: [440] * 4}
    records = []
    for r in picked:
        assert t.plan == r["plan"]
        seq = measured[r["predicted_ms"]]
        assert [t.observe(x) for x in seq] == [False, False, False, True]
        records.append(t.finish())
        t.switch_s.append(0.1)
    assert t.done
    # the warm-up step is discarded, one noisy step (400) does not move the median
    assert [(x["warmup_ms"], x["measured_ms"]) for x in records] == [([600], 290), ([500], 105),
                                                                      ([440], 440)]
    assert t.settle() == (rows[1]["plan"], 105)
    # measured cost: 3 switches plus the measured steps' time beyond 105 ms
    extra_ms = (185 + 175 + 195) + (0 + 295 + 0) + 3 * 335
    assert t.cost_s(105) == pytest.approx(0.3 + extra_ms / 1e3)


def test_trials_stay_on_the_current_plan_when_it_measured_best():
    from commpipe.adapt.trial import Trials

    rows = _rows()
    cur = Layout(tp=1, cp=1, pp=1, dp=4, stage_layers=(4,), schedule="1f1b", microbatches=2,
                 micro_batch_size=1)
    t = Trials([(rows[0]["plan"], 386.0), (rows[1]["plan"], 392.0)], (cur, 150.0))
    for x in [300, 200, 210, 220, 300, 151, 160, 150]:
        if t.observe(x):
            t.finish()
    assert t.done and t.settle() == (cur, 150.0)    # a tie (150) keeps the running plan


def test_trial_cost_joins_the_payback_rule():
    from commpipe.adapt.trial import plan_trials, trial_cost_s

    rows = _rows()
    for r, c in zip(rows, (0.1, 0.2, 0.3)):
        r["switch_cost_s"] = c
    picked = rows[:3]
    # switches to the 2nd and 3rd (0.2 + 0.3), one more to settle (at most 0.3), and 4 steps on
    # each candidate slower than the best prediction: (6 + 28) ms x 4
    assert trial_cost_s(picked, 4) == pytest.approx(0.8 + 34 * 4 / 1e3)
    assert trial_cost_s(picked[:1], 4) == 0.0
    a = AdaptConfig()
    # 3000 -> 386 ms over 100 steps saves 261 s: every trial pays
    got, cost, v = plan_trials(rows, rows[0], 3000.0, 1000, a, (1.0, 1.1))
    assert v.admit and len(got) == 3 and cost == pytest.approx(trial_cost_s(got, 4))
    # 420 -> 386 ms saves 34 ms a step. Over 300 steps (10.2 s) all three trials pay; over 30
    # (1.02 s) neither 3 trials (2 x (0.1 + 0.936) s) nor 2 (2 x (0.1 + 0.4 + 0.024) s) do,
    # so the list shrinks to the admitted switch alone (2 x 0.1 s)
    assert len(plan_trials(rows, rows[0], 420.0, 300, a, (1.0, 1.1))[0]) == 3
    got, cost, v = plan_trials(rows, rows[0], 420.0, 30, a, (1.0, 1.1))
    assert v.admit and got == rows[:1] and cost == 0.0
    # too few steps left even for that: refused, as without trials
    got, cost, v = plan_trials(rows, rows[0], 420.0, 5, a, (1.0, 1.1))
    assert not v.admit and not payback(420.0, 386.0, 0.1, 5, 100, 2.0, 0.05).admit


def test_only_slowdowns_and_recoveries_of_compute_call_for_replanning():
    from commpipe.adapt.detect import Detection, worth_replanning

    def det(kind, key, shift):
        return Detection(kind, key, 100.0, 100.0 * (1 + shift), shift, 10, 15)

    stragglers: set[str] = set()
    # a rank that got faster without having been slow: the host got less busy, no re-plan
    assert not worth_replanning(det("compute", "rank 2", -0.35), stragglers)
    # a slowdown is a straggler; its later speed-up is a recovery and re-plans once
    assert worth_replanning(det("compute", "rank 1", +0.8), stragglers)
    assert stragglers == {"rank 1"}
    assert worth_replanning(det("compute", "rank 1", -0.45), stragglers)
    assert not stragglers
    assert not worth_replanning(det("compute", "rank 1", -0.3), stragglers)
    # links re-plan both ways: a degrade and a repair
    assert worth_replanning(det("link", "1->2", -0.9), stragglers)
    assert worth_replanning(det("link", "1->2", +4.0), stragglers)


def test_small_pipeline_messages_give_no_link_rate():
    """16 kB in 5 ms is a host's latency, not a 0.003 GB/s link; 4 MB in 5 ms is 0.8 GB/s."""
    from commpipe.adapt.signals import link_rates

    def summary(nbytes):
        return {"links": {("pp", 0, 1): {"transfer_ms": 5.0, "bytes": nbytes, "sampled": 1}}}

    window = [[summary(16_384)], [summary(16_384)]]
    assert link_rates(window, 65_536) == {(0, 1): (None, None)}
    assert link_rates([[summary(4e6)]], 65_536)[0, 1][1] == pytest.approx(4e6 / 5e6)
