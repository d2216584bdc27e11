"""Measured against predicted: a real traced 2-rank run, calibrated and simulated."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from commpipe.report.figures import load_events
from commpipe.schedules import Action
from commpipe.sim.compare import calibrate_run, compare_run, load_run, overlay_trace, tp_split


def test_traced_run_is_compared_with_its_simulation(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "commpipe", "train", "--preset", "tiny", "--pp", "2", "--schedule", "zbh1",
           "--microbatches", "4", "--seq-len", "16", "--steps", "2", "--out", str(out), "--trace"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, per_rank = load_run(out)
    # the trace holds exactly one step: every compute action of the program, once
    for events in per_rank.values():
        names = [e.name for e in events if e.stream == "compute"]
        assert len(names) == len(set(names)) == 4 * 3  # F, I, W per micro-batch
        assert {e.step for e in events} == {1}
    cmp = compare_run(out)
    # the cost table is the median of what was measured, stage by stage and op by op, plus
    # one host overhead per compute action, the same for every stage and op
    offsets = []
    for pp_rank, events in per_rank.items():
        for op, table in (("F", cmp.costs.f), ("I", cmp.costs.i), ("W", cmp.costs.w)):
            durs = [e.dur_ms for e in events
                    if e.stream == "compute" and Action.parse(e.name).op == op]
            offsets.append(table[pp_rank] - statistics.median(durs))
    assert min(offsets) >= 0 and max(offsets) - min(offsets) < 1e-9
    assert len(cmp.measured_busy) == len(cmp.predicted_busy) == 2
    assert cmp.predicted_makespan > 0 and cmp.measured_makespan > 0
    trace = json.loads(overlay_trace(cmp, tmp_path / "overlay.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {0, 1, 1000, 1001} <= pids


def test_measured_bubble_is_mean_idle_share():
    from commpipe.sim.compare import measured_bubble
    from commpipe.timeline import Event

    # window 0..4 ms; rank 0 computes 3 ms (idle 1/4), rank 1 computes 2 ms (idle 2/4);
    # communication intervals do not count as busy
    per_rank = {0: [Event(0, "compute", "0F0", 0, 2), Event(0, "compute", "0B0", 3, 4)],
                1: [Event(1, "compute", "1F0", 1, 3), Event(1, "pp", "1RECV_F0", 0, 1)]}
    assert measured_bubble(per_rank) == (0.25 + 0.5) / 2


def test_tp_run_prices_its_collectives_on_the_tp_stream(tmp_path):
    """A traced tp2 stp run with the monitor: plain passes' TP waits become `tp_comm`, their
    compute alone the stage costs, and the simulated braids hide collectives behind compute."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "commpipe", "train", "--preset", "tiny", "--tp", "2", "--schedule", "stp",
           "--microbatches", "4", "--seq-len", "16", "--steps", "3", "--out", str(out), "--trace",
           "--comm-monitor", "all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, costs, per_rank = calibrate_run(out)
    split = tp_split(out)
    assert set(split) == {0, 1}                 # both TP ranks; the pipeline rank is rank 0
    # every plain F and I of steps 1.. on rank 0 (2 per stage and op), each with a TP wait
    assert {k: len(v) for k, v in split[0]["compute"].items() if k[1] != "W"} == {
        (0, "F"): 2, (1, "F"): 2, (0, "I"): 2, (1, "I"): 2}
    assert len(split[0]["tp"]) == 8 and min(split[0]["tp"]) > 0
    tp = costs.tp_comm[0]
    assert costs.tp_comm == [tp, tp] and tp == statistics.median(split[0]["tp"])
    # the stage costs are the medians of the pipeline rank's compute alone plus one host
    # overhead, the same for every stage and op
    offsets = [table[s] - statistics.median(split[0]["compute"][(s, op)])
               for s in (0, 1) for op, table in (("F", costs.f), ("I", costs.i))]
    assert min(offsets) >= 0 and max(offsets) - min(offsets) < 1e-9
    # each plain pass's wait is exactly the time its collectives (their own kernel events in
    # the Chrome trace) held it: the union of the calls inside the pass
    events = [e for e in load_events(out) if e["rank"] == 0]
    waits = []
    for step, name in {(e["step"], e["name"]) for e in events if "action_ms" in e["args"]}:
        a = Action.parse(name)
        if step == 0 or a.pair is not None or a.op not in ("F", "I"):
            continue
        parts = [e for e in events if e["stream"] == "compute" and e["step"] == step and e["name"] == name]
        start = min(e["start_ms"] for e in parts)
        end = start + parts[0]["args"]["action_ms"]
        calls = sorted((max(e["start_ms"], start), min(e["end_ms"], end)) for e in events
                       if e["stream"] != "compute" and "correlation" in e["args"]
                       and e["start_ms"] < end and e["end_ms"] > start)
        held, reach = 0.0, start
        for lo, hi in calls:
            held += max(hi - max(lo, reach), 0.0)
            reach = max(reach, hi)
        waits.append(end - start - sum(e["end_ms"] - e["start_ms"] for e in parts))
        assert abs(waits[-1] - held) < 0.01, (step, name, waits[-1], held)
    assert sorted(waits) == pytest.approx(sorted(split[0]["tp"]), abs=1e-6)   # summed in another order
    # simulated: a braid's collectives run on the TP stream while its compute goes on
    res = compare_run(out).result
    braids = [e for e in res.events if e.stream == "compute" and "&" in e.name]
    hidden = [t for t in res.events if t.stream == "tp" and "&" in t.name
              and any(b.start_ms <= t.start_ms and t.end_ms <= b.end_ms for b in braids)]
    assert braids and hidden
