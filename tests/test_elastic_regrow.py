"""A job that lost a node grows back to the larger layout when the node returns.

    python -m pytest tests/test_elastic_regrow.py -x -q

Two torchrun agents on this host play two nodes (`--nnodes 1:2`, c10d rendezvous, two workers
each, `--pp 2 --dp 2 --elastic`). Node b is killed (agent and workers); node a continues on 2
ranks. Then a new agent joins for the lost node: a's agent sees it waiting, stops its workers,
and the rendezvous meets again on 4 ranks, which take the command line's layout back and resume
from the latest checkpoint. Every step is in metrics.jsonl once, in order; the losses after the
regrowth equal a one-process run resumed from the same checkpoint; the report's step-time
figure marks the loss and the regrowth at the steps where they happened.
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

from commpipe.cli import main
from commpipe.cluster.ports import free_port
from commpipe.report.elastic import elastic_marks
from commpipe.train import checkpoint
from tests.test_elastic_restart import wait_for_store
from tests.test_failures import metric_lines

ROOT = Path(__file__).resolve().parents[1]
MODEL = "arch=llama,layers=4,hidden=64,heads=4,kv_heads=2,ffn_hidden=256,vocab=256"
# a constant learning rate: a reference run of fewer steps trains the same steps alike
TINY = ["--model", MODEL, "--seq-len", "32", "--global-batch", "8", "--lr", "1e-3", "--min-lr",
        "1e-3", "--warmup", "0"]
STEPS = 5000         # never reached: the job is stopped (SIGTERM) a few steps after the regrowth
AFTER = 6            # steps compared after the regrowth


def agent(out: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-regrow", "--max-restarts", "1", "--monitor-interval", "0.5",
           "--rdzv-conf", "last_call_timeout=2,join_timeout=120", "-m", "commpipe", "train",
           "--pp", "2", "--dp", "2", *TINY, "--steps", str(STEPS), "--save-every", "4",
           "--log-every", "100", "--elastic", "--out", str(out)]
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
    wait_for_store(port, a)              # a hosts the rendezvous store, so b may be lost
    b = agent(out, port, tmp_path / "b.log")
    c = None
    try:
        wait(lambda: checkpoint.find_checkpoint(out) is not None
             and any(r["step"] >= 5 for r in metric_lines(out)), [a, b], log)
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
    text = log.read_text()
    resumed = [int(x.rsplit("at step ", 1)[1]) for x in text.splitlines() if "resumed from" in x]
    assert len(resumed) == 2, text[-4000:]       # after the loss, after the regrowth
    recs = metric_lines(out)
    assert [r["step"] for r in recs] == list(range(len(recs)))  # none repeated, none lost
    worlds = [world(r) for r in recs]
    shrink, grow = resumed
    assert set(worlds[:shrink]) == {4} and set(worlds[shrink:grow]) == {2}, worlds
    assert set(worlds[grow:]) == {4} and len(worlds) > grow + AFTER, worlds
    assert all(r["pp"] == 2 and r["dp"] == 2 for r in recs[grow:])   # the command line's layout
    assert all(r["global_batch"] == 8 for r in recs)
    # the step-time figure's marks: lost in the step after the last one run again, resumed on
    # 2 ranks at the checkpoint, stopped for the returning node, regrown at its checkpoint
    marks = elastic_marks(out)
    assert [k for _, k, _ in marks] == ["lost", "resumed", "stopped", "regrown"], marks
    assert marks[0][0] > shrink and marks[1][0] == shrink and marks[3][0] == grow, marks
    replaced = [json.loads(x)["step"] for x in
                (out / "metrics.replaced.jsonl").read_text().splitlines()]
    assert marks[0][0] == max(replaced) + 1 and min(replaced) == shrink, (marks, replaced)
    assert marks[2][0] == grow                   # saved at its step boundary: nothing run again
    # after the regrowth: the same state and data as one process resumed from that checkpoint
    ref = tmp_path / "ref"
    ckpt = out / "checkpoints" / checkpoint.step_dirname(grow)
    assert main(["train", *TINY, "--steps", str(grow + AFTER), "--resume", str(ckpt), "--out",
                 str(ref), "--log-every", "100"]) == 0
    ref_losses = [r["loss"] for r in metric_lines(ref)]
    got = [r["loss"] for r in recs[grow:grow + AFTER]]
    assert len(ref_losses) == AFTER
    for x, want in zip(got, ref_losses):
        assert math.isclose(x, want, rel_tol=1e-5), (got, ref_losses)
