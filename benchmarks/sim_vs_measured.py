"""Simulator against measurement: train with --trace, calibrate a cost table from that run,
simulate the same program and print the makespan error, for each schedule on 2 and 4 ranks.

    python benchmarks/sim_vs_measured.py                 # tiny preset, 2 and 4 CPU ranks
    python benchmarks/sim_vs_measured.py --preset small --ranks 2

Goal: |error| within 10% of the measured pipeline makespan of the last step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from commpipe.sim.compare import compare_run

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{'schedule':<12} {'pp':>3} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp in args.ranks:
            for name, vpp in SCHEDULES:
                out = Path(tmp) / f"{name}-pp{pp}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={pp}", "-m", "commpipe", "train", "--preset",
                       args.preset, "--pp", str(pp), "--schedule", name, "--vpp", str(vpp),
                       "--microbatches", str(args.microbatches), "--seq-len", str(args.seq_len),
                       "--steps", str(args.steps), "--out", str(out), "--trace",
                       "--log-every", "1000"]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    print(f"{name:<12} {pp:>3} failed: {proc.stderr.strip().splitlines()[-1]}")
                    continue
                c = compare_run(out)
                errors.append(abs(c.makespan_error))
                print(f"{name:<12} {pp:>3} {c.measured_makespan:>12.1f} "
                      f"{c.predicted_makespan:>13.1f} {c.makespan_error:>+8.1%}")
    if errors:
        errors.sort()
        print(f"median |error| {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%} "
              f"over {len(errors)} runs (goal: within 10%)")


if __name__ == "__main__":
    main()
