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


def _cpu_job(seq_len=32):
    from commpipe.plan.cli_inputs import for_cluster
    from commpipe.plan.cluster import default_cluster
    from commpipe.plan.gpus import GPU
    from commpipe.plan.layout import Job

    cpu = GPU("cpu", 0.05, 64.0, 10.0, 10.0, 1.0)
    cluster = default_cluster(cpu, 4, 4)
    return for_cluster(Job(8, seq_len, precision="fp32"), cluster), cluster


def test_a_cpu_layer_at_its_measured_rate_by_hand():
    """With work_s set, a layer of the demo shape at micro-batch 2, tp 2: forward FLOPs per token
    2h(h + 2 kv) + 4sh + 2h^2 + 6hf = 2*64*(64+64) + 4*32*64 + 2*64^2 + 6*64*128 = 81,920;
    times 2 samples of 32 tokens, over tp 2: 2,621,440 units; at 1e-10 s each, 262.144 us for
    forward and backward, a third each (forward, input gradients, weight gradients). The head
    at micro-batch 2 and vocab 256 over tp 2: 2 * 64 tokens * 64 * 128 = 1,048,576 units,
    a third of them 34.95 us forward."""
    from dataclasses import replace

    from commpipe.models.spec import resolve_model
    from commpipe.plan.compute import head_compute, layer_compute
    from commpipe.plan.efficiency import Efficiency
    from commpipe.plan.layout import Layout

    spec = resolve_model("arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256")
    job, cluster = _cpu_job()
    lay = Layout(2, 1, 2, 1, 1, 2, "1f1b", "none")
    eff = Efficiency(overhead_s=0.0, op_s=5e-6, work_s=1e-10)
    lc = layer_compute(spec, lay, job, cluster, eff)
    assert lc["gemm"] == pytest.approx(262.144e-6 / 3) and lc["gemm_f"] == lc["gemm"]
    assert lc["attn"] == lc["elem"] == lc["elem_b"] == 0.0
    assert head_compute(spec, lay, job, cluster, eff)[0] == pytest.approx(34.952533e-6)
    # without a measured rate the GEMM curve prices the same layer: a different number
    assert layer_compute(spec, lay, job, cluster, replace(eff, work_s=0.0))["gemm"] \
        != pytest.approx(lc["gemm"])


def test_the_planner_measures_the_pass_only_where_commpipe_runs_it_on_a_cpu():
    """`plan --gpu cpu` on the demo shape takes both rates from the model's own layer; a GPU,
    another framework, bf16 (the probe runs fp32), a --profile that set work_s, and a shape too
    large to probe keep what they had."""
    from dataclasses import replace

    from commpipe.models.spec import resolve_model
    from commpipe.plan.efficiency import Efficiency
    from commpipe.plan.gpus import resolve_gpu
    from commpipe.plan.pass_split import planned_measure, with_measured_pass

    spec = resolve_model("arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256")
    job, cluster = _cpu_job()
    eff = Efficiency(overhead_s=0.0, op_s=5e-6)
    got = with_measured_pass(eff, spec, job, cluster.gpu)
    split = planned_measure(spec, 32)
    assert (got.op_s, got.work_s) == (split.op_ms / 1e3, split.work_ms / 1e3) and got.work_s > 0
    assert with_measured_pass(eff, spec, job, resolve_gpu("h100")) is eff
    assert with_measured_pass(eff, spec, replace(job, runtime="megatron"), cluster.gpu) is eff
    assert with_measured_pass(eff, spec, replace(job, precision="bf16"), cluster.gpu) is eff
    profiled = replace(eff, work_s=2e-10)
    assert with_measured_pass(profiled, spec, job, cluster.gpu) is profiled
    big = resolve_model("llama3-8b")
    assert with_measured_pass(eff, big, job, cluster.gpu) is eff


def test_estimate_on_a_cpu_says_what_it_measured_the_pass_at(capsys):
    """`estimate --gpu cpu` prints the measured rates it priced the pass with, and the line's
    numbers are the measurement's: us per op and training GFLOP/s (3 / work_s). No --precision:
    a CPU's default is fp32, what `commpipe train` runs there and what the pass is measured in."""
    import re

    from commpipe.cli import main
    from commpipe.models.spec import resolve_model
    from commpipe.plan.pass_split import planned_measure

    model = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"
    main(["estimate", "--model", model, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
          "--seq-len", "32", "--pp", "2"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU pass"))
    got = re.fullmatch(r"CPU pass measured on the model's first layer \(one thread\): ([\d.]+) us "
                       r"per eager op, its FLOPs at ([\d.]+) GFLOP/s .*", line)
    split = planned_measure(resolve_model(model), 32)
    assert got and float(got[1]) == pytest.approx(split.op_ms * 1e3, abs=0.05)
    assert float(got[2]) == pytest.approx(3 / (split.work_ms / 1e3) / 1e9, abs=0.05)


def test_a_pass_measured_on_a_busy_host_is_flagged(capsys, monkeypatch):
    """Other processes kept 1.5 of the host's cores busy while the pass was measured (over a
    tenth of them): `estimate` says so under the pass's line, and with --json on stderr, stdout
    staying one JSON object; an idle host's measurement gets no warning."""
    import json
    import os

    from commpipe.cli import main
    from commpipe.plan import pass_split

    model = "arch=llama,layers=8,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=256"
    argv = ["estimate", "--model", model, "--gpu", "cpu", "--gpus", "2", "--global-batch", "8",
            "--seq-len", "32", "--pp", "2", "--precision", "fp32"]
    cores = os.cpu_count()
    for others, warned in ((1.5 * cores / 2, True), (0.05 * cores, False), (None, False)):
        measured = pass_split.PassSplit(op_ms=0.01, work_ms=1e-7, other_cores=others)
        monkeypatch.setattr(pass_split, "measure", lambda *a, m=measured, **k: m)
        main(argv)
        out = capsys.readouterr().out
        assert ("warning: other processes kept" in out) == warned
        main(argv + ["--json"])
        got = capsys.readouterr()
        assert json.loads(got.out)["feasible"] is not None
        assert ("while the CPU pass was measured" in got.err) == warned
