"""What the hang watchdog costs a healthy run: median step time with it on over off.

    python benchmarks/elastic_watchdog_overhead.py                 # 2 ranks, pp=2, tiny model
    python benchmarks/elastic_watchdog_overhead.py --nproc 4 --steps 60 --repeats 3

Runs `torchrun --standalone --nproc-per-node N -m commpipe train --pp N` with
`--hang-timeout-s 60` (on; it ticks every 2 s, and here also with a 2 s timeout whose tick is
0.2 s) and `--hang-timeout-s 0` (off), alternating on and off so that a
busy host slows both alike, and compares the median `step_time_s` of metrics.jsonl after the
first steps. The per-call record in commpipe.parallel.comm (two attribute stores) is on in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(nproc: int, steps: int, hang_timeout_s: float, out: Path, model: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "commpipe", "train", "--model", model, "--pp", str(nproc),
           "--seq-len", "64", "--steps", str(steps), "--log-every", "1000",
           "--hang-timeout-s", str(hang_timeout_s), "--out", str(out), "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in recs[3:]]          # after the warm-up steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="tiny")
    args = p.parse_args(argv)
    settings = {"off": 0.0, "on (60 s, tick 2 s)": 60.0, "on (2 s, tick 0.2 s)": 2.0}
    times: dict[str, list[float]] = {k: [] for k in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, timeout in settings.items():
                times[name] += run(args.nproc, args.steps, timeout, Path(tmp) / f"r{i}", args.model)
    off = statistics.median(times["off"])
    print(f"{args.nproc} ranks, pp={args.nproc}, model {args.model}, {args.repeats} x "
          f"{args.steps} steps per setting (median step time over the steps after the third)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  watchdog {name:22s} {med * 1e3:8.2f} ms   on/off {med / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
