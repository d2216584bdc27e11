"""Losing a node under torchrun's elastic agent: time to the first step after recovery, steps
lost, and what the copies of the state in memory cost a healthy run.

    python benchmarks/elastic_recovery.py                          # 2 "nodes" x 2 ranks, tiny
    python benchmarks/elastic_recovery.py --nproc-per-node 4 --save-every 10
    python benchmarks/elastic_recovery.py --peer-copy-every 0      # checkpoints only
    python benchmarks/elastic_recovery.py --healthy-steps 200      # + the copies' cost

Two torchrun agents on this host play two nodes of one job (`--nnodes 1:2`, c10d rendezvous,
`--elastic`, layout --pp 2 --dp N). After the first checkpoint and a few more steps one node is
killed (its agent and workers, SIGKILL); the other restarts its workers on the ranks that
remain, which re-plan, restore the newest copy of the state kept in memory (or the latest
checkpoint, when it is newer) and continue. Printed: the time from the kill to the end of the
first step after recovery (split into: until the new workers printed their layout, until the
state was loaded, until that step ended), where the state came from, and the steps lost (run
again). `--rdzv-conf last_call_timeout` is 3 s here (torchrun's default is 30 s).

`--healthy-steps N` also runs the job without a failure (and without checkpoints), N steps with
the copies at `--peer-copy-every` and N steps without, and prints the median step time of each,
the time of one copy (rank 0, between steps, from OUT/peer_copies.jsonl), the copies' share of
the time of the run that took them, and the cost of the copies across the two runs: the median
step time plus the copies' time spread over the steps, over the median step time without them
(goal <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agent(out: Path, port: int, log: Path, args, every: int | None, join: bool = False,
          steps: int | None = None, save_every: int | None = None) -> subprocess.Popen:
    from commpipe.ports import torchrun_argv

    n = args.nproc_per_node
    run = torchrun_argv(port, join)
    cmd = [sys.executable, *run, "--nnodes", "1:2", "--nproc-per-node",
           str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-bench", "--max-restarts", "1", "--monitor-interval", "0.2",
           "--rdzv-conf", "last_call_timeout=3,join_timeout=120", "-m", "commpipe", "train",
           "--model", args.model, "--pp", "2", "--dp", str(n), "--seq-len", str(args.seq_len),
           "--global-batch", str(4 * n), "--steps", str(steps or args.steps), "--save-every",
           str(args.save_every if save_every is None else save_every), "--elastic", "--out",
           str(out), "--log-every", "1000"]
    if every is not None:
        cmd += ["--peer-copy-every", str(every)]
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
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--peer-copy-every", type=int, default=None,
                   help="as `commpipe train` (default: its default under --elastic)")
    p.add_argument("--kill-after", type=int, default=25, help="kill the node after this step")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--healthy-steps", type=int, default=0,
                   help="also measure the copies' cost on a healthy run of this many steps")
    p.add_argument("--skip-recovery", action="store_true")
    args = p.parse_args(argv)
    if not args.skip_recovery:
        recovery(args)
    if args.healthy_steps:
        healthy(args)
    return 0


def job(tmp: Path, args, every: int | None, steps: int | None = None,
        save_every: int | None = None):
    from commpipe.cluster.ports import free_port

    out, port = tmp / "run", free_port()
    a = agent(out, port, tmp / "a.log", args, every, steps=steps, save_every=save_every)
    b = agent(out, port, tmp / "b.log", args, every, join=True, steps=steps,
              save_every=save_every)
    return out, a, b


def recovery(args) -> None:
    world = 2 * args.nproc_per_node
    with tempfile.TemporaryDirectory() as tmp:
        out, a, b = job(Path(tmp), args, args.peer_copy_every)
        try:
            while not any(r["step"] >= args.kill_after for r in records(out)):
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
            before = len(log.read_text())        # what the log said before the kill
            while t_step is None:
                text = log.read_text()[before:]
                now = time.monotonic() - t_kill
                if seen_layout is None and "commpipe: elastic:" in text:
                    seen_layout = now
                after = text.split("commpipe: elastic:", 1)[1] if seen_layout else ""
                if seen_resume is None and ("resumed from" in text or "starting at step 0" in after):
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
                proc.wait()
            from commpipe.train.peer_copies import run_dir

            shutil.rmtree(run_dir(out), ignore_errors=True)   # the killed node's copies
        text = (Path(tmp) / "a.log").read_text()[before:]
        resumed = re.search(r"resumed from .* at step (\d+)", text)
        start = int(resumed.group(1)) if resumed else 0
        layout = re.search(r"running (\S+),", text).group(1)
        source = "copies in memory" if "from the copies in the memory" in text else \
            "checkpoint" if resumed else "seed: step 0"
        recs = records(out)
    every = "default" if args.peer_copy_every is None else args.peer_copy_every
    print(f"{world} ranks (2 nodes x {args.nproc_per_node}) -> {args.nproc_per_node} ranks, model "
          f"{args.model}, --save-every {args.save_every}, --peer-copy-every {every}; job exit "
          f"code {code}")
    print(f"  layout after the restart        {layout} (from pp2-dp{args.nproc_per_node})")
    print(f"  kill -> new layout printed       {seen_layout:6.1f} s")
    print(f"  kill -> state loaded             {seen_resume:6.1f} s (from the {source})")
    print(f"  kill -> first step after it      {t_step:6.1f} s")
    print(f"  steps lost (run again)           {last_before + 1 - start} (resumed at step "
          f"{start}, last step before the kill {last_before})")
    print(f"  steps in metrics.jsonl           {len(recs)} of {args.steps}")


def healthy(args) -> None:
    """Median step time with the copies and without, and the copies' own time."""
    import statistics

    world = 2 * args.nproc_per_node
    n, skip = args.healthy_steps, min(10, args.healthy_steps // 5)   # warm-up left out
    got = {}
    for every in (args.peer_copy_every, 0):
        with tempfile.TemporaryDirectory() as tmp:
            out, a, b = job(Path(tmp), args, every, steps=n, save_every=0)   # copies alone
            codes = (a.wait(timeout=3600), b.wait(timeout=3600))
            if codes != (0, 0):
                raise SystemExit(f"the healthy run failed ({codes}):\n"
                                 + (Path(tmp) / "a.log").read_text()[-3000:])
            steps = [r["step_time_s"] for r in records(out)][skip:]
            copies = [json.loads(x)["seconds"] for x in (out / "peer_copies.jsonl").read_text()
                      .splitlines()] if (out / "peer_copies.jsonl").exists() else []
            got[every] = (statistics.median(steps), copies, sum(steps))
    (on, copies, total), (off, _, _) = got[args.peer_copy_every], got[0]
    every = "default" if args.peer_copy_every is None else args.peer_copy_every
    with_copies = on + sum(copies) / n
    print(f"healthy run, {world} ranks (2 nodes x {args.nproc_per_node}, pp2-dp"
          f"{args.nproc_per_node}), model {args.model}, {n} steps:")
    print(f"  median step, copies off          {off * 1e3:8.2f} ms")
    print(f"  median step, copies on ({every})  {on * 1e3:8.2f} ms")
    if copies:
        print(f"  one copy (median of {len(copies)})        {statistics.median(copies) * 1e3:8.2f} ms")
        print(f"  copies' share of the run with them     {sum(copies) / (total + sum(copies)):6.1%}"
              " (same run, same load)")
    print(f"  cost: (median + copies / steps) / median off = {with_copies / off:.3f}"
          " (two runs: host load between them counts too)")


if __name__ == "__main__":
    sys.exit(main())
