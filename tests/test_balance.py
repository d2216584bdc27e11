"""Stage balancing against brute force, and the per-layer cost sources it reads.

    python -m pytest -q tests/test_balance.py
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time

import pytest

from commpipe.models.blip_spec import layer_flops, resolve_blip, stage_io
from commpipe.parallel.balance import balance, blip_layer_costs, measure_layer_costs, stage_costs


def brute_force(costs, stages, slowdown=None):
    """Smallest slowest-stage cost over every placement of stages - 1 cuts."""
    n = len(costs)
    slowdown = slowdown or [1.0] * stages
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) * f
                             for (a, b), f in zip(itertools.pairwise(bounds), slowdown)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_optimal_on_random_inputs(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    stages = rng.randint(1, n)
    integer = seed % 2 == 0  # integers: exact ties; floats: the usual case
    costs = [rng.randint(0, 9) if integer else rng.uniform(0.1, 5.0) for _ in range(n)]
    counts = balance(costs, stages)
    assert len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == n
    assert max(stage_costs(costs, counts)) == pytest.approx(brute_force(costs, stages), abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_balance_with_stage_slowdowns_is_optimal(seed):
    # a straggling stage (the adaptive controller's re-split) should get fewer layers
    rng = random.Random(100 + seed)
    n = rng.randint(2, 9)
    stages = rng.randint(2, min(n, 4))
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    slowdown = [rng.choice([1.0, 1.0, 2.5, 4.0]) for _ in range(stages)]
    counts = balance(costs, stages, slowdown)
    got = max(c * f for c, f in zip(stage_costs(costs, counts), slowdown))
    assert got == pytest.approx(brute_force(costs, stages, slowdown), abs=1e-12)


def test_a_slow_stage_gets_fewer_layers():
    assert balance([1] * 4, 2) == [2, 2]
    assert balance([1] * 4, 2, [1.0, 4.0]) == [3, 1]
    with pytest.raises(ValueError, match="one positive factor per stage"):
        balance([1] * 4, 2, [1.0])


def test_balance_examples_and_errors():
    assert balance([1] * 8, 4) == [2, 2, 2, 2]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    # ties: the later cut wins, leaving the last stage lighter
    assert balance([1, 1, 1], 2) == [2, 1]
    assert balance([3.0], 1) == [1]
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        balance([1, 1, 1], 4)
    with pytest.raises(ValueError, match="non-negative"):
        balance([1, -1], 2)


def test_blip_flops_split_beats_even_split():
    """Predicted costs: an encoder layer costs over twice a decoder layer, so the balanced
    pp=2 split moves a decoder-heavy boundary forward."""
    for name, even in (("blip-tiny", [4, 4]), ("blip-base", [12, 12])):
        spec = resolve_blip(name)
        costs = blip_layer_costs(spec, "flops")
        assert costs == [float(f) for f in layer_flops(spec)]
        counts = balance(costs, 2)
        assert counts[0] < spec.enc_layers
        assert max(stage_costs(costs, counts)) < 0.8 * max(stage_costs(costs, even))


@contextlib.contextmanager
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def spin(seconds: float) -> None:
    """Busy for `seconds` of this thread's CPU time (so of wall time too): what the profile's
    clocks, CPU or wall, both see."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass


class Layer:
    """A stand-in layer that computes for `pauses[call]` seconds on its n-th call."""

    def __init__(self, *pauses):
        self.pauses, self.calls = pauses, 0

    def __call__(self, **inputs):
        import torch

        spin(self.pauses[min(self.calls, len(self.pauses) - 1)])
        self.calls += 1
        x = inputs.get("x")
        return {"x": torch.ones(2, requires_grad=True) * 2 if x is None else x * 2}


def chain_ios(n):
    from commpipe.models.boundary import StageIO, TensorDesc

    x = (TensorDesc("x", (2,), "float32"),)
    return [StageIO(i, range(i, i + 1), (), x if i else (), x if i < n - 1 else ())
            for i in range(n)]


def test_measured_costs_time_each_layer():
    """A layer that computes 30 ms is measured at least that long and the cheap ones less; the
    real blip-tiny profile gives one positive cost per layer."""
    layers = [Layer(0.0), Layer(0.03), Layer(0.0)]
    # the wall clock (several threads): 30 ms of CPU time take at least 30 ms, whatever else
    # runs; the cheap layers' wall time is not bounded on a loaded host (a time slice given to
    # another process lands in it), so they are compared on the CPU-time clock below
    costs = measure_layer_costs(layers, chain_ios(3), {}, lambda out, d: out["x"].sum(), repeats=2)
    assert costs[1] >= 0.03
    with one_thread():
        costs = measure_layer_costs(layers, chain_ios(3), {}, lambda out, d: out["x"].sum(),
                                    repeats=2)
    assert costs[1] >= 0.03 and costs[0] < 0.03 and costs[2] < 0.03

    spec = resolve_blip("blip-tiny")
    with one_thread():   # two OpenMP threads on two busy cores take seconds per layer
        measured = blip_layer_costs(spec, "measured", micro_batch=2, repeats=1, warmup=0)
    assert len(measured) == spec.layers and all(c > 0 for c in measured)
    assert len(stage_io(spec, balance(measured, 2), 2)) == 2
    with pytest.raises(ValueError, match="'flops' or 'measured'"):
        blip_layer_costs(spec, "guessed")
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure_layer_costs([Layer(0.0)], chain_ios(1), {}, lambda out, d: out["x"].sum(),
                            repeats=0)


def test_measured_costs_skip_warmup_and_outliers():
    """Slow first calls (one to chain the inputs, two warm-up rounds) are not timed, and one
    slow round out of five (another process taking the core) does not move the median: the
    layer is measured at its usual 10 ms, not the 60 ms of the outlier."""
    first, usual, outlier = 0.06, 0.01, 0.06
    layer = Layer(first, first, first, usual, usual, outlier, usual, usual)
    with one_thread():   # the CPU-time clock: other processes' load does not count
        costs = measure_layer_costs([Layer(0.0), layer], chain_ios(2), {},
                                    lambda out, d: out["x"].sum(), repeats=5, warmup=2)
    assert layer.calls == 8
    assert usual <= costs[1] < usual + 0.008, costs
