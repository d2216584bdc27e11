"""The split of a pass into a part fixed per micro-batch and a part that grows with it
(commpipe.plan.pass_split): the two-point solve by hand, and a real probe on a tiny model.

    python -m pytest tests/test_plan_pass_split.py -q
"""

from __future__ import annotations

import math

import pytest


def test_the_two_point_line_by_hand():
    from commpipe.plan.pass_split import solve

    # 3 ms at 1 sample, 6 ms at 4: 1 ms a sample, 2 ms fixed; 100 ops, 50 units of work a sample
    s = solve(3.0, 6.0, 1, 4, ops=100, work=50.0)
    assert s.op_ms == pytest.approx(0.02) and s.work_ms == pytest.approx(0.02)
    assert s.op_work == pytest.approx(1.0)
    # noise that makes the larger batch faster keeps each part at a hundredth of the pass
    flat = solve(3.0, 2.9, 1, 4, ops=100, work=50.0)
    assert flat.work_ms == pytest.approx(0.03 / 50) and flat.op_ms > 0


def test_the_probed_stage_counts_one_layer_and_the_head_only_when_it_is_last():
    from commpipe.models.family import family_for_model
    from commpipe.plan.pass_split import probe_work
    from commpipe.plan.runtime_ops import stage_ops

    spec = family_for_model("tiny").resolve("tiny")
    assert sum(stage_ops((1, spec.layers - 1), 0, "fp32")) == 102 + 179
    assert sum(stage_ops((1,), 0, "fp32")) == 102 + 179 + 21 + 42
    costs = __import__("commpipe.models.family", fromlist=["family_of"]).family_of(spec) \
        .layer_costs(spec, 16)
    assert probe_work(spec, 16, (1, 3)) == pytest.approx(costs[0] * 16)


def test_a_real_probe_of_a_tiny_model_finds_both_parts():
    """Timed on this host: both parts are positive and finite (their sizes are the host's),
    the global random state is left as it was, and a second call is the cached result."""
    import torch

    from commpipe.models.family import family_for_model
    from commpipe.plan.pass_split import measure

    spec = family_for_model("tiny").resolve("tiny")
    before = torch.random.get_rng_state()
    s = measure(spec, 16, budget_s=0.05)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert 0 < s.op_ms < math.inf and 0 < s.work_ms < math.inf
    assert measure(spec, 16, budget_s=0.05) is s


def test_a_model_too_large_to_probe_is_left_to_its_flops():
    """The demo's shape is probed; Llama 3 8B's (vocab 128,256, hidden 4,096: ~725M parameters
    in its embedding and one layer) is not built."""
    from commpipe.models.family import family_for_model
    from commpipe.plan.pass_split import MAX_PROBE_PARAMS, probe_params, worth_probing

    demo = family_for_model("arch=llama,layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=512,"
                            "vocab=256")
    small = demo.resolve("arch=llama,layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=512,"
                         "vocab=256")
    big = family_for_model("llama3-8b").resolve("llama3-8b")
    assert probe_params(small) == (256 + 12 * 128) * 128 and worth_probing(small)
    assert probe_params(big) == (128_256 + 12 * 4096) * 4096 > MAX_PROBE_PARAMS
    assert not worth_probing(big)
