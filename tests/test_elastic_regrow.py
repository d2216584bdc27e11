"""A job that lost a node grows back to the larger layout when the node returns.

    python -m pytest tests/test_elastic_regrow.py -x -q

Two torchrun agents on this host play two nodes (`--nnodes 1:2`, c10d rendezvous, two workers
each, `--pp 2 --dp 2 --elastic`, no copies of the state in memory, no periodic checkpoint).
Node b is killed (agent and workers) before anything was saved; node a starts again at step 0
on 2 ranks. Then a new agent joins for the lost node: a's agent sees it waiting, stops its
workers (which save), and the rendezvous meets again on 4 ranks, which take the command line's
layout back and resume from that checkpoint. Every step is in metrics.jsonl once, in order; the
losses on 2 ranks and after the regrowth equal one process's uninterrupted run; the report's
step-time figure marks the loss and the regrowth at the steps where they happened.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from commpipe.cli import main
from commpipe.ports import free_port, torchrun_argv
from commpipe.report.elastic import elastic_marks
from commpipe.train import checkpoint
from tests.test_failures import metric_lines

ROOT = Path(__file__).resolve().parents[1]
MODEL = "arch=llama,layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=256,vocab=256"
# a constant learning rate: a reference run of fewer steps trains the same steps alike
TINY = ["--model", MODEL, "--seq-len", "32", "--global-batch", "8", "--lr", "1e-3", "--min-lr",
        "1e-3", "--warmup", "0"]
STEPS = 5000         # never reached: the job is stopped (SIGTERM) a few steps after the regrowth
AFTER = 6            # steps compared after the regrowth


def agent(out: Path, port: int, log: Path, join: bool = False) -> subprocess.Popen:
    run = torchrun_argv(port, join)
    cmd = [sys.executable, *run, "--nnodes", "1:2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-regrow", "--max-restarts", "1", "--monitor-interval", "0.5",
           "--rdzv-conf", "last_call_timeout=2,join_timeout=120", "-m", "commpipe", "train",
           "--pp", "2", "--dp", "2", *TINY, "--steps", str(STEPS), "--save-every", "0",
           "--peer-copy-every", "0", "--log-every", "100", "--elastic", "--out", str(out)]
    # each round's store is new (torchrun's shared store is not rebuilt for a joining node)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)


def world(rec: dict) -> int:
    return rec["tp"] * rec["cp"] * rec["pp"] * rec["dp"]


def wait(cond, procs, log: Path, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, log.read_text()[-3000:]
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.1)


def shrink_seen(out: Path) -> int:
    """Index of the first record on 2 ranks (the survivors'), or the end."""
    recs = metric_lines(out)
    return next((i for i, r in enumerate(recs) if world(r) == 2), len(recs))


def test_returning_node_grows_the_job_back(tmp_path):
    out, port, log = tmp_path / "run", free_port(), tmp_path / "a.log"
    a = agent(out, port, log)
    b = agent(out, port, tmp_path / "b.log", join=True)   # a hosts the store: b may be lost
    c = None
    try:
        wait(lambda: any(r["step"] >= 5 for r in metric_lines(out)), [a, b], log)
        workers = Path(f"/proc/{b.pid}/task/{b.pid}/children").read_text().split()
        for pid in [b.pid, *map(int, workers)]:
            os.kill(pid, signal.SIGKILL)
        b.wait()
        # the survivors train on 2 ranks for a few steps, then the node comes back
        wait(lambda: any(world(r) == 2 for r in metric_lines(out)), [a], log)
        c = agent(out, port, tmp_path / "c.log")
        wait(lambda: sum(world(r) == 4 for r in metric_lines(out)[shrink_seen(out):]) > AFTER,
             [a, c], log)
        for p in (a, c):                 # the job ends, each worker saving at its step boundary
            p.send_signal(signal.SIGTERM)
        a.wait(timeout=120)
        c.wait(timeout=120)
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                p.kill()
    # rank 0, which prints, is on a until the regrowth, then on a or c (the rendezvous decides)
    text = log.read_text() + (tmp_path / "c.log").read_text()
    # lost before anything was saved: the survivors start again at step 0 with the seed (as
    # the job's first start did)
    again = [x for x in text.splitlines() if "starting at step 0" in x]
    assert len(again) == 2 and all("no checkpoint" in x and "(seed 0)" in x for x in again), \
        text[-4000:]
    resumed = [int(x.rsplit("at step ", 1)[1]) for x in text.splitlines() if "resumed from" in x]
    assert len(resumed) == 1, text[-4000:]       # after the regrowth
    recs = metric_lines(out)
    assert [r["step"] for r in recs] == list(range(len(recs)))  # none repeated, none lost
    worlds = [world(r) for r in recs]
    shrink, grow = 0, resumed[0]
    assert set(worlds[:grow]) == {2}, worlds
    assert set(worlds[grow:]) == {4} and len(worlds) > grow + AFTER, worlds
    assert all(r["pp"] == 2 and r["dp"] == 2 for r in recs[grow:])   # the command line's layout
    assert all(r["global_batch"] == 8 for r in recs)
    restarts = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["from"]) for r in restarts] == [(0, None), (grow, "checkpoint")]
    # the step-time figure's marks: lost in the step after the last one run again, resumed on
    # 2 ranks at step 0, stopped for the returning node, regrown at its checkpoint
    marks = elastic_marks(out)
    assert [k for _, k, _ in marks] == ["lost", "resumed", "stopped", "regrown"], marks
    assert marks[0][0] > shrink and marks[1][0] == shrink and marks[3][0] == grow, marks
    replaced = [json.loads(x)["step"] for x in
                (out / "metrics.replaced.jsonl").read_text().splitlines()]
    assert marks[0][0] == max(replaced) + 1 and min(replaced) == shrink, (marks, replaced)
    assert marks[2][0] == grow                   # saved at its step boundary: nothing run again
    # starting again on 2 ranks is the run the new layout makes from the seed, and the regrowth
    # keeps the state: one process from step 0, and one resumed from the regrowth checkpoint,
    # compute the same losses (a few steps each: float sums in another order drift apart slowly)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # as the workers (OMP_NUM_THREADS=1): quick on a busy host
    try:
        assert main(["train", *TINY, "--steps", str(AFTER), "--out", str(tmp_path / "ref0"),
                     "--log-every", "100"]) == 0
        ckpt = out / "checkpoints" / checkpoint.step_dirname(grow)
        assert main(["train", *TINY, "--steps", str(grow + AFTER), "--resume", str(ckpt),
                     "--out", str(tmp_path / "ref"), "--log-every", "100"]) == 0
    finally:
        torch.set_num_threads(threads)
    for ref, got in ((tmp_path / "ref0", recs[:AFTER]), (tmp_path / "ref", recs[grow:grow + AFTER])):
        want = [r["loss"] for r in metric_lines(ref)]
        assert len(want) == len(got) == AFTER
        for x, y in zip([r["loss"] for r in got], want):
            assert math.isclose(x, y, rel_tol=1e-5), (got, want)
