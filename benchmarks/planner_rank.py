"""Does `commpipe plan --gpu cpu` rank the layouts of this machine as they measure?

    python benchmarks/planner_rank.py                    # 23-27 min on 2 busy vCPUs (root: + emulated)
    python benchmarks/planner_rank.py --no-emulated      # local ranks only, ~10 min
    python benchmarks/planner_rank.py --reuse            # predict OUT's measurements again
    python benchmarks/planner_rank.py --reuse --fit-host # ... with host terms fitted, not measured
    python benchmarks/planner_rank.py --reuse --write-interval   # + the planner's CPU interval
    python benchmarks/planner_rank.py --reuse --write-interval --pool OUT2 OUT3   # over 3 runs

For every tp x cp x pp x dp layout of 4 and of 8 CPU ranks that the tiny LLaMA admits (the demo's
8-layer, 64-wide model, sequence 32, global batch 8, 1F1B):
1. measure: all layouts of one world size train from step 0 in one launch of the same processes
   (commpipe.adapt.oracle), the median step time of the last steps; on this host's loopback,
   and, as root with network namespaces, on the emulated cluster (2 ranks per node) at two
   inter-node rates;
2. predict: `estimate` for the same layout with what a user of `plan --gpu cpu` has on this
   machine and nothing fitted to these runs: the CPU entry (`commpipe.plan.cpu`, one thread's
   matmul peak and copy bandwidth), a `commpipe probe` of the same ranks (links), the cores the
   ranks had (`--host-cores`: this machine's, less what other processes used while the layout
   ran, sampled from /proc, each core worth what `--host-cores auto` measures the machine's
   cores to run at once over their count), the scheduler's wake-up wait (half the kernel's
   default time slice), the host time of a gloo call (the calls after compute of the set's own
   probe less what their links are priced at, as `plan --cluster probe.json` takes it), and
   each pass at the two rates `plan --gpu cpu` measures on the model's first layer (per eager
   op and per unit of work, commpipe.plan.pass_split), read once at the start as a user's one
   `plan` reads them (also read just before and just after each set, for the report);
   with --fit-host instead the per-layer host terms of `plan --calibrate` on the runs of 1 and
   2 ranks (their layouts are in neither set);
3. compare, per set: Spearman rank correlation of measured and predicted step times
   (scipy.stats.spearmanr), the measured time of the predicted best against the measured best,
   and the median |predicted / measured - 1|. Goals: >= 0.9, within 5%, <= 15%.

Output folder (default runs/planner_rank): cpu.json, probe-<set>.json (with probe-<set>-host.json,
the cores other processes left the probe), pass_split-<set>.json (the pass rates read around
it), <set>/ (the oracle's candidates.json and per-layout rows), result.json. Results and their
reading: docs/planner.md, "Ranking this machine's layouts".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _rank_measure import (  # noqa: E402
    CALIB_WORLDS,
    MODEL,
    TRAIN,
    host_capacity,
    measure,
    pass_rates,
)
from _rank_report import probe_spare, report, score, write_interval  # noqa: E402  (siblings)
from _spare_cores import spare_cores  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _log(msg: str) -> None:
    print(msg, flush=True)


# -- predicting -----------------------------------------------------------------------------------
def measured_layouts(folder: Path, cores: int) -> list[dict]:
    """The oracle's candidates at the even split (what `plan` prices), each with median_ms and
    `spare_cores`: the cores other processes left over while its steps ran (each pass ends when
    its rows are written and lasts the sum of its step times), in lone ranks' worth: times the
    machine's measured capacity per core (host_capacity)."""
    share = host_capacity(folder.parent, cores) / cores
    rec = json.loads((folder / "candidates.json").read_text())
    meter = folder / "host_cpu.json"
    samples = json.loads(meter.read_text())["samples"] if meter.exists() else []
    out = []
    for c in rec["candidates"]:
        if c["split"] == "balanced":
            continue
        spare = []
        for suffix, steps in ((".jsonl", c["step_ms"]), (".pass2.jsonl", c.get("step_ms_pass2"))):
            path = folder / "candidates" / f"{c['name']}{suffix}"
            if steps and path.exists():
                end = path.stat().st_mtime
                spare.append(spare_cores(samples, end - sum(steps) / 1e3, end, cores))
        out.append(c | {"spare_cores": share * (statistics.fmean(spare) if spare else float(cores))})
    return out


