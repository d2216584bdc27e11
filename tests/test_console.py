"""What a user reads on the console: errors under torchrun, the start banner and end summary,
the adaptive controller's lines, validation losses, --help defaults, `plan` and `cluster status`.

    python -m pytest -q tests/test_console.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- errors under torchrun -------------------------------------------------------------------------

def test_bad_layout_under_torchrun_is_reported_once_at_the_end(tmp_path):
    """Every rank meets the bad flag; one reports it, in torchrun's summary (the job's last
    block), and the job fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "--", "commpipe", "train", "--tp", "3", "--pp", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    message = "commpipe train: error: tp=3 does not divide 4 attention heads; use tp in {1, 2}"
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count(message) == 1, out
    # the message closes the output: in the root-cause block, after every other failure
    tail = out.rstrip().splitlines()
    at = next(i for i, line in enumerate(tail) if message in line)
    assert "Root Cause" in "\n".join(tail[:at]) and len(tail) - at <= 3, out[-1500:]
    assert "exitcode  : 2" in out       # the reporting rank's own exit code


def test_error_goes_to_torchruns_error_file_from_one_rank(tmp_path, monkeypatch, capsys):
    from commpipe import errors
    from commpipe.cli import main

    monkeypatch.setattr(errors, "QUIET_EXIT_DELAY_S", 0.0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    files = []
    for local_rank in (0, 1):
        f = tmp_path / f"error{local_rank}.json"
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(f))
        assert main(["train", "--tp", "3", "--pp", "2"]) == 2
        files.append(f)
    import json

    got = json.loads(files[0].read_text())["message"]["message"]
    assert got.startswith("commpipe train: error: tp=3 does not divide")
    assert not files[1].exists()
    assert capsys.readouterr().err == ""     # torchrun prints it, nobody else
    # without torchrun: on stderr
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", "--tp", "3", "--pp", "2"]) == 2
    assert capsys.readouterr().err.count("tp=3 does not divide") == 1


# -- the start banner, the step lines and the end summary ----------------------------------------

