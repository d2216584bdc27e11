"""Which candidates the controller trials: only those whose prediction interval overlaps the best
prediction's (commpipe.adapt.trial), on synthetic candidates, no launch.

    python -m pytest tests/test_adapt_trials.py -q

A candidate predicted p runs in [p * low, p * high]; with the best predicted at b it overlaps
when p * low <= b * high, i.e. p <= b * high / low.
"""

from __future__ import annotations

import pytest

from commpipe.adapt.config import AdaptConfig
from commpipe.layout import Layout


def _row(pp: int, dp: int, ms: float, cost: float = 0.1, schedule: str = "1f1b") -> dict:
    return {"plan": Layout(tp=1, cp=1, pp=pp, dp=dp, stage_layers=(4 // pp,) * pp, schedule=schedule,
                           microbatches=8 // dp, micro_batch_size=1), "predicted_ms": ms,
            "switch_cost_s": cost}


def _rows() -> list[dict]:
    # predicted 100, 110, 119, 121, 150 and 400 ms; the list is not sorted
    return [_row(2, 1, 119.0), _row(1, 4, 400.0), _row(1, 2, 100.0), _row(4, 1, 110.0),
            _row(2, 2, 121.0), _row(2, 1, 150.0, schedule="gpipe")]


@pytest.mark.parametrize("interval, expected", [
    # b * high / low = 100 * 1.2 / 1.0 = 120: 119 overlaps, 121 does not
    ((1.0, 1.2), [100.0, 110.0, 119.0]),
    # 100 * 1.2 / 0.8 = 150: 150 sits on the boundary and overlaps, 400 never does
    ((0.8, 1.2), [100.0, 110.0, 119.0, 121.0, 150.0]),
    # an exact model (a point interval): only the best itself
    ((1.0, 1.0), [100.0]),
])
def test_only_candidates_whose_interval_overlaps_the_best_are_trialled(interval, expected):
    from commpipe.adapt.trial import overlaps_best, trial_rows

    rows = _rows()
    best = rows[2]
    picked = trial_rows(rows, best, k=3, interval=interval)
    assert [r["predicted_ms"] for r in picked] == expected
    # every row left out is one the model tells apart from the best
    for r in rows:
        assert (r in picked) == overlaps_best(r["predicted_ms"], 100.0, interval)


def test_the_admitted_switch_comes_first_and_the_list_is_capped_at_twice_k():
    from commpipe.adapt.trial import trial_rows

    rows = _rows()
    chosen = rows[0]                                  # 119 ms: admitted for its net saving
    picked = trial_rows(rows, chosen, k=3, interval=(0.8, 1.2))
    assert picked[0] is chosen
    assert [r["predicted_ms"] for r in picked] == [119.0, 100.0, 110.0, 121.0, 150.0]
    # the admitted switch is trialled even when it lies outside the best's interval
    far = rows[1]                                     # 400 ms
    assert [r["predicted_ms"] for r in trial_rows(rows, far, 3, (1.0, 1.2))] == [400.0, 100.0,
                                                                                  110.0, 119.0]
    # 2k at most: k=2 keeps the admitted switch and the 3 best overlapping
    assert [r["predicted_ms"] for r in trial_rows(rows, chosen, 2, (0.8, 1.2))] == [119.0, 100.0,
                                                                                   110.0, 121.0]
    assert trial_rows(rows, chosen, 0, (0.8, 1.2)) == [chosen]


def test_plan_trials_takes_the_interval_it_is_given():
    from commpipe.adapt.trial import plan_trials, trial_cost_s

    rows = _rows()
    best = rows[2]
    # 3000 -> 100 ms over a 100-step horizon saves 290 s: every overlapping trial pays
    narrow, cost, v = plan_trials(rows, best, 3000.0, 1000, AdaptConfig(), (1.0, 1.2))
    assert v.admit and [r["predicted_ms"] for r in narrow] == [100.0, 110.0, 119.0]
    assert cost == pytest.approx(trial_cost_s(narrow, AdaptConfig().trial_steps + 1))
    wide, _, _ = plan_trials(rows, best, 3000.0, 1000, AdaptConfig(), (0.8, 1.2))
    assert len(wide) == 5


def test_step_time_factors_are_the_planners_interval():
    from commpipe.plan.interval import CPU_STEP_QUANTILES, RATIO_QUANTILES, step_time_factors

    # GPUs: the interval is of measured / predicted *throughput*; step time is its inverse, so
    # the slow end of the step comes from the low end of the throughput
    low, high = step_time_factors(on_cpu=False)
    assert low == pytest.approx(1.0 / RATIO_QUANTILES[90])
    assert high == pytest.approx(1.0 / RATIO_QUANTILES[10])
    assert low < 1.0 / RATIO_QUANTILES[50] < high
    assert step_time_factors(on_cpu=True) == (CPU_STEP_QUANTILES[10], CPU_STEP_QUANTILES[90])
    assert CPU_STEP_QUANTILES[10] < CPU_STEP_QUANTILES[90]


def test_a_trial_phase_drops_what_its_measured_bias_shows_cannot_win():
    """After a trial the untried candidates are predicted again with the run's measured bias
    (the median of measured / predicted so far): A predicted 100 measured 90 (bias 0.9). With a
    relative error interval (0.9, 1.1) B (110: 110 x 0.9 x 0.9 = 89.1 <= 90) may still win and
    stays; C (130: 105.3 > 90) is dropped. The plan before the trials counts as measured."""
    from commpipe.adapt.trial import Trials

    a, b, c = (Layout(tp=1, cp=1, pp=2, dp=1, stage_layers=split, schedule="1f1b", microbatches=8,
                      micro_batch_size=1) for split in ((1, 3), (2, 2), (3, 1)))
    x = Layout(tp=1, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b", microbatches=4, micro_batch_size=1)
    t = Trials([(a, 100.0), (b, 110.0), (c, 130.0)], (x, 200.0), steps=1, warmup=0)
    assert t.prune((0.9, 1.1)) == []                    # nothing measured yet: nothing to learn
    assert t.observe(90.0)
    t.finish()
    assert t.prune((0.9, 1.1)) == [c]
    assert [p for p, _ in t.plans] == [a, b] and t.plan == b
    # a plan before the trials faster than anything predicted drops every untried candidate
    t2 = Trials([(a, 100.0), (b, 110.0)], (x, 80.0), steps=1, warmup=0)
    t2.observe(100.0)
    t2.finish()
    assert t2.prune((0.9, 1.1)) == [b] and t2.done and t2.settle() == (x, 80.0)


def test_a_trial_that_cannot_pay_for_itself_in_the_steps_left_is_dropped():
    """A predicted 100 measured 90 (bias 0.9) after a 200 ms switch. B predicted 110: at best
    110 x 0.9 x 0.9 = 89.1 ms, 0.9 ms a step below the fastest measured; expected 99 ms. Its
    trial (a 200 ms switch, then 1 warm-up and 3 measured steps at 99 - 90 = 9 ms more each)
    costs 236 ms: with 100 steps left it can save at most 0.9 x (100 - 4) = 86.4 ms and is
    dropped; with 400 left, 356.4 ms, and it stays. Without the steps left only the interval
    decides, as before."""
    from commpipe.adapt.trial import Trials

    a, b = (Layout(tp=1, cp=1, pp=2, dp=1, stage_layers=split, schedule="1f1b", microbatches=8,
                   micro_batch_size=1) for split in ((1, 3), (2, 2)))
    x = Layout(tp=1, cp=1, pp=1, dp=2, stage_layers=(4,), schedule="1f1b", microbatches=4, micro_batch_size=1)

    def measured_a() -> Trials:
        t = Trials([(a, 100.0), (b, 110.0)], (x, 200.0), steps=3, warmup=1)
        t.switch_s.append(0.2)
        for ms in (95.0, 90.0, 90.0, 90.0):
            t.observe(ms)
        t.finish()
        return t

    assert measured_a().prune((0.9, 1.1), steps_left=100) == [b]
    assert measured_a().prune((0.9, 1.1), steps_left=400) == []
    assert measured_a().prune((0.9, 1.1)) == []


def test_the_trial_interval_is_the_suites_on_a_cpu_and_the_planners_on_a_gpu():
    from commpipe.plan.interval import TRIAL_QUANTILES, step_time_factors, trial_factors

    assert trial_factors(on_cpu=True) == (TRIAL_QUANTILES[10], TRIAL_QUANTILES[90])
    assert TRIAL_QUANTILES[10] <= TRIAL_QUANTILES[50] <= TRIAL_QUANTILES[90]
    assert trial_factors(on_cpu=False) == step_time_factors(on_cpu=False)


def test_the_plan_before_the_trials_is_measured_as_a_candidate_is():
    """The slowest rank's step, median over the last trial_steps steps: a fault that began two
    steps before the switch (steps 3-4 of 5 at 240-250 ms) is what the candidates must beat,
    not the calibration window's median (110 ms, three healthy steps among five)."""
    from commpipe.adapt.trial import present_ms

    window = [[{"rank": 0, "step_ms": a}, {"rank": 1, "step_ms": b}]
              for a, b in [(100, 105), (98, 103), (110, 101), (240, 230), (245, 250)]]
    assert present_ms(window, 3) == 240
    assert present_ms(window, 1) == 250
    assert present_ms(window[:2], 3) == 104     # fewer steps than asked: all of them
