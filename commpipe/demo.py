"""`commpipe demo`: the README's main job.

A tiny LLaMA (8 layers, hidden 64) trained for a few steps under 8 layouts that mirror the
study in docs/sweeps.md (TP inside a node against across nodes, PP depth, CP on and off, DP) on
an emulated 4-node x 2-rank cluster whose inter-node links are throttled to 50 Mbit/s (local
loopback where network namespaces cannot be built: no root or no iproute2), then the report.

    commpipe demo                       # -> runs/demo/report.html
    commpipe demo --inter-node-mbit 200 --steps 6 --out runs/demo-fast
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from commpipe.report.tables import terminal_table
from commpipe.runtime.device_time import check_factor

STEPS, MBIT = 10, 50.0     # the layout demo's defaults


def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/demo", help="sweep folder (default runs/demo); "
                   "finished layouts are reused, delete the folder to start over")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per layout (default {STEPS})")
    p.add_argument("--inter-node-mbit", type=float, default=MBIT,
                   help=f"inter-node link rate of the emulated cluster (default {MBIT:g})")
    p.add_argument("--cluster", default="auto", choices=("auto", "emulated", "local"),
                   help="auto: emulated when possible, else local loopback")
    p.add_argument("--adaptive", action="store_true",
                   help="the adaptive-training story instead (docs/adaptive.md): a link blip to "
                        "ignore, then a lasting degrade; adaptive, static and oracle runs")
    p.add_argument("--emulate-device", type=float, default=1.0, metavar="F",
                   help="--adaptive: every run's compute takes F times its host time, the rest "
                        "left idle as a GPU leaves the host (commpipe train --emulate-device; "
                        "docs/adaptive.md). Default 1: the host's own compute")
    p.add_argument("--elastic", action="store_true",
                   help="elastic training (docs/checkpoints.md): a node lost, a rank hung, the "
                        "node back; the job continues on the ranks there are")
    p.add_argument("--kill-node", default="1@10", metavar="NODE@STEP",
                   help="--elastic: SIGKILL this node's agent and workers after STEP (default 1@10)")
    p.add_argument("--stop-rank", default="1@30", metavar="RANK@STEP",
                   help="--elastic: SIGSTOP this rank of the survivors at STEP (default 1@30)")
    p.add_argument("--hang-timeout-s", type=float, default=10.0,
                   help="--elastic: the hang watchdog's timeout (default 10)")


def run(args) -> int:
    emulate = getattr(args, "emulate_device", 1.0)
    if emulate != 1.0 and (not args.adaptive or getattr(args, "elastic", False)):
        print("commpipe demo: error: --emulate-device is for the adaptive demo alone (commpipe "
              "demo --adaptive --emulate-device F, without --elastic); the layout and elastic "
              "demos run on the host's compute", file=sys.stderr)
        return 2
    try:
        check_factor(emulate)
    except ValueError as e:
        print(f"commpipe demo: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "elastic", False):
        return run_elastic(args)
    if args.adaptive:
        from commpipe.adapt.demo import Scenario, run_adaptive_demo
        from commpipe.adapt.demo_summary import format_summary

        ignored = [flag for flag, given in (
            ("--cluster local", args.cluster == "local"),
            ("--steps", args.steps != STEPS),
            ("--inter-node-mbit", args.inter_node_mbit != MBIT)) if given]
        if ignored:
            verb = "is" if len(ignored) == 1 else "are"
            print(f"commpipe demo: error: {', '.join(ignored)} {verb} for the layout demo; the adaptive "
                  "demo runs its own scenario on the emulated cluster (root and iproute2; "
                  "docs/adaptive.md). Drop the flag, or train with --adapt on your layout: "
                  "commpipe train ... --adapt", file=sys.stderr)
            return 2

        out = Path(args.out if args.out != "runs/demo" else "runs/demo-adaptive")
        print(f"commpipe demo --adaptive -> {out}")
        try:
            summary = run_adaptive_demo(out, Scenario(emulate_device=args.emulate_device))
        except RuntimeError as e:     # a run failed, or no emulated cluster: the demo failed
            print(f"commpipe demo: error: {e}", file=sys.stderr)
            return 1
        print()
        print(format_summary(summary))
        print(f"report: {summary['report']}")
        return 0
    from commpipe.cluster.sweep import run_demo_sweep, said_stopped
    from commpipe.cluster.sweep_state import Interrupted, signals_interrupt

    out = Path(args.out)
    link = ("local loopback" if args.cluster == "local"
            else f"{args.inter_node_mbit:g} Mbit/s between nodes")
    print(f"commpipe demo: 8 layouts x {args.steps} steps, 4 nodes x 2 ranks, {link} -> {out}")
    try:
        with signals_interrupt():    # SIGTERM/SIGINT: the layout in progress is recorded, as a sweep's
            _, html = run_demo_sweep(out, steps=args.steps, inter_node_mbit=args.inter_node_mbit,
                                     cluster=args.cluster)
    except (Interrupted, KeyboardInterrupt) as e:
        return said_stopped(e, out)
    # a table that fits a 100-column terminal; report.html holds every column and figure
    rows = json.loads((out / "results.json").read_text())
    print()
    print(terminal_table(rows, width=100, report=str(html)))
    return 0


def run_elastic(args) -> int:
    from commpipe.elastic_demo import format_summary, parse_at, run_elastic_demo

    try:
        kill = parse_at(args.kill_node, "--kill-node")
        stop = parse_at(args.stop_rank, "--stop-rank")
    except ValueError as e:
        print(f"commpipe demo: error: {e}", file=sys.stderr)
        return 2
    if kill[0] != 1:
        print("commpipe demo: error: --kill-node: the demo's nodes are 0 (it hosts the "
              "rendezvous) and 1; kill node 1", file=sys.stderr)
        return 2
    from commpipe.elastic_demo import SAVE_EVERY

    if kill[1] < SAVE_EVERY:
        print(f"commpipe demo: error: --kill-node step {kill[1]} comes before the first "
              f"checkpoint (step {SAVE_EVERY}), which the survivors resume from; use a step "
              f">= {SAVE_EVERY}", file=sys.stderr)
        return 2
    if stop[1] <= kill[1]:
        print(f"commpipe demo: error: --stop-rank step {stop[1]} must come after the --kill-node "
              f"step {kill[1]}", file=sys.stderr)
        return 2
    out = Path(args.out if args.out != "runs/demo" else "runs/demo-elastic")
    print(f"commpipe demo --elastic -> {out}")
    try:
        summary = run_elastic_demo(out, kill, stop, args.hang_timeout_s, args.cluster)
    except RuntimeError as e:
        print(f"commpipe demo: error: {e}", file=sys.stderr)
        return 1
    print()
    print(format_summary(summary))
    print(f"report: {summary['report']}")
    return 0