def _metrics(out: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_opens_with_its_layout_and_model_and_closes_with_a_summary(tmp_path, capsys):
    import statistics

    from commpipe.cli import main
    from commpipe.models.llama import build_model
    from commpipe.models.spec import resolve_model
    from commpipe.train.console import format_ms

    out = tmp_path / "run"
    assert main(["train", "--steps", "4", "--out", str(out), "--seq-len", "64",
                 "--global-batch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # tiny: 4 layers, hidden 64, 4 heads (2 KV heads of 16), SwiGLU 128, vocab 256. Forward
    # FLOPs per token of a layer: QKV 2*64*(64+2*32) + scores and values 4*64*64 + output
    # 2*64*64 + MLP 2*3*64*128 = 90112; head 2*64*256 = 32768; x3 for forward and backward
    flops = 3 * (4 * 90112 + 32768)
    assert flops == 1_179_648
    params = sum(p.numel() for p in build_model(resolve_model("tiny")).parameters())
    assert lines[0] == ("commpipe: tp1-cp1-pp1-dp1 1f1b m2x1 on 1 rank (1 per node), "
                        "single process, cpu")
    assert lines[1] == (f"commpipe: model tiny: {params / 1e3:.3g}k parameters, 1.18 MFLOP per "
                        "token (forward + backward), fp32, global batch 2 x 64 tokens")
    assert lines[2] == "commpipe: no pipeline (pp 1), 2 micro-batches of 1"
    # the end: the median of the steps after the first, from the metrics file
    recs = _metrics(out)
    med = statistics.median(r["step_time_s"] for r in recs[1:])
    tok_s = 2 * 64 / med
    summary = [x for x in lines if x.startswith("commpipe: 4 steps")]
    assert len(summary) == 1 and f"median {format_ms(med * 1e3)} per step" in summary[0]
    assert f"{tok_s:,.0f} tok/s" in summary[0] and "(steps 1-3)" in summary[0]
    assert f"final loss {recs[-1]['loss']:.4f}" in summary[0]
    gflops = flops * 2 * 64 / med / 1e9
    assert f"{gflops:#.3g}".rstrip(".") + " GFLOP/s/GPU" in summary[0]
    assert lines[-1] == f"commpipe: files in {out}: metrics.jsonl, config.json"


def test_banner_gives_the_schedules_bubble():
    from types import SimpleNamespace

    import torch

    from commpipe.parallel.dims import ParallelDims
    from commpipe.train.config import TrainConfig
    from commpipe.train.console import banner

    cfg = TrainConfig(model="tiny", dims=ParallelDims(pp=2), schedule="1f1b", microbatches=4,
                      seq_len=32).resolve(2)
    lines = banner(cfg, SimpleNamespace(backend="gloo"), torch.device("cpu"))
    # 1F1B and GPipe idle (p-1)/(m+p-1) of the step: 1/5 with p=2, m=4
    assert lines[2] == ("commpipe: schedule 1f1b, pp 2 x 4 micro-batches of 1: bubble 20% "
                        "(simulated with f=1, b=2 per stage)")
    assert lines[0].endswith("on 2 ranks (2 per node), gloo, cpu")


def test_rates_and_times_keep_three_significant_digits():
    from commpipe.train.console import format_flops, format_ms, format_rate, format_step

    assert format_flops(0.0001e12) == "0.100 GFLOP/s"        # never 0.0001 TFLOP/s
    assert format_flops(0.6e9) == "0.600 GFLOP/s"
    assert format_flops(668.6e12) == "669 TFLOP/s"
    assert format_flops(12e6) == "0.0120 GFLOP/s"
    assert [format_ms(x) for x in (0.2266, 31.04, 5906.0, 23590.2)] == \
        ["0.227 ms", "31.0 ms", "5906 ms", "23,590 ms"]
    assert format_rate(0.00172) == "1.72 MB/s" and format_rate(12.46) == "12.5 GB/s"
    rec = {"step": 7, "loss": 5.25, "step_time_s": 0.031, "tokens_per_s": 4129.0,
           "tflops_per_gpu": 4.87e-3, "lr": 3e-3, "layout": "tp1-cp1-pp2-dp1 zbh1 m2x2"}
    line = format_step(rec, start_layout="tp1-cp1-pp2-dp1 1f1b m4x1")
    assert "| 4.87 GFLOP/s/GPU |" in line and line.endswith("| tp1-cp1-pp2-dp1 zbh1 m2x2")
    assert not format_step(rec, start_layout=rec["layout"]).endswith("m2x2")


def test_validation_losses_are_printed_when_eval_and_log_steps_differ(tmp_path, capsys):
    from commpipe.cli import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "6", "--eval-every", "2", "--log-every", "4",
                 "--eval-batches", "1", "--out", str(out), "--seq-len", "16",
                 "--global-batch", "2"]) == 0
    printed = capsys.readouterr().out
    vals = [(r["step"], r["val_loss"]) for r in _metrics(out) if "val_loss" in r]
    assert [s for s, _ in vals] == [1, 3, 5]        # after steps 2, 4 and 6 (the last)
    for step, val in vals:                          # 1 and 3 fall between the logged steps
        assert any(x.startswith(f"step {step:>5} |") and f"| val {val:.4f}" in x
                   for x in printed.splitlines()), (step, printed)


# -- the adaptive controller's lines ----------------------------------------------------------------

A = {"name": "tp1-cp1-pp2-dp1 1f1b m4x1 layers 2,2"}
B = {"name": "tp1-cp1-pp2-dp1 zbh1 m4x1 layers 3,1"}


def test_each_decision_log_record_becomes_console_lines():
    from commpipe.adapt.describe import record_lines

    det = {"kind": "link", "key": "dp [0, 2]", "baseline": 20.0, "current": 80.0, "shift": 3.0,
           "onset_step": 10, "step": 14, "nodes": [0, 1], "link_class": "inter_node"}
    switch = {"step": 14, "action": "switch", "detections": [det], "from": A, "to": B,
              "kind": "resplit", "predicted_current_ms": 400.0, "predicted_best_ms": 300.0,
              "reason": "saving 4.50 s over 45 steps >= 2 x switch cost 0.30 s (gain 25.0%)",
              "switch_time_s": 0.21}
    lines = record_lines(switch)
    assert lines[0] == ("adapt: step 14: detected link dp [0, 2] (inter-node, nodes 0-1): "
                        "20 ms -> 80 ms (+300%) since step 10")
    # (400 - 300) / 400 = 25% less per step
    assert lines[1] == ("adapt: step 14: switch to " + B["name"] + " (resplit): predicted "
                        "400 ms -> 300 ms per step (25% less); " + switch["reason"]
                        + "; took 0.21 s")
    stay = switch | {"action": "stay", "reason": "predicted gain 2.0% is below the minimum 5%",
                     "predicted_best_ms": 392.0, "detections": []}
    stay.pop("switch_time_s")
    assert record_lines(stay) == [
        "adapt: step 14: stay on " + A["name"] + ": predicted gain 2.0% is below the minimum 5%; "
        "best candidate " + B["name"] + ", predicted 400 ms -> 392 ms per step (2% less)"]
    slower = stay | {"predicted_best_ms": 440.0, "reason": "predicted gain -10.0% is below the "
                     "minimum 5%"}    # the best candidate predicted slower: 10% more, not -10% less
    assert record_lines(slower)[0].endswith("predicted 400 ms -> 440 ms per step (10% more)")
    trial = {"step": 18, "action": "trial", "plan": B["name"], "predicted_ms": 300.0,
             "measured_ms": 416.4, "to": A}
    assert record_lines(trial) == [f"adapt: step 18: trial of {B['name']}: predicted 300 ms, "
                                   f"measured 416 ms; next {A['name']}"]
    pruned = trial | {"dropped": ["p1", "p2"]}
    assert record_lines(pruned) == [f"adapt: step 18: trial of {B['name']}: predicted 300 ms, "
                                    "measured 416 ms; dropped 2 that cannot beat the fastest "
                                    f"measured: p1, p2; next {A['name']}"]
    recheck = stay | {"recheck": True}
    assert record_lines(recheck)[0] == f"adapt: step 14: re-check of {A['name']} on its own baselines"
    assert record_lines(recheck)[1:] == record_lines(stay)
    probed = switch | {"probed": {"seconds": 0.078, "links": {
        "0->2": {"latency_ms": 0.21, "gbps": 0.1177}}}}
    assert record_lines(probed) == [lines[0], "adapt: step 14: measured link 0->2 (no rate from "
                                    "the run's own transfers): 0.118 GB/s, latency 0.21 ms, in "
                                    "0.08 s", lines[1]]
    timed = switch | {"probed": {"call_ms": 0.83}}
    assert record_lines(timed) == [lines[0], "adapt: step 14: a gloo collective call after "
                                   "compute (ranks 0-1) costs 0.83 ms beyond its link, added to "
                                   "each TP and CP call a candidate makes (timed at the start)",
                                   lines[1]]
    host = {"step": -1, "action": "host", "op_work": 253138.0, "op_work_seconds": 0.21,
            "calls": {"all_reduce": {"mean_ms": 1.25, "median_ms": 0.71},
                      "all_gather": {"mean_ms": 0.62, "median_ms": 0.37}},
            "call_bytes": 8192, "calls_seconds": 0.16}
    assert record_lines(host) == ["adapt: before step 0: measured this host for pricing "
                                  "candidates: a gloo collective call after compute (ranks 0-1) "
                                  "took all-reduce 1.25 ms, all-gather 0.62 ms (mean); issuing "
                                  "an eager op takes as long as 2.53e+05 FLOPs of compute; in "
                                  "0.37 s"]
    settle = {"step": 22, "action": "settle", "to": A, "measured_ms": 232.0, "kind": "resplit",
              "reason": "fastest measured (the plan before the trials)", "trial_cost_s": 2.74}
    assert record_lines(settle) == [f"adapt: step 22: settled on {A['name']} at 232 ms, fastest "
                                    "measured (the plan before the trials), switched (resplit); "
                                    "the trials cost 2.74 s"]


def test_adaptive_run_prints_its_decisions_and_the_new_layout(tmp_path):
    """The slow-rank drill under torchrun: every adapt.jsonl record is on the console, printed
    once, and after a switch the step lines name the layout that ran them."""
    import json

    from commpipe.adapt.describe import record_lines

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "--", "commpipe", "train", "--pp", "2", "--steps", "40", "--seq-len", "32",
           "--out", str(out), "--adapt", "--slow-rank", "1:4@6", "--adapt-min-steps", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    records = [json.loads(x) for x in (out / "adapt.jsonl").read_text().splitlines()]
    assert records, "the drill produced no decision"
    expected = [x for r in records for x in record_lines(r)]
    assert [x for x in lines if x.startswith("adapt:")] == expected
    metrics = {r["step"]: r["layout"] for r in _metrics(out)}
    start = metrics[0]
    for x in lines:
        if x.startswith("step "):
            layout = metrics[int(x.split("|")[0].split()[1])]
            assert x.endswith(f" | {layout}") if layout != start else "tp1-" not in x, x
    assert any(metrics[s] != start for s in metrics), "no switch: nothing to show"


# -- --help, `plan` ---------------------------------------------------------------------------------

def test_train_help_shows_the_defaults(capsys):
    import pytest

    from commpipe.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())       # argparse wraps lines
    for flag, default in (("--steps STEPS", "10"), ("--seq-len SEQ_LEN", "64"),
                          ("--lr LR", "0.003"), ("--micro-batch-size MICRO_BATCH_SIZE", "1"),
                          ("--seed SEED", "0")):
        assert f"{flag} (default: {default})" in text, flag
    assert "(default 1) (default" not in text              # said once where help said it


