"""DualPipeV against 1F1B and ZB-V where the expert-parallel all-to-all crosses a slow link.

    sudo python benchmarks/moe_ep_emulated.py                    # 2 nodes x 2 ranks, 200 Mbit/s
    sudo python benchmarks/moe_ep_emulated.py --rounds 1 --steps 3 --schedules dualpipev,1f1b

Two emulated nodes (network namespaces on a bridge, commpipe.cluster.netns) of two ranks, the
inter-node links shaped to `--mbit` with tc tbf. PP2 x DP2 with EP2: the training grid is the
default one (each EP group = one DP pair), and the placement tp-cp-pp-dp puts the two stages of a
pipeline on one node, so each EP pair (ranks 0-1, 2-3) spans the two nodes and every dispatch
and combine all-to-all crosses the slow link; PP stays inside a node. A 4-layer MoE decoder
(4 experts, top-2, one shared expert), hidden 128, 16 micro-batches of one 256-token sequence
(with 8, a third of dualpipev's passes on pp2 are warm-up and cool-down, unbraided).
Each schedule trains the same model in turn, `--rounds` rounds in alternating order; printed per
schedule:

- the median step time (steps 1.., the first connects and warms up) and its ratio to
  dualpipev's, measured side by side in this run;
- the monitor's EP exposure: milliseconds per step the compute waited for EP all-to-alls (the
  `blocked_ms_total` of dim ep in OUT/monitor/rank*.jsonl, summed per step, mean over ranks,
  median over steps; the row-count exchanges, which block by design, included), beside their
  transfer time, and the share of 1F1B's exposed EP time that each schedule hides (goal for
  dualpipev: >= 50%).

- the simulator's prediction of the same (commpipe/sim/units.py, the EP stream), calibrated
  on 1F1B's measurement alone: each plain pass of 1F1B blocks on its all-to-alls, so the EP
  time of a pass is 1F1B's exposed EP per step over its 2m passes, and the compute of a
  forward f (backward 2f) is what makes the simulated 1F1B step equal the measured one; every
  other schedule is then simulated on that table.

Under dualpipev the stages run unit by unit (commpipe.runtime.units_moe): each braid keeps one
pass's dispatch or combine in flight while the other pass computes. 1F1B and ZB-V run stages
whole, every all-to-all exposed. Needs root and iproute2; otherwise it says why and exits 0. On a
shared 2-core machine the four ranks contend for the cores: quote ratios, not absolute times.
"""

from __future__ import annotations

import statistics
import sys

from _emulated import (
    add_out,
    emulated_runner,
    exposure_per_step,
    parser,
    runs_dir,
    step_times,
)

MODEL = ("arch=moe,layers=4,hidden=128,heads=4,kv_heads=2,vocab=1024,experts=4,top_k=2,"
         "expert_ffn=256,shared_experts=1,rope_theta=10000")
VPP = {"1f1b": 1, "zbv": 2, "dualpipev": 2, "stp": 2}


def parse_args(argv=None):
    p = parser(__doc__, mbit=200.0, steps=5, microbatches=16)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--model", default=MODEL, help=f"model (default {MODEL})")
    p.add_argument("--schedules", default="dualpipev,1f1b,zbv",
                   help="comma-separated, of dualpipev, 1f1b, zbv, stp")
    p.add_argument("--rounds", type=int, default=3,
                   help="run the schedules this many times, alternating their order (default 3)")
    p.add_argument("--emulate-device", type=float, default=1.0, metavar="FACTOR",
                   help="train with --emulate-device FACTOR: compute takes FACTOR x its host "
                        "time with the host idle for the extra, as on a GPU (default 1: off)")
    add_out(p)
    return p.parse_args(argv)


