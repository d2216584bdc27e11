"""Measured against predicted: a real traced 2-rank run, calibrated and simulated."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from commpipe.schedules import Action
from commpipe.sim.compare import compare_run, load_run, overlay_trace


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
