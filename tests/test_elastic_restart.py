"""A job that loses a node continues on the ranks that remain, under torchrun's elastic agent.

    python -m pytest tests/test_elastic_restart.py -x -q

Two torchrun agents on this host play two nodes of one job (`--nnodes 1:2`, c10d rendezvous,
two workers each, `--pp 2 --dp 2`). One node is killed, agent and workers, after a checkpoint;
the other restarts its workers on the world that remains (2 ranks), which re-plan the layout for
2 ranks with the same global batch, resume from the latest checkpoint and finish the run. The
losses after the restart equal a one-process run resumed from the same checkpoint.
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
from commpipe.elastic.restart import elastic_config
from commpipe.parallel.dims import ParallelDims
from commpipe.train import checkpoint
from commpipe.train.config import TrainConfig
from tests.test_failures import metric_lines

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--seq-len", "16", "--global-batch", "8"]
STEPS = 24


def test_replan_keeps_the_global_batch_and_resumes(tmp_path):
    cfg = TrainConfig(dims=ParallelDims(dp=2, pp=2), seq_len=16, global_batch=8,
                      out=str(tmp_path), fail_at=(1, 3))
    same = elastic_config(cfg, 4, restart=0, log=lambda *_: None)
    assert (same.dims, same.resume, same.fail_at) == (cfg.dims, "latest", (1, 3))
    said = []
    for world in (1, 2, 3, 6):
        new = elastic_config(cfg, world, restart=1, log=said.append)
        d = new.dims
        assert d.world_size == world and new.global_batch == 8
        assert new.microbatches * new.micro_batch_size * d.dp == 8
        assert new.resume == "latest" and new.fail_at is None
    assert len(said) == 4 and all("global batch 8 kept" in s and "planner" in s for s in said)


def test_replan_without_out_is_refused(tmp_path):
    cfg = TrainConfig(dims=ParallelDims(dp=2, pp=2))
    try:
        elastic_config(cfg, 2)
    except ValueError as e:
        assert "--out" in str(e)
    else:
        raise AssertionError("--elastic without --out was accepted")


def agent(out: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--max-restarts", "1", "--monitor-interval", "0.5",
           "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "-m", "commpipe", "train",
           "--pp", "2", "--dp", "2", *TINY, "--steps", str(STEPS), "--save-every", "4",
           "--elastic", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True)


def wait_for_store(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until the first agent listens on the rendezvous port: the agent that binds it hosts the
    c10d store, and the test may only kill the other one (a fixed sleep lost that race on a
    loaded host, where importing torch alone takes seconds)."""
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the first agent exited before hosting the store"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"no rendezvous store on port {port} after {timeout:.0f} s")


def test_lost_node_shrinks_the_job_and_training_continues(tmp_path):
    out = tmp_path / "run"
    port = free_port()
    a = agent(out, port, tmp_path / "a.log")
    wait_for_store(port, a)              # a hosts the rendezvous store, so b may be lost
    b = agent(out, port, tmp_path / "b.log")
    try:
        end = time.monotonic() + 240
        while checkpoint.find_checkpoint(out) is None or not any(
                r["step"] >= 5 for r in metric_lines(out)):
            assert time.monotonic() < end and a.poll() is None and b.poll() is None, \
                (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.1)
        # the node goes: its agent and its workers
        workers = Path(f"/proc/{b.pid}/task/{b.pid}/children").read_text().split()
        for pid in [b.pid, *map(int, workers)]:
            os.kill(pid, signal.SIGKILL)
        lost_after = max(r["step"] for r in metric_lines(out))
        code = a.wait(timeout=300)
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
    log = (tmp_path / "a.log").read_text()
    assert code == 0, log[-4000:]
    said = [x for x in log.splitlines() if "commpipe: elastic:" in x]
    assert len(said) == 1 and "2 ranks instead of the 4" in said[0] and \
        "global batch 8 kept" in said[0], log[-4000:]
    resumed = [x for x in log.splitlines() if "resumed from" in x]
    assert len(resumed) == 1, log[-4000:]
    start = int(resumed[0].rsplit("at step ", 1)[1])
    assert start % 4 == 0 and 4 <= start <= lost_after + 1
    recs = metric_lines(out)
    # every step once, in order; the steps after the checkpoint were run again (the lost ones
    # moved to metrics.replaced.jsonl)
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert recs[0]["dp"] == 2 and recs[0]["pp"] == 2
    after = recs[start:]
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 2 for r in after)
    assert all(r["global_batch"] == 8 for r in after)
    # the same state and data from step `start` on: one process resumed from that checkpoint
    ref = tmp_path / "ref"
    ckpt = out / "checkpoints" / checkpoint.step_dirname(start)
    assert main(["train", *TINY, "--steps", str(STEPS), "--resume", str(ckpt), "--out",
                 str(ref), "--log-every", "100"]) == 0
    ref_losses = [r["loss"] for r in metric_lines(ref)]
    assert len(ref_losses) == STEPS - start
    for got, want in zip([r["loss"] for r in after], ref_losses):
        assert math.isclose(got, want, rel_tol=1e-5), ([r["loss"] for r in after], ref_losses)
    replaced = [json.loads(x)["step"] for x in
                (out / "metrics.replaced.jsonl").read_text().splitlines()]
    assert replaced and min(replaced) == start