def predicted(step_ms: float, exposed_ms: float, m: int, schedules: list[str]) -> dict:
    """Per schedule, (step ms, exposed EP ms per rank) the simulator predicts on the cost table
    calibrated from 1F1B's measured step and exposed EP time (pp 2, m micro-batches)."""
    from commpipe.schedules import generate
    from commpipe.sim import CostTable, simulate

    ep = exposed_ms / (2 * m)

    def run(name: str, f: float):
        prog = generate(name, 2, m, VPP[name])
        return simulate(prog, CostTable.for_program(prog, f=f, b=2 * f, ep_comm=ep), record=False)

    lo, hi = 0.0, step_ms
    for _ in range(60):                          # the makespan grows with f
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run("1f1b", mid).makespan < step_ms else (lo, mid)
    out = {}
    for name in schedules:
        res = run(name, lo)
        out[name] = (res.makespan, sum(res.ep_exposed) / len(res.ep_exposed))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = runs_dir("moe_ep_emulated", args.out)
    if out is None:
        return 0
    from commpipe.layout import Layout

    schedules = args.schedules.split(",")
    flags = {"steps": args.steps, "microbatches": args.microbatches, "model": args.model,
             "seq_len": args.seq_len, "micro_batch_size": 1, "ep": 2, "comm_monitor": "all",
             "device": "cpu", "emulate_device": args.emulate_device if args.emulate_device > 1 else None}
    steps, ep = {}, {}
    # rounds run the schedules in turn, each round in the reverse order of the one before, so
    # drifting load hits all alike; a schedule's step time is the median over all its steps
    order = [s for k in range(args.rounds) for s in (schedules if k % 2 == 0 else schedules[::-1])]
    with emulated_runner(args.mbit, 2, prefix="cpmoe") as train:
        for k, name in enumerate(order):
            run = name if k < len(schedules) else f"{name}-{k // len(schedules)}"
            layout = Layout(pp=2, dp=2, ep=2, schedule=name, vpp=VPP[name], name=run,
                            placement="tp-cp-pp-dp")
            if not train(layout, flags, out / run):
                return 1
            these = step_times(out / run)
            steps.setdefault(name, []).extend(these)
            got = exposure_per_step(out / run, "ep")
            ep.setdefault(name, []).append(got)
            print(f"{run}: median step {statistics.median(these):.3f} s; EP per step: exposed "
                  f"{got['exposed_ms']:.0f} ms, in transfer {got['transfer_ms']:.0f} ms", flush=True)
    times = {name: statistics.median(v) for name, v in steps.items()}
    ep = {name: {k: statistics.median(r[k] for r in v) for k in v[0]} for name, v in ep.items()}
    print(f"\nemulated cluster: 2 nodes x 2 ranks, {args.mbit:g} Mbit/s between nodes; PP2 inside "
          f"a node, DP2 = EP2 across nodes; {args.model}, seq {args.seq_len}, "
          f"{args.microbatches} micro-batches, {args.steps} steps x {args.rounds} round(s) "
          "(median of steps 1.. of every round)"
          + (f"; compute emulated as device time x{args.emulate_device:g} (--emulate-device)"
             if args.emulate_device > 1 else ""))
    print("schedule    | step s | ratio to dualpipev | EP exposed ms/step | EP transfer ms/step "
          "| hidden vs 1f1b")
    base, ref = times.get("dualpipev"), ep.get("1f1b", {}).get("exposed_ms")
    for s in schedules:
        r = f"{times[s] / base:.3f}" if base else "-"
        hidden = f"{1 - ep[s]['exposed_ms'] / ref:.0%}" if ref else "-"
        print(f"{s:<11} | {times[s]:6.3f} | {r:>18} | {ep[s]['exposed_ms']:18.0f} | "
              f"{ep[s]['transfer_ms']:19.0f} | {hidden:>14}")
    if "1f1b" in times:
        sim = predicted(times["1f1b"] * 1e3, ep["1f1b"]["exposed_ms"], args.microbatches, schedules)
        base_sim = sim.get("dualpipev", (None,))[0]
        print("simulated, calibrated on 1f1b's step and EP exposure (backward = 2 x forward):")
        print("schedule    | step s | ratio to dualpipev | EP exposed ms/step | hidden vs 1f1b")
        for s in schedules:
            step, exposed = sim[s]
            r = f"{step / base_sim:.3f}" if base_sim else "-"
            print(f"{s:<11} | {step / 1e3:6.3f} | {r:>18} | {exposed:18.0f} | "
                  f"{1 - exposed / sim['1f1b'][1]:>14.0%}")
    print(f"(runs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
