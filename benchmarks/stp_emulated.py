"""STP against interleaved 1F1B and ZB-V where TP communication is exposed, measured and simulated.

    sudo python benchmarks/stp_emulated.py                      # 2 nodes x 2 ranks, 200 Mbit/s
    sudo python benchmarks/stp_emulated.py --seq-len 128 --rounds 1 --schedules stp,interleaved

Two emulated nodes (network namespaces on a bridge, commpipe.cluster.netns) of two ranks, the
inter-node links shaped to `--mbit` with tc tbf. TP2 spans the two nodes (placement
cp-dp-pp-tp), PP2 stays inside each node; an 8-layer LLaMA of hidden 128, 16 micro-batches of
one sequence of 256 tokens. Each schedule trains the same model in turn, three rounds in
alternating order; printed per schedule:

- the median step time (steps 1.., the first connects and warms up) and interleaved/stp and
  zbv/stp ratios (goal: interleaved/stp >= 1.10);
- the monitor's TP exposure: milliseconds per step the compute waited for TP collectives (the
  `blocked_ms_total` of dim tp in OUT/monitor/rank*.jsonl, summed per step, mean over ranks,
  median over steps), beside their transfer time;
- the simulator's prediction of the same ratios, from costs measured in the zbv run (whose TP
  collectives block), calibrated as `commpipe simulate --compare` does: per chunk, the median
  compute of F, I and W without the time they waited for TP, and that wait per pass as
  `tp_comm`; the same Programs simulated with the TP stream.

Needs root and iproute2; otherwise it says why and exits 0. On a shared 2-core machine the four
ranks contend for the cores: quote ratios, not absolute times.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from _emulated import (
    add_out,
    emulated_runner,
    exposure_per_step,
    parser,
    runs_dir,
    step_times,
)

MODEL = "arch=llama,layers=8,hidden=128,heads=4,kv_heads=2,ffn_hidden=384,vocab=1024"
VPP = {"interleaved": 2, "zbv": 1, "stp": 1, "dualpipev": 1}


def parse_args(argv=None):
    p = parser(__doc__, mbit=200.0, steps=5, microbatches=16)
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per sequence (default 256; at 128 a braid has less compute per "
                        "collective to hide it behind, docs/schedules.md)")
    p.add_argument("--model", default=MODEL, help=f"model (default {MODEL})")
    p.add_argument("--pp", type=int, default=2, choices=(1, 2),
                   help="pipeline ranks per node (default 2: four ranks; 1: two ranks, one per "
                        "core on a 2-core host, each still holding a V of two chunks)")
    p.add_argument("--schedules", default="stp,interleaved,zbv",
                   help="comma-separated, of stp, interleaved (vpp 2), zbv, dualpipev")
    p.add_argument("--rounds", type=int, default=3,
                   help="run the schedules this many times, alternating their order (default 3)")
    add_out(p)
    p.add_argument("--gantt", default=None, help="draw a window of the stp run's step here (PNG)")
    return p.parse_args(argv)


def simulated(schedule: str, pp: int, microbatches: int, costs) -> float:
    """The simulator's step for `schedule` with the zbv run's calibrated costs (chunk costs of
    the zbv layout's 4 chunks of 2 layers; interleaved vpp 2 and the V schedules have the same
    chunks)."""
    from commpipe.schedules import generate
    from commpipe.sim import simulate

    return simulate(generate(schedule, pp, microbatches, VPP[schedule]), costs).makespan


def gantt(run_dir: Path, path: Path, window_ms: float = 400.0) -> Path:
    """A window of the last traced step of a run, per rank: compute on top (braids hatched),
    each TP collective below it from issue to completion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from commpipe.report.figures import load_events

    events = [e for e in load_events(run_dir) if isinstance(e.get("rank"), int)
              and e["stream"] in ("compute", "tp") and e.get("name") != "wait"]
    step = max(e.get("step", 0) for e in events)
    events = [e for e in events if e.get("step", 0) == step]
    t0 = min(e["start_ms"] for e in events)
    mid = (max(e["end_ms"] for e in events) - t0) / 2
    lo, hi = mid - window_ms / 2, mid + window_ms / 2
    ranks = sorted({e["rank"] for e in events})
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(ranks) + 1.4))
    for e in events:
        a, b = e["start_ms"] - t0, e["end_ms"] - t0
        if b < lo or a > hi:
            continue
        y = ranks.index(e["rank"])
        if e["stream"] == "compute":
            braid = "&" in e["name"]
            ax.broken_barh([(a, b - a)], (y, 0.45), color="#4c72b0" if braid else "#8fbc8f",
                           hatch="//" if braid else None, edgecolor="white", linewidth=0.3)
        else:
            ax.broken_barh([(a, b - a)], (y + 0.5, 0.3), color="#dd8452", edgecolor="white",
                           linewidth=0.3)
    ax.set_xlim(lo, hi)
    ax.set_yticks([i + 0.4 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms since step {step} began")
    ax.legend(handles=[Patch(color="#4c72b0", hatch="//", label="braid (F&I, F&W)"),
                       Patch(color="#8fbc8f", label="plain action"),
                       Patch(color="#dd8452", label="TP collective, issue to completion")],
              fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(f"stp, measured: {window_ms:.0f} ms in the middle of a step (TP2 across two "
                 "emulated nodes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    out = runs_dir("stp_emulated", args.out)
    if out is None:
        return 0
    from commpipe.cluster.grids import Layout
    from commpipe.sim.compare import calibrate_run

    schedules = args.schedules.split(",")
    if "zbv" not in schedules:
        schedules.append("zbv")                     # the simulator's costs come from its run
    flags = {"steps": args.steps, "microbatches": args.microbatches, "model": args.model,
             "seq_len": args.seq_len, "micro_batch_size": 1, "comm_monitor": "all",
             "trace": True, "device": "cpu"}
    steps, tp = {}, {}
    # rounds run the schedules in turn, each round in the reverse order of the one before
    # (stp, interleaved, zbv, zbv, interleaved, stp, ...), so drifting load hits all alike; a
    # schedule's step time is the median over all its rounds' steps
    order = [s for k in range(args.rounds) for s in (schedules if k % 2 == 0 else schedules[::-1])]
    with emulated_runner(args.mbit, args.pp, prefix="cpstp") as train:
        for k, name in enumerate(order):
            run = name if k < len(schedules) else f"{name}-{k // len(schedules)}"
            layout = Layout(tp=2, pp=args.pp, schedule=name, vpp=VPP[name], name=run,
                            placement="cp-dp-pp-tp")
            if not train(layout, flags, out / run):
                return 1
            these = step_times(out / run)
            steps.setdefault(name, []).extend(these)
            got = exposure_per_step(out / run, "tp")
            tp.setdefault(name, []).append(got)
            print(f"{run}: median step {statistics.median(these):.3f} s; TP per "
                  f"step: exposed {got['exposed_ms']:.0f} ms, in transfer "
                  f"{got['transfer_ms']:.0f} ms", flush=True)
    times = {name: statistics.median(v) for name, v in steps.items()}
    tp = {name: {k: statistics.median(r[k] for r in v) for k in v[0]} for name, v in tp.items()}
    _, costs, _ = calibrate_run(out / "zbv")
    pred = {s: simulated(s, args.pp, args.microbatches, costs) for s in schedules}
    print(f"\nemulated cluster: 2 nodes x {args.pp} ranks, {args.mbit:g} Mbit/s between nodes; TP2 "
          f"across nodes, PP{args.pp} inside; {args.model}, seq {args.seq_len}, "
          f"{args.microbatches} micro-batches, {args.steps} steps x {args.rounds} round(s) "
          "(median of steps 1.. of every round)")
    print("simulator costs from the zbv run (commpipe.sim.compare.calibrate_run), ms per chunk: "
          f"f {[round(x, 1) for x in costs.f]}, i {[round(x, 1) for x in costs.i]}, "
          f"w {[round(x, 1) for x in costs.w]}, tp_comm {costs.tp_comm[0]:.1f} per pass")
    print("schedule    | step s | TP exposed ms/step | ratio to stp | simulated ms | sim ratio")
    for s in schedules:
        base, sbase = times.get("stp"), pred.get("stp")
        r = f"{times[s] / base:.3f}" if base else "-"
        sr = f"{pred[s] / sbase:.3f}" if sbase else "-"
        print(f"{s:<11} | {times[s]:6.3f} | {tp[s]['exposed_ms']:18.0f} | {r:>12} | "
              f"{pred[s]:12.1f} | {sr:>9}")
    if "stp" in times and "interleaved" in times:
        print(f"interleaved/stp {times['interleaved'] / times['stp']:.3f} (goal >= 1.10); "
              f"simulated {pred['interleaved'] / pred['stp']:.3f}")
    if args.gantt and "stp" in times:
        print(f"gantt: {gantt(out / 'stp', Path(args.gantt))}")
    print(f"(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
