"""`commpipe simulate`: time a pipeline schedule on a cost table, without any GPU.

    commpipe simulate --schedule 1f1b --pp 4 --microbatches 8
    commpipe simulate --schedule zbv --pp 4 --microbatches 8 --costs f=1,b=2,w=1 --json
    commpipe simulate --schedule my.csv --png gantt.png --trace trace.json
    commpipe simulate --compare runs/r --trace overlay.json   (a run trained with --trace)

The schedule is generated (or loaded from CSV), lowered, validated, checked for deadlock and
executed on the cost table; `--json` prints only a JSON object on stdout.
"""

from __future__ import annotations

import json
import sys

from commpipe.schedules import GENERATORS, generate, load_csv
from commpipe.sim.costs import parse_costs
from commpipe.sim.engine import simulate
from commpipe.sim.export import gantt_png, text_timeline, to_chrome_trace


def add_arguments(parser) -> None:
    parser.add_argument("--schedule", default=None,
                        help=f"schedule name ({', '.join(GENERATORS)}) or a schedule .csv file")
    parser.add_argument("--compare", default=None, metavar="RUN_DIR",
                        help="overlay a run trained with --trace on its simulation (cost table "
                             "calibrated from that run) and report the per-rank difference")
    parser.add_argument("--pp", type=int, help="pipeline ranks (read from the CSV if omitted)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step")
    parser.add_argument("--vpp", type=int, default=None,
                        help="model chunks per rank (interleaved: >= 2; zbv: always 2)")
    parser.add_argument("--costs", default=None,
                        help="a .json cost file or key=value list, e.g. f=1,b=2,w=1,latency_ms=0.05,"
                             "bandwidth_gbps=25,activation_bytes=1e6,tp_comm=0.2,tp_mode=overlapped. "
                             "Scalars are per micro-batch through one rank's share of the model "
                             "(split evenly over its chunks); JSON lists are per stage. "
                             "Default f=1,b=2 (i=w=b/2). tp_comm: one pass's TP collective time (F, or "
                             "B/I) per rank share; braids and units split it per unit "
                             "(docs/schedules.md). ep_comm: the same for a MoE stage's "
                             "expert-parallel all-to-alls, blocking in plain passes, on an EP "
                             "stream beside the other pass in braids")
    parser.add_argument("--json", action="store_true", help="print only a JSON object on stdout")
    parser.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    parser.add_argument("--png", default=None, help="write a Gantt chart PNG here")


def _program(args):
    if args.schedule.endswith(".csv"):
        prog = load_csv(args.schedule)
        for flag, given, actual in (("--pp", args.pp, prog.pp),
                                    ("--microbatches", args.microbatches, prog.microbatches),
                                    ("--vpp", args.vpp, prog.vpp)):
            if given is not None and given != actual:
                raise ValueError(f"{args.schedule} has {flag[2:]}={actual} but {flag} {given} was "
                                 f"given; drop {flag} or edit the CSV")
        return prog
    missing = [f for f, v in (("--pp", args.pp), ("--microbatches", args.microbatches)) if v is None]
    if missing:
        raise ValueError(f"--schedule {args.schedule} needs {' and '.join(missing)}")
    return generate(args.schedule, args.pp, args.microbatches,
                    args.vpp if args.vpp is not None else 1)


def _compare(args) -> int:
    from commpipe.sim.compare import compare_run, overlay_trace

    cmp = compare_run(args.compare)
    out = sys.stderr if args.json else sys.stdout
    if args.trace:
        print(f"overlay trace: {overlay_trace(cmp, args.trace)}", file=out)
    if args.png:
        print(f"predicted gantt: {gantt_png(cmp.result, args.png)}", file=out)
    print(json.dumps(cmp.to_dict()) if args.json else cmp.table())
    return 0


def run(args) -> int:
    if args.compare:
        ignored = [f for f, v in (("--schedule", args.schedule), ("--pp", args.pp), ("--vpp", args.vpp),
                                  ("--microbatches", args.microbatches), ("--costs", args.costs))
                   if v is not None]
        if ignored:
            raise ValueError(f"--compare simulates the run's own schedule and layout on costs calibrated "
                             f"from it; drop {', '.join(ignored)}")
        return _compare(args)
    if not args.schedule:
        raise ValueError("give --schedule NAME|CSV (or --compare RUN_DIR)")
    prog = _program(args)
    costs = parse_costs(args.costs, prog)
    res = simulate(prog, costs)
    out = sys.stderr if args.json else sys.stdout
    if args.trace:
        print(f"trace: {to_chrome_trace(res, args.trace)}", file=out)
    if args.png:
        print(f"gantt: {gantt_png(res, args.png)}", file=out)
    if args.json:
        print(json.dumps(res.to_dict()))
        return 0
    p = res.program
    print(f"{p.name}: pp={p.pp} microbatches={p.microbatches} stages={p.num_stages} "
          f"(vpp={p.vpp})")
    print(f"makespan {res.makespan:.4g} ms   bubble {res.bubble_fraction:.2%} "
          f"(idle share, mean over ranks)")
    if res._tp:
        print(f"tp_bubble {res.to_dict()['tp_bubble']:.4g} ms (TP communication the compute waits "
              f"for, mean over ranks)")
    if res.ep_exposed:
        print(f"ep_exposed {res.to_dict()['ep_exposed']:.4g} ms (expert-parallel all-to-all time "
              f"the compute waits for, mean over ranks)")
    print("rank      busy      idle  peak activations (micro-batch units)")
    for r in range(p.pp):
        print(f"{r:>4} {res.busy[r]:>9.4g} {res.idle[r]:>9.4g}  {res.peak_activations[r]:g}")
    grid = text_timeline(res)
    if grid:
        print(grid)
    elif sum(len(a) for a in prog.compute_only().actions) <= 400:
        print(prog.compute_only())
    return 0
