"""The adaptive demo without a launch: its flags, the emulated device it passes on, the report
figure, the oracle's candidates, and the summary's criteria and words.

    python -m pytest tests/test_adapt_demo.py -q
"""

from __future__ import annotations

import json

import pytest

from commpipe.layout import Layout

# -- the demo's flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, said", [
    (["--cluster", "local"], "--cluster local is for the layout demo"),
    (["--steps", "4"], "--steps is for the layout demo"),
    (["--inter-node-mbit", "200", "--steps", "4"], "--steps, --inter-node-mbit are for the layout demo"),
])
def test_the_adaptive_demo_refuses_the_layout_demos_flags(tmp_path, capsys, flags, said):
    """`demo --adaptive` runs a fixed scenario on the emulated cluster: the layout demo's flags
    are refused before anything starts, not silently ignored."""
    from commpipe.cli import main

    assert main(["demo", "--adaptive", "--out", str(tmp_path / "d"), *flags]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flags, said", [
    (["--emulate-device", "2"], "--emulate-device is for the adaptive demo alone"),
    (["--adaptive", "--elastic", "--emulate-device", "2"], "without --elastic"),
    (["--adaptive", "--emulate-device", "0.5"], "a finite factor >= 1"),
    (["--adaptive", "--emulate-device", "inf"], "a finite factor >= 1"),
])
def test_the_demos_refuse_an_emulated_device_they_cannot_use(tmp_path, capsys, flags, said):
    from commpipe.cli import main

    assert main(["demo", "--out", str(tmp_path / "d"), *flags]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_the_adaptive_demo_passes_an_emulated_device_to_every_run():
    """`demo --adaptive --emulate-device F`: the flags every run (adaptive, static, oracle) is
    given carry --emulate-device F, and the time limits grow with it; at 1 nothing is added."""
    from commpipe.adapt.demo import Scenario
    from commpipe.cluster.launch import train_flags

    plain, emulated = Scenario(), Scenario(emulate_device=3.0)
    assert "emulate_device" not in plain.train_flags() and plain.timeout_s(300) == 300
    flags = emulated.train_flags(adapt=True)
    assert flags["emulate_device"] == 3.0 and flags["adapt"] and flags["steps"] == 60
    assert emulated.timeout_s(300) == 900
    argv = train_flags(Layout(dp=4), flags, "out")
    assert argv[argv.index("--emulate-device") + 1] == "3.0"


def test_the_demos_runs_train_with_the_emulated_device_and_its_time_limit(tmp_path,
                                                                        monkeypatch):
    """run_scenario (the adaptive and the static run) hands every rank `train_flags()` and the
    stretched time limit; a run that went back to `sc.train` would lose --emulate-device."""
    import commpipe.cluster.launch as launch
    from commpipe.adapt.demo import Scenario, run_scenario

    seen = {}

    class Done:
        ok = True

    class FakeCluster:
        nodes, ranks_per_node, ifname = 2, 2, "veth"

        def node_ip(self, i):
            return f"10.0.0.{i + 1}"

        def set_rate(self, node, mbit):
            seen.setdefault("rates", []).append(mbit)

    monkeypatch.setattr(launch, "plan_commands",
                        lambda lay, train, out, **kw: seen.update(train=train) or ["cmd"])
    monkeypatch.setattr(launch, "run_commands",
                        lambda cmds, out, cluster=None, timeout_s=0.0:
                        seen.update(timeout=timeout_s) or Done())
    run_scenario(FakeCluster(), Scenario(emulate_device=3.0), tmp_path, {"dp": 4}, True, [], 29999)
    assert seen["train"]["emulate_device"] == 3.0 and seen["train"]["adapt"] is True
    assert seen["timeout"] == 900
    run_scenario(FakeCluster(), Scenario(), tmp_path, {"dp": 4}, False, [], 29999)
    assert "emulate_device" not in seen["train"] and seen["timeout"] == 300


# -- report ----------------------------------------------------------------------------------------


def test_report_draws_step_time_with_degrade_and_switch(tmp_path):
    from commpipe.report.adaptive import degrade_steps, step_time_figure

    run = tmp_path / "adaptive"
    run.mkdir()
    rows = [{"step": s, "step_time_s": 0.1 if s < 5 or s > 9 else 0.3,
             "layout": "tp1-cp1-pp2-dp1 1f1b m4x1" + (" layers 3,1" if s > 9 else "")}
            for s in range(15)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert step_time_figure(run, tmp_path / "none.png") is None      # not an adaptive run
    (run / "adapt.jsonl").write_text(json.dumps({"step": 9, "action": "switch",
                                                 "switch_time_s": 0.2}) + "\n")
    (tmp_path / "scenario.json").write_text(json.dumps({"degrade_step": 5, "link": "node 1",
                                                        "blip_steps": [2]}))
    assert degrade_steps(run) == [(5, "degrade node 1"), (2, "blip (1 step)")]
    path, caption = step_time_figure(run, tmp_path / "fig.png")
    assert path.stat().st_size > 10_000 and "switches (1)" in caption


# -- the demo's oracle and criteria (no launch) ----------------------------------------------------

def test_oracle_candidates_are_every_admitted_layout_with_even_and_balanced_splits():
    from commpipe.adapt.demo import MODEL
    from commpipe.adapt.oracle import candidate_layouts

    train = {"model": MODEL, "seq_len": 32, "global_batch": 8, "seed": 0, "steps": 60}
    found, rejected = candidate_layouts(train, 4)
    # every (tp, cp, pp, dp) with product 4, written out by hand; tp 4 cannot split 2 KV heads
    every = {(1, 1, 1, 4), (1, 1, 2, 2), (1, 1, 4, 1), (1, 2, 1, 2), (1, 2, 2, 1), (1, 4, 1, 1),
             (2, 1, 1, 2), (2, 1, 2, 1), (2, 2, 1, 1), (4, 1, 1, 1)}
    got = {(c["tp"], c["cp"], c["pp"], c["dp"]) for c in found}
    assert got == every - {(4, 1, 1, 1)} and len(found) == len(got)   # head cost: even = balanced
    assert [(r["tp"], "KV heads" in r["reason"]) for r in rejected] == [(4, True)]
    for c in found:
        assert c["stage_layers"] == {1: [4], 2: [2, 2], 4: [1, 1, 1, 1]}[c["pp"]]
        assert c["schedule"] == "1f1b" or c["pp"] == 1
        assert "--steps" in c["flags"] and c["flags"][c["flags"].index("--steps") + 1] == "60"
    # a head worth ~50 layers (vocab 32000, hidden 64): the balanced split puts 3 layers
    # before it, and both splits are measured
    big = "arch=llama,layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=128,vocab=32000"
    found, _ = candidate_layouts({**train, "model": big}, 2)
    pp2 = [(c["stage_layers"], c["split"]) for c in found if c["pp"] == 2]
    assert pp2 == [([2, 2], "even"), ([3, 1], "balanced")]


def test_oracle_candidates_of_a_moe_model_come_at_every_expert_parallel_size():
    """A MoE model's layouts at each ep dividing both dp x cp and the expert count, written out
    by hand (4 experts): dp4 at ep 1, 2, 4; pp2 x dp2 and tp2 x dp2 at ep 1, 2; none with cp
    (the trainer refuses cp for MoE), each with its own --ep flag."""
    from commpipe.adapt.oracle import candidate_layouts

    moe = ("arch=moe,layers=4,hidden=64,heads=4,kv_heads=2,vocab=256,experts=4,top_k=2,"
           "expert_ffn=128")
    # an ep in the shared flags (the run's own) does not override each candidate's
    found, rejected = candidate_layouts({"model": moe, "seq_len": 32, "global_batch": 8,
                                         "steps": 10, "ep": 2}, 4)
    got = {(c["tp"], c["cp"], c["pp"], c["dp"], c["ep"]) for c in found}
    assert got == {(1, 1, 1, 4, 1), (1, 1, 1, 4, 2), (1, 1, 1, 4, 4), (1, 1, 2, 2, 1),
                   (1, 1, 2, 2, 2), (2, 1, 1, 2, 1), (2, 1, 1, 2, 2), (1, 1, 4, 1, 1),
                   (2, 1, 2, 1, 1)}
    assert len({c["name"] for c in found}) == len(found)
    for c in found:
        flags = c["flags"]
        assert (flags[flags.index("--ep") + 1] == str(c["ep"])) if c["ep"] > 1 else "--ep" not in flags
    assert all(r["cp"] > 1 or r["tp"] == 4 for r in rejected)


def _summary_inputs(tmp_path, after_ms: float, static_ms: float, chosen: tuple):
    """Synthetic adaptive/static runs (degrade at 10, switch at 12) and an oracle record."""
    def write(name, times, loss_shift=0.0):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "step_time_s": t / 1e3, "loss": 5.0 - 0.01 * s + loss_shift})
            + "\n" for s, t in enumerate(times)))

    write("adaptive", [100] * 10 + [900] * 2 + [after_ms] * 18)
    write("static", [100] * 10 + [static_ms] * 20, 3e-6)
    to = {"tp": 1, "cp": chosen[0], "pp": 2, "dp": chosen[1], "stage_layers": [2, 2],
          "name": "chosen"}
    (tmp_path / "adaptive" / "adapt.jsonl").write_text(
        json.dumps({"step": 3, "action": "stay", "detections": [{"key": "rank 0", "onset_step": 0}]})
        + "\n" + json.dumps({"step": 12, "action": "switch", "to": to, "switch_time_s": 0.1,
                             "detections": [{"key": "pp 0->2", "onset_step": 10}]}) + "\n")
    cands = [{"name": n, "tp": 1, "cp": cp, "pp": 2, "dp": dp, "stage_layers": [2, 2],
              "split": "even", "median_ms": ms, "steps_measured": 8, "stopped_early": False,
              "losses": [5.0 - 0.01 * s for s in range(10)]}
             for n, cp, dp, ms in (("pp2-dp2", 1, 2, 200.0), ("cp2-pp2", 2, 1, 300.0))]
    return {"best": cands[0], "candidates": cands, "sweep_s": 90.0}


