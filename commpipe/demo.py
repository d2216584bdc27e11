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


def add_arguments(p) -> None:
    p.add_argument("--out", default="runs/demo", help="sweep folder (default runs/demo); "
                   "finished layouts are reused, delete the folder to start over")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--inter-node-mbit", type=float, default=50.0,
                   help="inter-node link rate of the emulated cluster (default 50)")
    p.add_argument("--cluster", default="auto", choices=("auto", "emulated", "local"),
                   help="auto: emulated when possible, else local loopback")
    p.add_argument("--adaptive", action="store_true",
                   help="the adaptive-training story instead (docs/adaptive.md): a link blip to "
                        "ignore, then a lasting degrade; adaptive, static and oracle runs")


def run(args) -> int:
    if args.adaptive:
        from commpipe.adapt.demo import format_summary, run_adaptive_demo

        out = Path(args.out if args.out != "runs/demo" else "runs/demo-adaptive")
        print(f"commpipe demo --adaptive -> {out}")
        try:
            summary = run_adaptive_demo(out)
        except RuntimeError as e:     # a run failed, or no emulated cluster: the demo failed
            print(f"commpipe demo: error: {e}", file=sys.stderr)
            return 1
        print()
        print(format_summary(summary))
        print(f"report: {summary['report']}")
        return 0
    from commpipe.cluster.sweep import run_demo_sweep

    out = Path(args.out)
    print(f"commpipe demo: 8 layouts x {args.steps} steps, 4 nodes x 2 ranks, "
          f"{args.inter_node_mbit:g} Mbit/s between nodes -> {out}")
    _, html = run_demo_sweep(out, steps=args.steps, inter_node_mbit=args.inter_node_mbit,
                             cluster=args.cluster)
    # a table that fits a 100-column terminal; report.html holds every column and figure
    rows = json.loads((out / "results.json").read_text())
    print()
    print(terminal_table(rows, width=100, report=str(html)))
    return 0
