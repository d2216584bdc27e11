"""How well does the calibrated planner predict our own sweep on the emulated cluster?

    python benchmarks/plan_vs_sweep.py                     # everything, ~3.5 min on 2 cores (root)
    python benchmarks/plan_vs_sweep.py --validate          # + 8 validation layouts, ~5 min
    python benchmarks/plan_vs_sweep.py --sweep runs/demo   # predict an existing demo8 sweep
    python benchmarks/plan_vs_sweep.py --reuse             # reuse OUT's probe, runs and CPU peak

1. An emulated cluster like the demo's (4 nodes x 2 ranks, 50 Mbit/s between nodes) and
   `commpipe probe` on all 8 ranks: intra- and inter-node latency and bandwidth.
2. A calibration sweep of layouts that are *not* in demo8 (1 to 8 ranks, same model, sequence,
   batch and monitor settings as the demo), and `calibrate.fit` on those runs only.
3. The demo8 sweep (or --sweep DIR), each layout predicted with `estimate` for its exact layout,
   schedule, micro-batching and rank placement.
4. Measured against predicted step time per layout, the median absolute error and the measured
   and predicted top 3 (goal: median within 15%, the measured top 3 predicted as the top 3).

Nothing is tuned on the demo8 runs: they are read only to be predicted. --validate adds layouts
in neither set, for judging changes to the model without looking at demo8. Without root (no
network namespaces) the script can still predict from --reuse'd probe and calibration runs.
Output folder (default runs/plan_vs_sweep): probe.json, cpu.json, calib/ and valid/ (sweep
folders), demo8/ (unless --sweep), profile.json (the fit) and result.json (the tables as data).
Results and their reading: docs/planner.md, "Accuracy on our emulated cluster".
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

import numpy as np

from commpipe.cluster.grids import DEMO_MODEL, Grid, Layout, demo8
from commpipe.cluster.launch import NodeCommand, run_commands, torchrun
from commpipe.cluster.sweep import EmulatedRunner, LocalRunner, read_status, run_sweep
from commpipe.plan.calibrate import fit, point_from_run, save_profile
from commpipe.plan.cluster import apply_probe, default_cluster
from commpipe.plan.cpu import measure_cpu
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.estimate import estimate
from commpipe.plan.gpus import GPU

ROOT = Path(__file__).resolve().parents[1]

# Calibration layouts: none of them is a demo8 layout. Small ones isolate one cost each (one
# rank: compute; two ranks on one node: a pipeline hop, TP, CP and DP over loopback); the
# 4- and 8-rank ones put more processes than cores on the host and send DP traffic across nodes.
CALIB_LAYOUTS = [Layout(), Layout(pp=2), Layout(tp=2), Layout(cp=2), Layout(dp=2), Layout(pp=4),
                 Layout(tp=2, dp=2), Layout(tp=2, dp=4)]
# Validation layouts, in neither demo8 nor the calibration set (--validate): for judging changes
# to the model's structure without looking at demo8.
VALID_LAYOUTS = [Layout(tp=2, pp=2), Layout(cp=2, pp=2), Layout(pp=2, dp=2), Layout(cp=2, dp=4),
                 Layout(tp=2, cp=2, dp=2), Layout(cp=2, pp=2, dp=2), Layout(dp=8), Layout(cp=4, pp=2)]
# what the demo trains (commpipe.cluster.sweep.run_demo_sweep): every call monitored and traced
TRAIN = {"model": DEMO_MODEL, "seq_len": 32, "global_batch": 8, "steps": 10, "trace": True,
         "comm_monitor": "all"}
PROBE_SIZES = "1K,4K,16K,64K,256K,1M"


def _log(msg: str) -> None:
    print(msg, flush=True)


# -- measuring ------------------------------------------------------------------------------------
def run_probe(cluster, out: Path, port: int) -> None:
    """`commpipe probe` on every rank of the emulated cluster, one torchrun per node."""
    inner = ["-m", "--", "commpipe", "probe", "--ranks-per-node", str(cluster.ranks_per_node),
             "--sizes", PROBE_SIZES, "--iters", "5", "--out", str(out.resolve())]
    cmds = [NodeCommand(i, torchrun("--nnodes", str(cluster.nodes), "--nproc-per-node",
                                    str(cluster.ranks_per_node), "--node-rank", str(i),
                                    "--master-addr", cluster.node_ip(0), "--master-port", str(port),
                                    *inner), {"GLOO_SOCKET_IFNAME": cluster.ifname}, f"probe-node{i}.log")
            for i in range(cluster.nodes)]
    result = run_commands(cmds, out.parent, cluster=cluster, timeout_s=300)
    if not result.ok or not out.exists():
        raise RuntimeError(f"probe failed: {result.reason} (logs in {out.parent / 'logs'})")


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def gather(args, out: Path) -> Path:
    """Probe, calibration sweep and (unless --sweep) the demo8 sweep; returns the demo8 folder."""
    probe, calib = out / "probe.json", out / "calib"
    demo_dir = Path(args.sweep) if args.sweep else out / "demo8"
    need_probe = not (args.reuse and probe.exists())
    calib_grid = Grid(CALIB_LAYOUTS, dict(TRAIN), "calibration")
    need_calib = not (args.reuse and _complete(calib, calib_grid))
    need_demo = not args.sweep and not (args.reuse and _complete(demo_dir, demo8()))
    valid_grid = Grid(VALID_LAYOUTS, dict(TRAIN), "validation")
    need_valid = args.validate and not (args.reuse and _complete(out / "valid", valid_grid))
    if not (need_probe or need_calib or need_demo or need_valid):
        return demo_dir
    from commpipe.cluster import netns

    ok, why = netns.available()
    if not ok:
        raise SystemExit(f"cannot build the emulated cluster ({why}); run as root with iproute2, or "
                         f"give --reuse with an OUT folder that already holds the probe and the runs")
    prefix = f"cpv{os.getpid() % 10000}"
    with netns.EmulatedCluster(args.nodes, args.ranks_per_node, args.inter_node_mbit, prefix=prefix) as c:
        runner = EmulatedRunner(c, timeout_s=300, base_port=29600)
        if need_probe:
            t0 = time.monotonic()
            run_probe(c, probe, port=29599)
            _log(f"probe: {time.monotonic() - t0:.0f} s -> {probe}  (load average {load_average():.1f})")
        for name, grid, folder, needed in (("calibration", calib_grid, calib, need_calib),
                                           ("validation", valid_grid, out / "valid", need_valid),
                                           ("demo8", demo8(), demo_dir, need_demo)):
            if not needed:
                continue
            train = {**grid.train, **TRAIN}
            t0 = time.monotonic()
            # a layout smaller than a node (one rank) runs on the host: no network to emulate
            small = [lay for lay in grid.layouts if lay.world_size < args.ranks_per_node]
            opts = {"force": not args.reuse, "retry_failed": True, "progress": False, "log": _log}
            records = run_sweep(Grid(small), folder, LocalRunner(300), train, **opts) if small else []
            rest = Grid([lay for lay in grid.layouts if lay not in small], grid.train)
            records += run_sweep(rest, folder, runner, train, **opts)
            bad = [r["name"] for r in records if r["status"] != "ok"]
            _log(f"{name} sweep: {time.monotonic() - t0:.0f} s, {len(records) - len(bad)} ok"
                 + (f", failed: {', '.join(bad)}" if bad else "") + f"  (load average {load_average():.1f})")
    return demo_dir


def _complete(folder: Path, grid: Grid) -> bool:
    status = read_status(folder)
    return all(status.get(lay.name, {}).get("status") == "ok" for lay in grid.layouts)


# -- predicting -----------------------------------------------------------------------------------
# Starting values (and weak priors) of the fitted host terms: orders of magnitude of eager PyTorch
# on a CPU (tens of ~5 us operator calls per layer and pass; a gloo call handed to its worker
# thread; an unfused Adam looping over ~9 tensors per layer; a scheduler slice of ~1 ms).
START = Efficiency(overhead_s=100e-6, coll_overhead_s=100e-6, optimizer_overhead_s=100e-6, wake_s=1e-3)
FITTED = ("overhead_s", "elementwise", "coll_overhead_s", "optimizer_overhead_s", "wake_s")
# commpipe's runtime on CPU trains in fp32; what it sends is layout.runtime_job(features of each run)
DEFAULTS = {"recompute": "none", "precision": "fp32", "flash_attention": None, "grad_fp32": False,
            "zero1": False, "sequence_parallel": False, "dp_overlap": False, "vocab": 256}


def cpu_entry(out: Path, reuse: bool) -> GPU:
    path = out / "cpu.json"
    if reuse and path.exists():
        return GPU(**json.loads(path.read_text()))
    gpu = measure_cpu()
    path.write_text(json.dumps(gpu.to_dict(), indent=2) + "\n")
    return gpu


def model_cluster(gpu: GPU, probe: Path, args):
    """The planner's picture of the emulated cluster: probed links (gloo rings), one link per
    node (a tbf-shaped veth shared by the node's ranks), every rank on this machine's cores."""
    c = default_cluster(gpu, args.nodes * args.ranks_per_node, args.ranks_per_node)
    c = apply_probe(c, probe)
    return replace(c, nics_per_node=1, host_cores=args.cores)


def predict_sweep(folder: Path, cluster, eff: Efficiency) -> list[dict]:
    rows = []
    status = read_status(folder)
    for name, rec in status.items():
        run = folder / name
        if rec.get("status") != "ok" or not (run / "metrics.jsonl").exists():
            continue
        point = point_from_run(run, DEFAULTS)
        c = replace(cluster, num_gpus=point.layout.gpus, node_of=point.node_of)
        est = estimate(point.spec, point.layout, point.job, c, eff)
        times = [json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
                 if line.strip()][2:]
        q1, q3 = np.percentile(times, [25, 75])
        rows.append({"name": name, "measured_ms": point.measured_s * 1e3,
                     "predicted_ms": est.step_time_s * 1e3, "error": est.step_time_s / point.measured_s - 1,
                     "spread": (q3 - q1) / point.measured_s,
                     "kappa": est.host_contention, "kappa_wake": est.wake_contention,
                     "breakdown_ms": {k: v * 1e3 for k, v in est.breakdown.items() if v > 0}})
    return rows


def top3(rows: list[dict], key: str) -> list[str]:
    return [r["name"] for r in sorted(rows, key=lambda r: r[key])[:3]]


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def summary(rows: list[dict]) -> str:
    errs = [abs(r["error"]) for r in rows]
    rho = spearman([r["measured_ms"] for r in rows], [r["predicted_ms"] for r in rows])
    return (f"median |error| {statistics.median(errs):.1%}, max {max(errs):.1%}, "
            f"MAPE {statistics.fmean(errs):.1%}, Spearman {rho:+.2f} over {len(rows)} layouts")


def report(calib_rows, valid_rows, demo_rows, result, demo_dir: Path) -> None:
    print(f"\ncalibration fit on {result.points} runs ({', '.join(result.fitted)}): "
          f"MAPE {result.mape_before:.1%} at the starting values -> {result.mape_after:.1%}")
    for k in result.fitted:
        v = result.params[k]
        print(f"  {k:>22} = {v * 1e3:.4g} ms" if k.endswith("_s") else f"  {k:>22} = {v:.4g}")
    for title, rows in (("calibration runs (fitted)", calib_rows),
                        ("validation runs (predicted)", valid_rows),
                        (f"demo8: {demo_dir} (predicted)", demo_rows)):
        if not rows:
            continue
        print(f"\n{title}")
        print(f"{'layout':<18}{'measured ms':>12}{'IQR':>6}{'predicted ms':>14}{'error':>8}{'kappa':>7}"
              f"{'wake':>6}   largest predicted terms (ms)")
        for r in sorted(rows, key=lambda r: r["measured_ms"]):
            terms = sorted(r["breakdown_ms"].items(), key=lambda kv: -kv[1])[:3]
            print(f"{r['name']:<18}{r['measured_ms']:>12.1f}{r['spread']:>6.0%}{r['predicted_ms']:>14.1f}"
                  f"{r['error']:>+8.1%}{r['kappa']:>7.2f}{r['kappa_wake']:>6.2f}   "
                  + ", ".join(f"{k} {v:.1f}" for k, v in terms))
    print()
    if valid_rows:
        print(f"validation: {summary(valid_rows)}")
    print(f"demo8: {summary(demo_rows)}  (goal: median within 15%)")
    meas, pred = top3(demo_rows, "measured_ms"), top3(demo_rows, "predicted_ms")
    print(f"measured top 3:  {', '.join(meas)}\npredicted top 3: {', '.join(pred)}  "
          f"({'same set' if set(meas) == set(pred) else 'different set'}"
          f"{', same order' if meas == pred else ''})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "plan_vs_sweep"))
    ap.add_argument("--sweep", default=None,
                    help="an existing demo8 sweep folder to predict (e.g. runs/demo)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse OUT's probe.json, cpu.json and finished runs instead of measuring again")
    ap.add_argument("--validate", action="store_true",
                    help="also run and predict the validation layouts (neither demo8 nor calibration)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--inter-node-mbit", type=float, default=50.0)
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="cores the ranks share (default: this machine's, %(default)s)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    demo_dir = gather(args, out)
    cluster = model_cluster(cpu_entry(out, args.reuse), out / "probe.json", args)
    print(f"cluster: {args.nodes} nodes x {args.ranks_per_node} ranks on {args.cores} cores, "
          f"{cluster.gpu.tflops * 1e3:.0f} GFLOP/s and {cluster.gpu.hbm_gbps:.0f} GB/s per core (measured); "
          f"probe: intra {cluster.intra.latency_s * 1e3:.3f} ms {cluster.intra.bandwidth_gbps:.2f} GB/s, "
          f"inter {cluster.inter.latency_s * 1e3:.3f} ms {cluster.inter.bandwidth_gbps * 8e3:.1f} Mbit/s")
    status = read_status(out / "calib")
    points = [point_from_run(out / "calib" / name, DEFAULTS) for name, rec in status.items()
              if rec.get("status") == "ok" and name in {lay.name for lay in CALIB_LAYOUTS}]
    result = fit(points, START, cluster, fit_links=False, params=FITTED)
    save_profile(out / "profile.json", result, [str(out / "calib"), str(out / "probe.json")])
    calib_rows = predict_sweep(out / "calib", cluster, result.eff)
    valid_rows = predict_sweep(out / "valid", cluster, result.eff) if args.validate else []
    demo_rows = predict_sweep(demo_dir, cluster, result.eff)
    if not demo_rows:
        raise SystemExit(f"{demo_dir} holds no finished demo8 runs to predict")
    report(calib_rows, valid_rows, demo_rows, result, demo_dir)
    (out / "result.json").write_text(json.dumps({"fit": result.params, "calibration": calib_rows,
                                                 "validation": valid_rows, "demo8": demo_rows,
                                                 "demo8_dir": str(demo_dir)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