def planner_inputs(out: Path, name: str, world: int, cores: int):
    """(spec, job, cluster) as `plan --gpu cpu --cluster probe-<name>.json --host-cores N`
    builds them (plan.cli_inputs' for_cluster: the job commpipe's runtime runs)."""
    from commpipe.models.spec import resolve_model
    from commpipe.plan.cli_inputs import for_cluster
    from commpipe.plan.cluster import apply_probe, default_cluster
    from commpipe.plan.gpus import GPU
    from commpipe.plan.layout import Job

    gpu = GPU(**json.loads((out / "cpu.json").read_text()))
    rpn = world if name.startswith(("local", "calib")) else 2
    cluster = default_cluster(gpu, world, min(rpn, world))
    if (out / f"probe-{name}.json").exists():
        cluster = apply_probe(cluster, out / f"probe-{name}.json")
    cluster = replace(cluster, host_cores=cores, backend="gloo",
                      nics_per_node=None if name.startswith(("local", "calib")) else 1)
    job = for_cluster(Job(TRAIN["global_batch"], TRAIN["seq_len"], precision="fp32"), cluster,
                      "commpipe")
    return resolve_model(MODEL), job, cluster


def plan_layout(c: dict):
    from commpipe.plan.layout import Layout

    return Layout(c["tp"], c["cp"], c["pp"], c["dp"], 1, c["micro_batch_size"], c["schedule"], "none")


def on_spare_cores(cluster, eff, spare: float):
    """The cluster and host terms of ranks that had `spare` cores between them: processor sharing
    (`Cluster.host_cores`, commpipe.plan.host); below one core even a lone rank runs at `spare`
    of its speed, so the CPU's rates shrink and its host terms grow by that factor instead."""
    if spare >= 1.0:
        return replace(cluster, host_cores=spare), eff
    gpu = replace(cluster.gpu, tflops=cluster.gpu.tflops * spare, hbm_gbps=cluster.gpu.hbm_gbps * spare)
    eff = replace(eff, overhead_s=eff.overhead_s / spare, coll_overhead_s=eff.coll_overhead_s / spare,
                  optimizer_overhead_s=eff.optimizer_overhead_s / spare, op_s=eff.op_s / spare,
                  work_s=eff.work_s / spare)
    return replace(cluster, gpu=gpu, host_cores=1), eff


def scheduler_wake_s(cores: int) -> float:
    """How long a woken rank waits for a core per busy rank ahead of it: half of Linux's EEVDF base
    slice, 0.75 ms x (1 + log2(min(cores, 8))) (kernel/sched/fair.c, sysctl_sched_base_slice with
    the default logarithmic CPU scaling): a wake-up lands on average halfway through the running
    rank's slice. The planner's `Efficiency.wake_s` (commpipe.plan.host), from the kernel's
    defaults, not fitted."""
    import math

    return 0.75e-3 * (1 + int(math.log2(min(max(cores, 1), 8)))) / 2


def probe_call_s(path: Path, cluster) -> float:
    """Host time of one gloo collective call as `plan --cluster` takes it from a probe of two
    ranks on one node (`cluster`, that probe applied): each op's mean time after compute less
    its latency steps and bytes on the probed link (commpipe.plan.cluster.probe_call_overhead)."""
    from commpipe.plan.cluster import probe_call_overhead

    call = probe_call_overhead(path, cluster)
    if call is None:
        raise SystemExit(f"{path} holds no calls after compute (a probe from before they were "
                         "measured): measure again without --reuse")
    return call


