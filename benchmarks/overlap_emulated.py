"""Overlap on the emulated cluster: median step time with overlap against `--no-overlap`.

    sudo python benchmarks/overlap_emulated.py                  # 2 nodes x 2 ranks, 50 Mbit/s
    sudo python benchmarks/overlap_emulated.py --steps 8 --cases dp
    sudo python benchmarks/overlap_emulated.py --cases tpfwd    # chunked forward all-gather A/B

Two nodes of two ranks (network namespaces on a bridge, commpipe.cluster.netns), the inter-node
links shaped to `--mbit` with tc tbf. Each case trains the same model twice, one run after the
other, with overlap on and with `--no-overlap`, and prints the median step time of each (the
first step, which connects and warms up, left out) and their ratio (goal <= 0.9 for `dp`):

    dp   TP2 inside a node, DP2 across nodes: gradient buckets reduced during the backward
    tp   TP2 across nodes (placement cp-dp-pp-tp), DP2 inside: asynchronous TP (the backward's
         input-gradient collective beside the weight-gradient GEMMs) and DP overlap
    tpfwd  TP2 across nodes, every other overlap on in both runs: the forward all-gathers
         chunked (GEMMs over own rows while the other shards travel, --tp-forward-overlap)
         against --no-tp-forward-overlap; a wide MLP, so the own-row GEMMs last about as long
         as a gather at 50 Mbit/s

The share of communication each overlap hid: the step time it saved, over the time per step the
case's dimension had transfers in flight in the `--no-overlap` run (union of the intervals in
the monitor's trace, `--trace`), where the compute waited for them. Needs root and iproute2;
otherwise it says why and exits 0. Timings on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from _emulated import add_out, emulated_runner, parser, runs_dir, step_times

# per case: the layout, and a model and batch where the overlapped work is comparable to the
# communication at 50 Mbit/s (dp: the backward beside the gradient buckets; tp: the
# weight-gradient GEMMs beside the backward's reduce-scatters, hence a wider model; one DP
# bucket, issued when the backward is done, so that the case shows async TP alone: on 2 shared
# cores a CPU-bound intra-node all-reduce running beside the backward only competes with it)
CASES = {
    "dp": ({"tp": 2, "dp": 2},
           {"model": "arch=llama,layers=4,hidden=128,heads=4,kv_heads=2,ffn_hidden=384,vocab=1024",
            "seq_len": 128, "micro_batch_size": 4}),
    "tp": ({"tp": 2, "dp": 2, "placement": "cp-dp-pp-tp"},
           {"model": "arch=llama,layers=2,hidden=512,heads=8,kv_heads=4,ffn_hidden=1536,vocab=1024",
            "seq_len": 64, "micro_batch_size": 2, "dp_bucket_mb": 1000.0}),
    "tpfwd": ({"tp": 2, "dp": 2, "placement": "cp-dp-pp-tp"},
              {"model": "arch=llama,layers=2,hidden=256,heads=4,kv_heads=2,ffn_hidden=4096,"
                        "vocab=1024",
               "seq_len": 128, "micro_batch_size": 2, "dp_bucket_mb": 1000.0}),
}
# per case: the flags of the A run and of the B run (A/B = the ratio printed)
AB = {"dp": ({}, {"no_overlap": True}), "tp": ({}, {"no_overlap": True}),
      "tpfwd": ({"tp_forward_overlap": True}, {"no_tp_forward_overlap": True})}
AB_NAMES = {"dp": ("overlap", "no-overlap"), "tp": ("overlap", "no-overlap"),
            "tpfwd": ("fwd-chunked", "fwd-unchunked")}


def parse_args(argv=None):
    p = parser(__doc__, mbit=50.0, steps=6, microbatches=1)
    p.add_argument("--bucket-mb", type=float, default=0.25, help="DP gradient bucket size")
    p.add_argument("--cases", default="dp,tp", help="comma-separated: dp, tp, tpfwd")
    add_out(p)
    return p.parse_args(argv)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def inflight_s(run_dir: Path) -> dict[str, float]:
    """From the traces (OUT/trace/rank*.json, steps 1..): per dimension, seconds per step during
    which at least one of its transfers was in flight (union of intervals, mean over ranks)."""
    total, cells = {}, set()
    for f in sorted((run_dir / "trace").glob("rank*.json")):
        events = json.loads(f.read_text())
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        by_step: dict = {}
        for e in events:
            if e.get("ph") != "X" or e.get("cat") != "kernel" or e["args"].get("step", 0) < 1:
                continue
            if e["tid"] == 7:        # the compute stream
                continue
            dim = names.get(e["tid"], "?").split(".")[0]
            by_step.setdefault(e["args"]["step"], {}).setdefault(dim, []).append(
                (e["ts"], e["ts"] + e["dur"]))
            cells.add((f.name, e["args"]["step"]))
        for lanes in by_step.values():
            for dim, ivs in lanes.items():
                total[dim] = total.get(dim, 0.0) + sum(b - a for a, b in _union(ivs)) / 1e6
    n = max(len(cells), 1)
    return {d: t / n for d, t in total.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = runs_dir("overlap_emulated", args.out)
    if out is None:
        return 0
    from commpipe.cluster.grids import Layout

    train = {"steps": args.steps, "microbatches": args.microbatches,
             "comm_monitor": "all", "trace": True, "device": "cpu"}
    rows = []
    with emulated_runner(args.mbit, 2, prefix="cpovl") as run:
        for case in args.cases.split(","):
            times, comm = {}, {}
            for overlap in (True, False):
                name = f"{case}-{AB_NAMES[case][0 if overlap else 1]}"
                layout = Layout(**CASES[case][0], name=name)
                flags = {**train, "dp_bucket_mb": args.bucket_mb, **CASES[case][1],
                         **AB[case][0 if overlap else 1]}
                if not run(layout, flags, out / name):
                    return 1
                times[overlap] = statistics.median(step_times(out / name))
                comm[overlap] = inflight_s(out / name)
            rows.append((case, times, comm))
    print(f"emulated cluster: 2 nodes x 2 ranks, {args.mbit:g} Mbit/s between nodes; "
          f"{args.microbatches} micro-batch(es), {args.steps} steps (median of steps 1..)")
    for case, times, comm in rows:
        ratio = times[True] / times[False]
        print(f"{case}: {CASES[case][0]} {CASES[case][1]}")
        a, b = AB_NAMES[case]
        print(f"    {a} {times[True]:.3f} s, {b} {times[False]:.3f} s, ratio {ratio:.3f} "
              + ("(goal <= 0.9)" if case != "tpfwd" else "(< 1: chunking pays)"))
        # hidden: the step time overlap saved, as a share of the time the case's dimension
        # had transfers in flight per step without overlap (where the compute waited for them)
        dim = {"dp": "dp_cp", "tp": "tp", "tpfwd": "tp"}[case]
        saved = times[False] - times[True]
        parts = ", ".join(f"{d} {t:.3f} s" for d, t in sorted(comm[False].items()) if d != "world")
        print(f"    in flight per step in the {b} run (trace): {parts}; {a} saved "
              f"{saved:.3f} s = {saved / comm[False][dim]:.0%} of the {dim} time")
    print(f"(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
