"""`commpipe estimate --gpu cpu` with nothing fitted, against `commpipe train` of the same layout
on this machine: the tiny preset on 1 and 2 ranks.

    python benchmarks/cpu_host_ops.py                 # ~2 min on 2 cores
    python benchmarks/cpu_host_ops.py --repeats 1 --layouts 1,dp2

Per layout: the median step time of `commpipe train --preset tiny` (fp32, sequence 64, global
batch 8, micro-batch 1; steps after the warm-up, over --repeats launches), the cores other
processes left it (benchmarks/_spare_cores.py), and predictions of `estimate` for the same
layout on this CPU (`--gpu cpu --backend gloo --precision fp32`): "untuned", the planner's
former CPU default (Efficiency(): 20 us per layer pass, no host ops) on 2 cores; "measured",
as `plan --gpu cpu` prices it: each pass's eager ops and FLOPs at the time per op and per unit
of work measured on the model's first layer (commpipe.plan.pass_split; the optimizer's ops at
the same time per op, commpipe.plan.runtime_ops), on 2 cores; "capacity", the same on the
cores the run had, each worth what the machine's cores run at once over their count
(`--host-cores auto`, commpipe.plan.cpu.measure_core_capacity); and "probed", that with the
links, the host time per gloo call and the scheduler's wake-up wait of a `commpipe probe` of 2
ranks (as
benchmarks/planner_rank.py prices them; --no-probe skips it). Results: benchmarks/results/planner_runs.md,
"Third session"; how the planner prices them: docs/planner.md, "CPU ranks".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spare_cores import CpuMeter, spare_cores  # noqa: E402  (a sibling module)

TRAIN = ["--preset", "tiny", "--global-batch", "8", "--seq-len", "64", "--micro-batch-size", "1",
         "--precision", "fp32"]
LAYOUTS = {"1": {}, "dp2": {"dp": 2}, "pp2": {"pp": 2}, "tp2": {"tp": 2}, "cp2": {"cp": 2}}


def train(name: str, steps: int, warmup: int, out: Path) -> tuple[float, float]:
    """(median step seconds after the warm-up, cores the run had to spare)."""
    dims = LAYOUTS[name]
    ranks = 2 if dims else 1
    flags = [f"--{k}={v}" for k, v in dims.items()]
    inner = ["-m", "commpipe", "train", *TRAIN, *flags, "--steps", str(steps), "--out", str(out)]
    if ranks == 1:
        cmd = [sys.executable, *inner]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), *inner]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with CpuMeter() as meter:
        t0 = time.time()
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r["step"] >= warmup]
    end = (out / "metrics.jsonl").stat().st_mtime
    spare = spare_cores(meter.samples, max(t0, end - sum(times)), end, os.cpu_count())
    return statistics.median(times), spare


def predict(name: str, spare: float, probe_file: Path | None, capacity: float) -> dict:
    from planner_rank import on_spare_cores, probe_call_s, scheduler_wake_s

    from commpipe.models.spec import resolve_model
    from commpipe.plan.cli_inputs import for_cluster
    from commpipe.plan.cluster import apply_probe, default_cluster
    from commpipe.plan.cpu import this_cpu
    from commpipe.plan.efficiency import Efficiency, default_efficiency
    from commpipe.plan.estimate import estimate
    from commpipe.plan.layout import Job, Layout
    from commpipe.plan.pass_split import with_measured_pass

    dims = LAYOUTS[name]
    ranks = 2 if dims else 1
    spare *= capacity / os.cpu_count()           # in lone ranks' worth
    cluster = replace(default_cluster(this_cpu(), ranks, ranks), backend="gloo", host_cores=2)
    job = for_cluster(Job(8, 64, precision="fp32"), cluster, "commpipe")
    lay = Layout(dims.get("tp", 1), dims.get("cp", 1), dims.get("pp", 1), dims.get("dp", 1), 1, 1,
                 "1f1b", "none")
    spec = resolve_model("tiny")
    measured = with_measured_pass(default_efficiency(cluster.gpu), spec, job, cluster.gpu)
    out = {"untuned": estimate(spec, lay, job, cluster, Efficiency()).step_time_s,
           "measured": estimate(spec, lay, job, cluster, measured).step_time_s,
           "capacity": estimate(spec, lay, job, *on_spare_cores(cluster, measured, spare)).step_time_s,
           "op_us": measured.op_s * 1e6}
    if probe_file is not None:
        linked = apply_probe(cluster, probe_file)
        probed = replace(measured, coll_overhead_s=probe_call_s(probe_file, linked),
                         wake_s=scheduler_wake_s(os.cpu_count()))
        linked = linked if ranks > 1 else cluster
        out["probed"] = estimate(spec, lay, job, *on_spare_cores(linked, probed, spare)).step_time_s
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    ap.add_argument("--repeats", type=int, default=2, help="launches per layout (default 2)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-probe", action="store_true", help="skip the 2-rank probe and its column")
    args = ap.parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or args.repeats < 1 or args.steps <= args.warmup:
        raise SystemExit(f"layouts from {', '.join(LAYOUTS)}; --repeats >= 1; --steps > --warmup")
    runs: dict[str, list] = {n: [] for n in names}
    columns = (("untuned", 12), ("measured", 16), ("capacity", 13)) + (() if args.no_probe else
                                                                        (("probed", 10),))
    from commpipe.plan.cpu import measure_core_capacity

    capacity = measure_core_capacity()
    with tempfile.TemporaryDirectory() as tmp:
        probe_file = None if args.no_probe else Path(tmp) / "probe.json"
        if probe_file is not None:
            from planner_rank import Host, probe

            probe(Host(2), probe_file, 29720)
        for r in range(args.repeats):              # interleaved: load drifts alike for all
            for n in names:
                runs[n].append(train(n, args.steps, args.warmup, Path(tmp) / f"{n}-{r}"))
        print(f"{'layout':<8}{'measured ms':>12}{'spare':>7}"
              + "".join(f"{k + ' ms':>{w}}{'err':>8}" for k, w in columns))
        for n in names:
            ms = statistics.median(t for t, _ in runs[n]) * 1e3
            spare = statistics.fmean(s for _, s in runs[n])
            p = predict(n, spare, probe_file, capacity)
            cells = "".join(f"{p[k] * 1e3:>{w}.1f}{p[k] * 1e3 / ms - 1:>+8.0%}" for k, w in columns)
            print(f"{n:<8}{ms:>12.1f}{spare:>7.2f}{cells}")
    print(f"host time per op {p['op_us']:.2f} us, the {os.cpu_count()} cores run {capacity:.2f} "
          f"lone ranks at once (commpipe.plan.cpu); load average "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