def set_pass_readings(out: Path, name: str) -> str:
    """The pass rates read just before and just after set `name`'s layouts trained
    (OUT/pass_split-<name>.json), for the report: not what the set is priced with, which is the
    run's first reading as a user's one `plan --gpu cpu` gives it. On this host one reading
    varies from the next by about a quarter either way, with no drift that a reading closer to
    the set would follow (consecutive readings are uncorrelated: docs/planner.md, "CPU ranks")."""
    path = out / f"pass_split-{name}.json"
    if not path.exists():
        return ""
    b = json.loads(path.read_text())
    return (f"; read around the set: {b['before']['op_s'] * 1e6:.1f} and "
            f"{b['after']['op_s'] * 1e6:.1f} us per op, {b['before']['work_s'] * 1e11:.1f} and "
            f"{b['after']['work_s'] * 1e11:.1f}e-11 s per unit of work")


def host_terms(out: Path, cores: int, wake_s: float = 0.0, fit: bool = False):
    """The host terms. By default measured, nothing fitted: each pass at the rates `plan --gpu
    cpu` measures on the model's first layer (its eager ops at the time per op, its FLOPs at
    the time per unit of work: pass_rates, commpipe.plan.pass_split; the optimizer's ops at
    the same time per op, commpipe.plan.runtime_ops), the host time per collective call from
    the probe (probe_call_s), no per-pass or per-layer overhead beside them; the summary's MAPE
    is then that of the runs of 1 and 2 ranks, predicted. With `fit` (--fit-host), as a user
    calibrates on small runs of their own machine (`plan --calibrate`: trust-region least
    squares on log step time, calibrate.fit's method): on top of the measured pass, overheads
    per layer pass and per layer held by the optimizer, from the runs of 1 and 2 ranks (none of
    them a layout of 4 or 8 ranks), each priced on the cores it had to spare. The per-call time
    is the probe's either way: fitted, it also takes up the wait for the partner rank to be
    scheduled, which the host model counts separately (wake_s) and which is not CPU work.
    Returns (Efficiency, summary)."""
    import numpy as np
    from scipy.optimize import least_squares

    from commpipe.plan.efficiency import Efficiency
    from commpipe.plan.estimate import estimate

    points = []
    for world in CALIB_WORLDS:
        spec, job, cluster = planner_inputs(out, f"calib{world}", world, cores)
        points += [(spec, plan_layout(c), job, cluster, c)
                   for c in measured_layouts(out / f"calib{world}", cores)]
    call_s = probe_call_s(out / "probe-calib2.json", planner_inputs(out, "calib2", 2, cores)[2])
    meas = np.array([c["median_ms"] / 1e3 for *_, c in points])
    if not fit:
        split = pass_rates(out)
        op_s = split["op_s"]
        eff = Efficiency(overhead_s=0.0, coll_overhead_s=call_s, op_s=op_s,
                         work_s=split["work_s"], wake_s=wake_s)
        pred = np.array([estimate(spec, lay, job, *on_spare_cores(cl, eff, c["spare_cores"]),
                                  detail=False).step_time_s for spec, lay, job, cl, c in points])
        return eff, {"runs": len(points), "params": {"coll_overhead_s": call_s, "op_s": op_s},
                     "mape": float(np.mean(np.abs(pred / meas - 1))), "wake_s": wake_s,
                     "fitted": False}
    names = ("overhead_s", "optimizer_overhead_s")
    split = pass_rates(out)
    start = Efficiency(overhead_s=100e-6, coll_overhead_s=call_s, optimizer_overhead_s=100e-6,
                       wake_s=wake_s, op_s=split["op_s"], work_s=split["work_s"])

    def predict(theta) -> np.ndarray:
        eff = replace(start, **dict(zip(names, np.exp(theta))))
        return np.array([estimate(spec, lay, job, *on_spare_cores(cl, eff, c["spare_cores"]),
                                  detail=False).step_time_s for spec, lay, job, cl, c in points])

    theta0 = np.log([getattr(start, k) for k in names])
    sol = least_squares(lambda t: np.log(predict(t) / meas), theta0, diff_step=0.02, method="trf")
    eff = replace(start, **dict(zip(names, np.exp(sol.x))))
    mape = float(np.mean(np.abs(predict(sol.x) / meas - 1)))
    params = {k: getattr(eff, k) for k in ("coll_overhead_s",) + names}
    return eff, {"runs": len(points), "params": params, "mape": mape,
                 "wake_s": wake_s, "fitted": True}