def test_plan_prints_milliseconds_plainly_and_no_schedule_without_a_pipeline(capsys):
    import re

    from commpipe.cli import main

    assert main(["plan", "--model", "llama3-70b", "--gpus", "64", "--global-batch", "256",
                 "--seq-len", "8192", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\de[+-]\d", out), out             # no exponents
    assert re.search(r"compute \d{2},\d{3} ms per step", out)
    for line in out.splitlines():                             # pp=1 layouts name no schedule
        if "PP1 " in line:
            assert not re.search(r"PP1 DP\d+ mbs\d+ (1f1b|gpipe|zbh1)", line), line
    assert main(["plan", "--model", "tiny", "--gpu", "a100-80gb", "--gpus", "4",
                 "--global-batch", "8", "--seq-len", "64"]) == 0
    rows = [x.split() for x in capsys.readouterr().out.splitlines() if re.match(r"\s*\d+\s+\d", x)]
    assert rows and all((r[7] == "-") == (r[3] == "1") for r in rows)   # pp column, schedule column
    assert main(["plan", "--model", "blip-tiny", "--gpus", "4", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "GiB" not in out and " GB" in out
    pp1 = [x for x in out.splitlines() if " pp1 " in x]
    assert pp1 and all(re.search(r" x\d+ -\s+split", x) for x in pp1), pp1


def test_cluster_status_is_a_table_per_node(capsys):
    import json

    import pytest

    from commpipe.cli import main
    from commpipe.cluster import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(why)
    prefix = "cst"
    try:
        assert main(["cluster", "up", "--nodes", "2", "--ranks-per-node", "1",
                     "--inter-node-mbit", "100", "--prefix", prefix]) == 0
        assert main(["cluster", "rate", "--node", "1", "--inter-node-mbit", "20",
                     "--prefix", prefix]) == 0
        capsys.readouterr()
        assert main(["cluster", "status", "--prefix", prefix]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"cluster {prefix}: 2 nodes x 1 ranks per node")
        assert lines[1].split() == ["node", "namespace", "address", "link", "rate", "sent",
                                    "received", "state"]
        rows = [x.split() for x in lines[2:]]
        assert [(r[0], r[1], r[3] + " " + r[4], r[-1]) for r in rows] == [
            ("0", f"{prefix}n0", "100 Mbit/s", "up"), ("1", f"{prefix}n1", "20 Mbit/s", "up")]
        assert main(["cluster", "status", "--prefix", prefix, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["rates_mbit"] == [100.0, 20.0]
    finally:
        main(["cluster", "down", "--prefix", prefix])


# -- the adaptive demo's account --------------------------------------------------------------------

CP2 = {"tp": 1, "cp": 2, "pp": 2, "dp": 1, "stage_layers": [2, 2],
       "name": "tp1-cp2-pp2-dp1 1f1b m8x1 layers 2,2"}
DP2 = {"tp": 1, "cp": 1, "pp": 2, "dp": 2, "stage_layers": [2, 2],
       "name": "tp1-cp1-pp2-dp2 1f1b m4x1 layers 2,2"}
CANDS = [{"plan": CP2["name"], "predicted_ms": 250.0}, {"plan": DP2["name"], "predicted_ms": 260.0},
         {"plan": "tp2-cp1-pp2-dp1 1f1b m8x1 layers 2,2", "predicted_ms": 400.0}]


def _demo_account(tmp_path, records):
    """The demo's summary of synthetic runs (degrade at step 10; the oracle's best is pp2 x dp2
    at 200 ms, cp2 x pp2 300 ms) with `records` as the adaptive run's decision log."""
    import json

    from commpipe.adapt.demo import Scenario
    from commpipe.adapt.demo_summary import format_summary, summarize
    from tests.test_adapt_demo import _summary_inputs

    oracle = _summary_inputs(tmp_path, after_ms=300.0, static_ms=1000.0, chosen=(2, 1))
    (tmp_path / "adaptive" / "adapt.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records))
    s = summarize(tmp_path, Scenario(steps=30, blip=(4, 5), degrade_step=10),
                  [(4, 20.0), (5, 1000.0), (10, 20.0)], oracle)
    s["elapsed_s"] = 300.0
    text = format_summary(s)
    for word in ("PASS", "FAIL", "criteria", "issue"):
        assert word not in text
    return s, text


DETECTED = {"detections": [{"kind": "link", "key": "pp 0->2", "onset_step": 10}]}


def test_demo_says_why_the_model_missed_the_best_layout(tmp_path):
    switch = DETECTED | {"step": 12, "action": "switch", "to": CP2, "switch_time_s": 0.1,
                         "candidates": CANDS, "predicted_best_ms": 250.0}
    s, text = _demo_account(tmp_path, [switch])
    assert ("the controller did not reach the best static layout, pp2-dp2 (200 ms): it ended on "
            f"{CP2['name']} (300 ms in the oracle sweep); after the switch its steps took 300 ms "
            "(+50%); without the controller 1000 ms (+400%)") in text
    assert text.splitlines()[-2] == (
        f"why: the cost model predicted pp2-dp2 at 260 ms per step, number 2 of 3 candidates, "
        f"and chose {CP2['name']} 250 ms")


def test_demo_says_when_its_layout_ran_faster_than_the_oracles_best(tmp_path):
    """The oracle measures 1f1b at each layout's default micro-batching; the controller may
    end on another layout whose schedule or micro-batching beats them all."""
    from commpipe.adapt.demo_summary import format_summary

    switch = DETECTED | {"step": 12, "action": "switch", "to": CP2, "switch_time_s": 0.1,
                         "candidates": CANDS, "predicted_best_ms": 250.0}
    s, text = _demo_account(tmp_path, [switch])
    assert "ran faster than every layout" not in text            # 300 ms against 200
    assert not s["controller_batching_differs"]   # the same (unnamed) schedule and batching
    s["step_ms_after_switch"], s["after_switch_vs_oracle"] = 180.0, -0.1
    assert "ran faster than every layout" not in format_summary(s)
    s["controller_batching_differs"] = True
    assert ("(300 ms in the oracle sweep), and with its schedule and micro-batching ran faster "
            "than every layout the oracle measured (1f1b, default micro-batches); after the "
            "switch its steps took 180 ms (-10%)") in format_summary(s)


def test_demo_says_when_a_trial_measured_the_best_layout_slower(tmp_path):
    switch = DETECTED | {"step": 12, "action": "switch", "to": CP2, "switch_time_s": 0.1,
                         "candidates": CANDS, "trials": CANDS[:2]}
    records = [switch,
               {"step": 16, "action": "trial", "plan": CP2["name"], "predicted_ms": 250.0,
                "measured_ms": 240.0, "to": DP2},
               {"step": 20, "action": "trial", "plan": DP2["name"], "predicted_ms": 260.0,
                "measured_ms": 330.0},
               {"step": 20, "action": "settle", "to": CP2, "measured_ms": 240.0}]
    s, text = _demo_account(tmp_path, records)
    assert s["settle_step"] == 20 and not s["controller_choice_is_best"]
    assert ("why: its trial measured 330 ms against 240 ms for " + CP2["name"] + ", so the trials "
            "settled elsewhere (the oracle measured it at 200 ms)") in text


def test_demo_says_when_nothing_was_detected(tmp_path):
    s, text = _demo_account(tmp_path, [{"step": 3, "action": "stay", "detections": []}])
    assert s["controller_choice_is_best"] is None
    assert "the controller did not switch to another layout; without the controller 1000 ms" in text
    assert text.splitlines()[-2] == ("why: nothing was detected after the degrade, so the "
                                     "controller never re-planned")


def test_demo_fails_with_its_reason_and_a_non_zero_code(tmp_path, monkeypatch, capsys):
    from commpipe.cli import main
    from commpipe.cluster import netns

    monkeypatch.setattr(netns, "available", lambda: (False, "needs root and iproute2"))
    assert main(["demo", "--adaptive", "--out", str(tmp_path / "d")]) == 1
    assert capsys.readouterr().err.strip() == (
        "commpipe demo: error: the adaptive demo needs the emulated cluster: needs root and "
        "iproute2")


def test_demo_counts_a_reaction_whose_change_dates_from_before_settled_trials(tmp_path):
    """Trials before the degrade settle back on the start layout and restore its detector, runs
    of shifted steps included; the degrade then confirms a change dated from before it (as in a
    real run: switch at 20, settle back at 24, degrade at 26, switch at 30 with onset 20)."""
    start = {"tp": 1, "cp": 1, "pp": 1, "dp": 4, "stage_layers": [4],
             "name": "tp1-cp1-pp1-dp4 1f1b m2x1 layers 4"}
    records = [{"step": 6, "action": "switch", "to": CP2, "trials": CANDS[:1],
                "detections": [{"key": "rank 3", "onset_step": 2}], "switch_time_s": 0.1},
               {"step": 8, "action": "trial", "plan": CP2["name"], "predicted_ms": 250.0,
                "measured_ms": 400.0},
               {"step": 8, "action": "settle", "to": start, "measured_ms": 100.0},
               {"step": 12, "action": "switch", "to": DP2, "switch_time_s": 0.2,
                "candidates": CANDS, "detections": [{"key": "dp_cp [0, 1, 2, 3] all_reduce",
                                                      "onset_step": 6}]}]
    s, text = _demo_account(tmp_path, records)
    assert (s["detection_delay_steps"], s["first_switch_step"], s["switches_before_degrade"]) == \
        (2, 12, 1)
    assert "detected 2 steps later: dp_cp [0, 1, 2, 3] all_reduce (onset step 6)" in text
    assert "the controller reached the best static layout, pp2-dp2 (200 ms)" in text


def test_monitored_run_ends_with_the_reports_bandwidth_per_dimension_and_link_class(tmp_path):
    from commpipe.report.links import class_summary, link_rows
    from commpipe.train.console import format_rate

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "--", "commpipe", "train", "--pp", "2", "--steps", "4", "--seq-len", "16",
           "--global-batch", "4", "--comm-monitor", "all", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = class_summary(link_rows(out, warmup=1))       # the report's link-class table
    assert [(r["dim"], r["link_class"]) for r in rows] == [("pp", "intra_node")]
    r = rows[0]
    assert lines[-2] == (f"commpipe: measured bandwidth (median): PP intra-node "
                         f"{format_rate(r['gbps'])} ({r['transfer_ms']:#.3g}".rstrip(".")
                         + f" ms per call, {r['links']} links)")
    assert lines[-3] == f"commpipe: files in {out}: metrics.jsonl, config.json, monitor/"
    assert lines[-1] == f"commpipe: full report: commpipe report {out}"
