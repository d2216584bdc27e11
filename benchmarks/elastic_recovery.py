"""Losing a node under torchrun's elastic agent: time to the first step after recovery, steps lost.

    python benchmarks/elastic_recovery.py                          # 2 "nodes" x 2 ranks, tiny
    python benchmarks/elastic_recovery.py --nproc-per-node 4 --save-every 10

Two torchrun agents on this host play two nodes of one job (`--nnodes 1:2`, c10d rendezvous,
`--elastic`, layout --pp 2 --dp N). After the first checkpoint and a few more steps one node is
killed (its agent and workers, SIGKILL); the other restarts its workers on the ranks that
remain, which re-plan, resume from the latest checkpoint and continue. Printed: the time from
the kill to the end of the first step after recovery (split into: until the new workers
printed their layout, until the checkpoint was loaded, until that step ended), and the steps
lost (run again: those after the checkpoint). `--rdzv-conf last_call_timeout` is 3 s here
(torchrun's default is 30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agent(out: Path, port: int, log: Path, args) -> subprocess.Popen:
    n = args.nproc_per_node
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node",
           str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-bench", "--max-restarts", "1", "--monitor-interval", "0.2",
           "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "-m", "commpipe", "train",
           "--model", args.model, "--pp", "2", "--dp", str(n), "--seq-len", "16",
           "--global-batch", str(4 * n), "--steps", str(args.steps), "--save-every",
           str(args.save_every), "--elastic", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--model", default="tiny")
    args = p.parse_args(argv)
    from commpipe.cluster.ports import free_port

    world = 2 * args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp) / "run", free_port()
        a = agent(out, port, Path(tmp) / "a.log", args)
        time.sleep(1.0)
        b = agent(out, port, Path(tmp) / "b.log", args)
        try:
            kill_after = args.save_every + 2
            while not any(r["step"] >= kill_after for r in records(out)):
                if a.poll() is not None or b.poll() is not None:
                    raise SystemExit("the job ended before the kill:\n"
                                     + (Path(tmp) / "a.log").read_text()[-3000:])
                time.sleep(0.05)
            workers = Path(f"/proc/{b.pid}/task/{b.pid}/children").read_text().split()
            t_kill = time.monotonic()
            for pid in [b.pid, *map(int, workers)]:
                os.kill(pid, signal.SIGKILL)
            last_before = max(r["step"] for r in records(out))
            seen_layout = seen_resume = t_step = None
            log = Path(tmp) / "a.log"
            while t_step is None:
                text = log.read_text()
                now = time.monotonic() - t_kill
                if seen_layout is None and "commpipe: elastic:" in text:
                    seen_layout = now
                if seen_resume is None and "resumed from" in text:
                    seen_resume = now
                if seen_resume is not None and any(r["dp"] * r["pp"] < world
                                                   for r in records(out)):
                    t_step = now
                if a.poll() is not None and t_step is None:
                    raise SystemExit("no step after the restart:\n" + text[-3000:])
                time.sleep(0.02)
            code = a.wait(timeout=600)
        finally:
            for proc in (a, b):
                if proc.poll() is None:
                    proc.kill()
        text = (Path(tmp) / "a.log").read_text()
        start = int(re.search(r"resumed from .* at step (\d+)", text).group(1))
        layout = re.search(r"running (\S+),", text).group(1)
        recs = records(out)
    print(f"{world} ranks (2 nodes x {args.nproc_per_node}) -> {args.nproc_per_node} ranks, model "
          f"{args.model}, --save-every {args.save_every}; job exit code {code}")
    print(f"  layout after the restart        {layout} (from pp2-dp{args.nproc_per_node})")
    print(f"  kill -> new layout printed       {seen_layout:6.1f} s")
    print(f"  kill -> checkpoint loaded        {seen_resume:6.1f} s")
    print(f"  kill -> first step after it      {t_step:6.1f} s")
    print(f"  steps lost (run again)           {last_before + 1 - start} (checkpoint at step "
          f"{start}, last step before the kill {last_before})")
    print(f"  steps in metrics.jsonl           {len(recs)} of {args.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