def predict_set(out: Path, name: str, world: int, cores: int, eff, fitted: bool = False
                ) -> list[dict]:
    """Every measured layout of set `name` predicted with host terms `eff`; unless they were
    fitted with the calibration runs' call time (`fitted`, as a calibrated profile's terms win
    in `plan`), a gloo call's host time is the set's own probe's, as `plan --cluster
    probe-<name>.json` takes it."""
    from commpipe.plan.estimate import estimate

    spec, job, full = planner_inputs(out, name, world, cores)
    probe = out / f"probe-{name}.json"
    call_from = "the calibration runs' probe" + probe_spare(out, "calib2")
    if probe.exists() and not fitted:
        eff = replace(eff, coll_overhead_s=probe_call_s(probe, full))
        call_from = "its probe" + probe_spare(out, name)
    pass_from = (f"the run's first reading, {eff.op_s * 1e6:.1f} us per op and "
                 f"{eff.work_s * 1e11:.1f}e-11 s per unit of work" + set_pass_readings(out, name))
    rows = []
    for c in measured_layouts(out / name, cores):
        cluster, host = on_spare_cores(full, eff, c["spare_cores"])
        e = estimate(spec, plan_layout(c), job, cluster, host)
        rows.append({"layout": c["name"].removesuffix("-1f1b"), "measured_ms": c["median_ms"],
                     "predicted_ms": e.step_time_s * 1e3,
                     "error": e.step_time_s * 1e3 / c["median_ms"] - 1,
                     "steps_ms": c["step_ms"] + c.get("step_ms_pass2", []),
                     "kappa": e.host_contention, "spare_cores": c["spare_cores"],
                     "call_ms": eff.coll_overhead_s * 1e3, "call_from": call_from,
                     "pass_from": pass_from,
                     "breakdown_ms": {k: v * 1e3 for k, v in e.breakdown.items() if v > 0}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "planner_rank"))
    ap.add_argument("--reuse", action="store_true",
                    help="keep OUT's CPU entry, probes and measured sets; measure only what is missing")
    ap.add_argument("--no-emulated", action="store_true", help="local ranks only")
    ap.add_argument("--rates", default="50,500",
                    help="inter-node rates of the emulated cluster, Mbit/s (default 50,500)")
    ap.add_argument("--steps", type=int, default=5, help="steps per layout (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median (default 2)")
    ap.add_argument("--repeat-best", type=int, default=2,
                    help="the fastest this many are measured again after the others (default 2)")
    ap.add_argument("--pool", nargs="*", default=[], metavar="OUT",
                    help="with --write-interval: also count the layouts of these earlier runs' "
                         "result.json (predicted with the code that wrote them: --reuse them first)")
    ap.add_argument("--write-interval", action="store_true",
                    help="store the quantiles of measured / predicted step time in "
                         "commpipe/plan/interval.py (the planner's CPU interval)")
    ap.add_argument("--fit-host", action="store_true",
                    help="fit the per-pass and optimizer host terms on the runs of 1 and 2 ranks (the "
                         "former method) instead of pricing each pass's ops at the measured time per op")
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="cores the ranks share (default: this machine's, %(default)s)")
    args = ap.parse_args(argv)
    args.rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if len(args.rates) < 1 or args.steps <= args.warmup:
        raise SystemExit("--rates needs at least one rate and --steps must exceed --warmup")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    names = measure(args, out)
    _log(f"measured in {time.monotonic() - t0:.0f} s")
    eff, fitted = host_terms(out, args.cores, scheduler_wake_s(args.cores), fit=args.fit_host)
    sets = {name: predict_set(out, name, int(name.split("mbit")[-1].removeprefix("local")),
                              args.cores, eff, fitted["fitted"]) for name in names}
    report(sets, fitted)
    if args.write_interval:
        write_interval(sets, [Path(p) for p in args.pool])
    (out / "result.json").write_text(json.dumps(
        {"host_terms": fitted, "cores": args.cores, "steps": args.steps,
         "warmup": args.warmup, "sets": {n: {"score": score(r), "rows": r} for n, r in sets.items()}},
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
