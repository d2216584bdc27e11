"""Traces of `commpipe train --trace` read by Holistic Trace Analysis (HTA) and Perfetto.

One real 4-rank run (tp=2, pp=2, gloo, CPU) through torchrun and the commpipe CLI, then HTA's
temporal breakdown, communication/computation overlap and idle-time breakdown on its trace
folder, checked against the trace files themselves.

    python -m pytest -q tests/test_trace_hta.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.dist_harness import free_port

pytest.importorskip("hta", reason="HTA is in the dev extras: pip install -e '.[dev]'")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
STEPS = 6   # the trace keeps the last TRACE_STEPS (5) of them


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hta")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--master-port", str(free_port()), "-m", "commpipe", "train", "--tp", "2", "--pp", "2",
           "--steps", str(STEPS), "--seq-len", "32", "--trace", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / "trace"


def analyse(trace_dir: Path) -> dict:
    """HTA's three analyses on `trace_dir`, with the checks a user relies on. Traces of the
    earlier format fail it: two files per rank (actions_rank{r}.json beside rank{r}.json), and
    without the extra files get_temporal_breakdown raises IndexError (no args.stream)."""
    from hta.trace_analysis import TraceAnalysis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = TraceAnalysis(trace_dir=str(trace_dir))
        files = analyzer.t.trace_files
        # one file per rank (HTA maps every .json in the folder), each the rank it says
        assert len(list(trace_dir.glob("*.json"))) == WORLD
        assert sorted(files) == list(range(WORLD)), files
        assert len(set(files.values())) == WORLD
        for rank, path in files.items():
            assert json.loads(Path(path).read_text())["distributedInfo"]["rank"] == rank
        temporal = analyzer.get_temporal_breakdown(visualize=False)
        overlap = analyzer.get_comm_comp_overlap(visualize=False)
        idle, _ = analyzer.get_idle_time_breakdown(ranks=list(range(WORLD)), visualize=False)

    for row in temporal.to_dict("records"):
        values = [row[k] for k in ("idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg")]
        assert all(math.isfinite(v) and v >= 0 for v in values), row
        assert sum(values) == pytest.approx(100.0, abs=0.05), row
        assert row["compute_time(us)"] > 0 and row["non_compute_time(us)"] > 0, row
    for pct in overlap["comp_comm_overlap_pctg"]:
        assert math.isfinite(pct) and 0.0 <= pct <= 100.0, overlap
    assert sorted(idle["rank"].unique()) == list(range(WORLD))
    assert idle["idle_time"].map(math.isfinite).all() and (idle["idle_time"] >= 0).all()
    for rank in range(WORLD):   # the compute stream of every rank is analysed
        assert 7 in set(idle[idle["rank"] == rank]["stream"]), idle
    return {"temporal": temporal, "overlap": overlap, "idle": idle}


def compute_outside_comm(path: Path) -> tuple[int, int]:
    """From a trace file alone: (time inside the compute actions of the steps HTA analyses
    (all but the last ProfilerStep), of which blocked in TP calls issued inside them), in us."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = sorted(e["ts"] for e in events if e["name"].startswith("ProfilerStep#"))
    actions = [e for e in events if e["cat"] == "user_annotation"
               and not e["name"].startswith("ProfilerStep#") and e["ts"] < steps[-1]]
    tp = [e for e in events if e["cat"] == "kernel"
          and e["args"].get("Process Group Description") == "tp"]
    total = sum(a["dur"] for a in actions)
    blocked = sum(k["dur"] for a in actions for k in tp
                  if a["ts"] <= k["ts"] and k["ts"] + k["dur"] <= a["ts"] + a["dur"])
    return total, blocked


def test_hta_reads_the_traces_of_a_tp2_pp2_run(trace_dir):
    result = analyse(trace_dir)
    temporal = result["temporal"].set_index("rank")
    for rank in range(WORLD):
        total, blocked = compute_outside_comm(trace_dir / f"rank{rank}.json")
        # a tp=2 forward or backward blocks in its all-reduces: a real share of the action
        assert blocked > 0.05 * total, (rank, total, blocked)
        # HTA's computation time is the actions' time less the TP calls inside them, not the
        # whole actions (timestamps are whole microseconds: a few us of slack)
        assert temporal.loc[rank, "compute_time(us)"] == pytest.approx(total - blocked, abs=50)


def test_trace_keeps_the_last_steps(trace_dir):
    from commpipe.train.run_files import TRACE_STEPS

    for rank in range(WORLD):
        trace = json.loads((trace_dir / f"rank{rank}.json").read_text())
        marks = sorted(e["args"]["step"] for e in trace["traceEvents"]
                       if e["name"].startswith("ProfilerStep#"))
        assert marks == list(range(STEPS - TRACE_STEPS, STEPS))
        assert all(e["args"]["step"] >= STEPS - TRACE_STEPS for e in trace["traceEvents"]
                   if e["ph"] == "X")


def test_trace_threads_nest_for_perfetto(trace_dir):
    """Perfetto (Chrome JSON) needs the slices of one thread to nest: no partial overlaps."""
    for rank in range(WORLD):
        trace = json.loads((trace_dir / f"rank{rank}.json").read_text())
        threads: dict = {}
        for e in trace["traceEvents"]:
            if e["ph"] == "X":
                assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
                threads.setdefault((e["pid"], e["tid"]), []).append(e)
        names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        assert {"host", "compute", "pp", "tp"} <= set(names.values())
        for key, slices in threads.items():
            stack: list[int] = []
            for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
                while stack and stack[-1] <= e["ts"]:
                    stack.pop()
                end = e["ts"] + e["dur"]
                assert not stack or end <= stack[-1], (rank, names[key], e)
                stack.append(end)