def test_each_oracle_layout_is_set_beside_the_controllers_prediction_for_it(tmp_path):
    """The demo compares what the oracle measured for a layout with what the reacting decision
    predicted for that very layout: same degrees, split, schedule and micro-batching."""
    from commpipe.adapt.demo_summary import format_summary, predicted_for

    decision = {"candidates": [
        {"plan": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2 ranks tp-cp-pp-dp", "predicted_ms": 300.0},
        {"plan": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2 dp-m 6,2", "predicted_ms": 310.0},
        {"plan": "tp1-cp1-pp2-dp2 zbh1 m2x2 layers 2,2", "predicted_ms": 450.0},
        {"plan": "tp1-cp1-pp2-dp2 1f1b m2x2 layers 2,2", "predicted_ms": 515.0},
        {"plan": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2", "predicted_ms": 642.0},
        {"plan": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 3,1", "predicted_ms": 700.0},
        {"plan": "tp2-cp1-pp2-dp1 1f1b m8x1 layers 2,2", "predicted_ms": 900.0}]}
    oracle = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "stage_layers": [2, 2], "schedule": "1f1b",
              "microbatches": 4, "micro_batch_size": 1}
    assert predicted_for(decision, oracle) == 642.0    # not another rank order, nor dp-m
    assert predicted_for(decision, {**oracle, "microbatches": 8}) is None      # not logged
    assert predicted_for(decision, {**oracle, "stage_layers": [3, 1]}) == 700.0
    assert predicted_for(decision, {**oracle, "tp": 2, "dp": 1, "microbatches": 8}) == 900.0
    assert predicted_for(None, oracle) is None
    # under expert parallelism the title carries the ep: each ep its own prediction
    moe = {"candidates": [{"plan": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2", "predicted_ms": 80.0},
                          {"plan": "ep2-tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2", "predicted_ms": 95.0}]}
    assert predicted_for(moe, oracle) == 80.0
    assert predicted_for(moe, {**oracle, "ep": 2}) == 95.0
    from commpipe.adapt.demo_summary import _layout_key, _name_key

    assert _name_key(moe["candidates"][1]["plan"]) == _layout_key({**oracle, "ep": 2}) \
        != _name_key(moe["candidates"][0]["plan"])
    # the account prints it beside the oracle's measurement
    from commpipe.adapt.demo import Scenario
    from commpipe.adapt.demo_summary import summarize

    oracle = _summary_inputs(tmp_path, after_ms=220.0, static_ms=1000.0, chosen=(1, 2))
    s = summarize(tmp_path, Scenario(steps=30, blip=(4, 5), degrade_step=10),
                  [(4, 20.0), (5, 1000.0), (10, 20.0)], oracle)
    s["elapsed_s"] = 300.0
    assert [c["predicted_ms"] for c in s["oracle_candidates"]] == [None, None]   # none logged
    s["oracle_candidates"][0]["predicted_ms"] = 250.0
    lines = format_summary(s).splitlines()
    assert any(x.lstrip().startswith("pp2-dp2") and x.endswith(
        "200 ms; the controller predicted 250 ms (measured/predicted 0.80)") for x in lines)
    assert not any("predicted" in x for x in lines if x.lstrip().startswith("cp2-pp2"))


def test_demo_summary_checks_the_criteria_against_the_measured_oracle(tmp_path):
    from commpipe.adapt.demo import Scenario
    from commpipe.adapt.demo_summary import criteria, format_summary, summarize

    sc = Scenario(steps=30, blip=(4, 5), degrade_step=10)
    applied = [(4, 20.0), (5, 1000.0), (10, 20.0)]
    oracle = _summary_inputs(tmp_path, after_ms=220.0, static_ms=1000.0, chosen=(1, 2))
    s = summarize(tmp_path, sc, applied, oracle)
    s["elapsed_s"] = 300.0
    assert (s["switch_delay_steps"], s["step_ms_after_switch"], s["step_ms_oracle"]) == (2, 220, 200)
    assert s["detection_delay_steps"] == 2 and s["switches_before_degrade"] == 0
    assert s["controller_choice_is_best"] and s["static_vs_oracle"] == pytest.approx(4.0)
    assert s["max_loss_diff_adaptive_vs_static"] == pytest.approx(3e-6)
    assert [ok for _, ok, _ in criteria(s)] == [True] * 6
    text = format_summary(s)
    assert "the controller reached the best static layout, pp2-dp2 (200 ms)" in text
    # the controller picked the slower layout, too slow after the switch, static not slow
    # enough, a demo over 8 minutes: each criterion fails on its own
    bad = tmp_path / "bad"
    bad.mkdir()
    oracle = _summary_inputs(bad, after_ms=300.0, static_ms=240.0, chosen=(2, 1))
    s = summarize(bad, sc, applied, oracle)
    s["elapsed_s"] = 500.0
    assert not s["controller_choice_is_best"] and s["controller_choice_ms"] == 300.0
    verdict = {what: ok for what, ok, _ in criteria(s)}
    assert [k for k, ok in verdict.items() if not ok] == [
        "after the switch within 15% of the oracle",
        "static at least 25% slower than the oracle after the degrade",
        "whole demo under 8 minutes"]
    assert "it ended on chosen (300 ms in the oracle sweep)" in format_summary(s)


def test_demo_summary_takes_the_layout_the_trials_settled_on(tmp_path):
    from commpipe.adapt.demo import Scenario
    from commpipe.adapt.demo_summary import criteria, format_summary, summarize

    sc = Scenario(steps=30, blip=(4, 5), degrade_step=10)
    applied = [(4, 20.0), (5, 1000.0), (10, 20.0)]
    # the switch at 12 goes to cp2 x pp2 (300 ms) for a trial; the phase settles at 20 on
    # pp2 x dp2: the median counts from step 22 only
    oracle = _summary_inputs(tmp_path, after_ms=300.0, static_ms=1000.0, chosen=(2, 1))
    rows = [json.loads(x) for x in (tmp_path / "adaptive" / "metrics.jsonl").read_text()
            .splitlines()]
    for r in rows[20:]:
        r["step_time_s"] = 0.21
    (tmp_path / "adaptive" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pp2dp2 = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "stage_layers": [2, 2], "name": "pp2-dp2"}
    with open(tmp_path / "adaptive" / "adapt.jsonl", "a") as f:
        for d in ({"step": 16, "action": "trial", "plan": "cp2-pp2", "predicted_ms": 250.0,
                   "measured_ms": 300.0, "to": pp2dp2},
                  {"step": 20, "action": "trial", "plan": "pp2-dp2", "predicted_ms": 260.0,
                   "measured_ms": 210.0},
                  {"step": 20, "action": "settle", "to": pp2dp2, "measured_ms": 210.0}):
            f.write(json.dumps(d) + "\n")
    s = summarize(tmp_path, sc, applied, oracle)
    s["elapsed_s"] = 300.0
    assert s["switch_to"] == "pp2-dp2" and s["controller_choice_is_best"]
    assert s["step_ms_after_switch"] == 210 and s["settle_step"] == 20
    assert [ok for _, ok, _ in criteria(s)] == [True] * 6
    assert "cp2-pp2 250 -> 300 ms; pp2-dp2 260 -> 210 ms" in format_summary(s)


def test_outcome_says_when_the_best_layout_ran_with_other_batching():
    """Reaching the oracle's degrees and split under another schedule or micro-batching is said
    as such, not as "the best static layout" the oracle measured (1f1b, default batching)."""
    from commpipe.adapt.demo_summary import outcome

    s = {"after_switch_vs_oracle": -0.05, "static_vs_oracle": 2.0, "oracle_layout": "pp2-dp2",
         "step_ms_oracle": 200.0, "step_ms_after_switch": 190.0, "step_ms_degraded_static": 600.0,
         "controller_choice_is_best": True, "controller_batching_differs": False,
         "switch_to": "pp2-dp2 1f1b m2x2"}
    assert outcome(s)[0].startswith("the controller reached the best static layout, pp2-dp2 (200 ms)")
    s |= {"controller_batching_differs": True, "switch_to": "pp2-dp2 zbh1 m2x2"}
    line = outcome(s)[0]
    assert line.startswith("the controller reached the best static layout's degrees and split, "
                           "pp2-dp2 (200 ms), running them as pp2-dp2 zbh1 m2x2")
    assert "after the switch its steps took 190 ms (-5%)" in line
