"""A job that loses a node continues on the ranks that remain, under torchrun's elastic agent.

    python -m pytest tests/test_elastic_restart.py -x -q

Two torchrun agents on this host play two nodes of one job (`--nnodes 1:2`, c10d rendezvous,
two workers each, `--pp 2 --dp 2`, a copy of the state on the other node after every step). One
node is killed, agent and workers, after a few steps (before any checkpoint); the other restarts
its workers on the world that remains (2 ranks), which re-plan the layout for 2 ranks with the
same global batch, restore the newest copy (the lost node's half of the model comes from the
copies the survivor kept) and finish the run. Nothing but the step in flight (and the one whose
copy the kill may have cut short) is run again, and every loss, before the kill and after,
equals one process's uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commpipe.cli import main
from commpipe.elastic.restart import elastic_config
from commpipe.parallel.dims import ParallelDims
from commpipe.ports import free_port, torchrun_argv
from commpipe.train import checkpoint
from commpipe.train.config import TrainConfig
from commpipe.train.peer_copies import run_dir
from commpipe.train.run_folder import prepare_run_folder
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


def test_a_restart_before_the_first_checkpoint_continues_the_run_folder(tmp_path):
    """A job lost before its first checkpoint restarts on another world, under another layout,
    into the folder its first attempt wrote: that is the same run starting again at step 0, not
    another run the folder must refuse."""
    first = TrainConfig(dims=ParallelDims(dp=2, pp=2), seq_len=16, global_batch=8,
                        out=str(tmp_path), elastic=True)
    first = elastic_config(first, 4, log=lambda *_: None).resolve(4)
    prepare_run_folder(first)
    first.save(tmp_path / "config.json")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    again = elastic_config(first, 2, restart=1, log=lambda *_: None).resolve(2)
    assert again.dims != first.dims
    prepare_run_folder(again)            # refused before ("holds a run with pp=2 ...")
    other = elastic_config(first, 2, restart=1, log=lambda *_: None)
    other.seq_len = 32                   # another run, though: still refused
    with pytest.raises(ValueError, match="seq_len=16"):
        prepare_run_folder(other.resolve(2))


def test_replan_without_out_is_refused(tmp_path):
    cfg = TrainConfig(dims=ParallelDims(dp=2, pp=2))
    try:
        elastic_config(cfg, 2)
    except ValueError as e:
        assert "--out" in str(e)
    else:
        raise AssertionError("--elastic without --out was accepted")


def agent(out: Path, port: int, log: Path, join: bool = False) -> subprocess.Popen:
    run = torchrun_argv(port, join)
    cmd = [sys.executable, *run, "--nnodes", "1:2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--max-restarts", "1", "--monitor-interval", "0.5",
           "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "-m", "commpipe", "train",
           "--pp", "2", "--dp", "2", *TINY, "--steps", str(STEPS),
           "--peer-copy-every", "1", "--elastic", "--out", str(out)]
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
    b = agent(out, port, tmp_path / "b.log", join=True)   # a hosts the store, so b may be lost
    try:
        end = time.monotonic() + 240
        while not any(r["step"] >= 5 for r in metric_lines(out)):
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
    said = [x for x in log.splitlines() if "commpipe: elastic:" in x and "instead of" in x]
    assert len(said) == 1 and "2 ranks instead of the 4" in said[0] and \
        "global batch 8 kept" in said[0], log[-4000:]
    resumed = [x for x in log.splitlines() if "resumed from" in x]
    assert len(resumed) == 1, log[-4000:]
    start = int(resumed[0].rsplit("at step ", 1)[1])
    restored = [x for x in log.splitlines() if "from the copies in the memory" in x]
    assert len(restored) == 1 and f"restoring step {start} " in restored[0], log[-4000:]
    # at most the step in flight is lost, and the step before it when the kill cut its copy short
    assert lost_after <= start <= lost_after + 1, (start, lost_after)
    saved = checkpoint.read_meta(out / "checkpoints" / checkpoint.step_dirname(start))
    assert saved.get("from_peer_copies") and saved["world_size"] == 4
    assert "newer with no checkpoint yet" in restored[0]
    restart = [json.loads(x) for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert [(r["step"], r["from"]) for r in restart] == [(start, "peer copies")], restart
    recs = metric_lines(out)
    # every step once, in order; a step after the copy was run again (the record moved to
    # metrics.replaced.jsonl) only when the kill came during the copy
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert recs[0]["dp"] == 2 and recs[0]["pp"] == 2
    after = recs[start:]
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 2 for r in after)
    assert all(r["global_batch"] == 8 for r in after)
    # the state restored from the copies is the one the lost layout had: one process, never
    # interrupted, computes the same losses, those on 4 ranks before the kill and on 2 after it
    ref = tmp_path / "ref"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # as the workers (OMP_NUM_THREADS=1): quick on a busy host
    try:
        assert main(["train", *TINY, "--steps", str(STEPS), "--out", str(ref), "--log-every",
                     "100"]) == 0
    finally:
        torch.set_num_threads(threads)
    ref_losses = [r["loss"] for r in metric_lines(ref)]
    got = [r["loss"] for r in recs]
    assert len(ref_losses) == len(got) == STEPS
    for x, want in zip(got, ref_losses):
        assert math.isclose(x, want, rel_tol=1e-5), (got, ref_losses)
    # the run is over: its copies are gone from the surviving node's memory (the killed node's
    # folder stays: on a real cluster it is on the lost host)
    assert not list(run_dir(out).glob(f"*-{a.pid}/step_*")), list(run_dir(out).rglob("*"))
    shutil.rmtree(run_dir(out), ignore_errors=True)
