"""Link-aware re-placement in a real run: `train --adapt` on an emulated 2-node x 2-rank cluster
whose inter-node link degrades under a layout that runs data parallelism across it.

    python benchmarks/replace_emulated.py                  # needs root and iproute2
    python benchmarks/replace_emulated.py --slow-mbit 40 --steps 40

The run starts as pp2 x dp2 with `--rank-order tp-cp-pp-dp`: consecutive pipeline stages on the
two ranks of a node, the DP replicas across the nodes, so every step's gradient all-reduce
crosses the inter-node link. At --onset the link of node 1 drops from --fast-mbit to
--slow-mbit (`EmulatedCluster.set_rate`, at a step boundary). Three runs of the same training:

    adaptive   the scenario with --adapt
    static     the same scenario, controller off
    replaced   the same degrees in Megatron's order (tp-cp-dp-pp: DP inside a node, the
               pipeline's small messages across), under the same fault: what re-placing earns

Printed: median step time before the fault and over the faulty period's second half (after
the controller has settled) for each run, the recovered share
(T_static - T_adaptive) / (T_static - T_replaced), the largest loss difference between the
adaptive and static runs, and the controller's switches (kind, plan, predicted against the
steps measured after it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from commpipe.adapt.demo import MODEL, Scenario, run_scenario  # noqa: E402

START = {"pp": 2, "dp": 2, "schedule": "1f1b"}
TRAIN = {"model": MODEL, "seq_len": 32, "global_batch": 8, "seed": 0, "log_every": 10}


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def median_ms(rows: list[dict], lo: int, hi: int) -> float:
    return 1e3 * statistics.median(r["step_time_s"] for r in rows if lo <= r["step"] < hi)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/replace_emulated")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--onset", type=int, default=10, help="first step under the slow link")
    p.add_argument("--fast-mbit", type=float, default=1000.0)
    p.add_argument("--slow-mbit", type=float, default=20.0)
    args = p.parse_args(argv)
    from commpipe.cluster.netns import EmulatedCluster, available

    ok, why = available()
    if not ok:
        print(f"skipped: the emulated cluster is not available here ({why})")
        return 0
    out = Path(args.out)
    changes = [(args.onset, args.slow_mbit)]
    runs = {"adaptive": ("tp-cp-pp-dp", True), "static": ("tp-cp-pp-dp", False),
            "replaced": ("tp-cp-dp-pp", False)}
    with EmulatedCluster(nodes=2, ranks_per_node=2, inter_node_mbit=args.fast_mbit,
                         prefix="cprp") as cluster:
        for i, (name, (order, adapt)) in enumerate(runs.items()):
            cluster.set_rate(1, args.fast_mbit)
            print(f"{name}: pp2 x dp2 ranks {order}{' with --adapt' if adapt else ''}, node 1's "
                  f"link {args.fast_mbit:g} -> {args.slow_mbit:g} Mbit/s at step {args.onset}",
                  flush=True)
            sc = Scenario(steps=args.steps, node=1, train=dict(TRAIN, rank_order=order))
            run_scenario(cluster, sc, out / name, START, adapt, changes, 29631 + i)
    rows = {name: records(out / name) for name in runs}
    half = args.onset + (args.steps - args.onset) // 2
    print(f"\n{'run':<10} {'healthy ms':>11} {'faulty ms (steps ' + str(half) + '+)':>26}")
    faulty = {}
    for name, r in rows.items():
        faulty[name] = median_ms(r, half, args.steps)
        print(f"{name:<10} {median_ms(r, 2, args.onset):11.0f} {faulty[name]:26.0f}")
    gap = faulty["static"] - faulty["replaced"]
    share = (faulty["static"] - faulty["adaptive"]) / gap if gap > 0 else float("nan")
    print(f"recovered share (T_static - T_adaptive) / (T_static - T_replaced): {share:.2f}")
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows["adaptive"], rows["static"]))
    print(f"largest loss difference, adaptive vs static: {diff:.2e}")
    log = out / "adaptive" / "adapt.jsonl"
    for line in decision_lines([json.loads(x) for x in log.read_text().splitlines() if x.strip()],
                               rows["adaptive"]):
        print(line)
    return 0


def decision_lines(records: list[dict], rows: list[dict]) -> list[str]:
    """The controller's evaluations (its calibration: the healthy step it took the constant
    from, the constant, the factor on the links measured slow), its switches, and each trial's
    prediction next to its measured median, with their ratio."""
    out = []
    for d in records:
        if d.get("action") == "trial":
            ratio = d["measured_ms"] / d["predicted_ms"]
            out.append(f"  trial {d['plan']}: predicted {d['predicted_ms']:.0f} ms, measured "
                       f"{d['measured_ms']:.0f} ms (measured/predicted {ratio:.2f})")
        elif d.get("action") == "settle":
            out.append(f"  settled at step {d['step']} on {d['to']['name']} "
                       f"({d['measured_ms']:.0f} ms, {d['reason']})")
        elif "model" in d:
            m = d["model"]
            ref, parts = m.get("reference_step_ms"), m.get("reference_parts") or {}
            healthy = f" (healthy {ref:.0f} ms" if ref else ""
            if parts:
                rates = ", ".join(f"{k} {v:.3g} GB/s" for k, v in
                                  sorted((parts.get("collective_gbps") or {}).items()))
                healthy += (f" = compute {parts['compute_ms']:.0f} + communication "
                            f"{parts['comm_ms']:.0f} + other, collectives at {rates or '-'}")
            out.append(f"step {d['step']}: measured {d['measured_step_ms']:.0f} ms"
                       + (healthy + ")" if ref else "")
                       + f"; other_ms {m['other_ms']:.0f}, fault factor "
                       f"{m.get('fault_factor', 1.0):.2f} on {len(m.get('slow_links') or [])} "
                       f"slow links; {d['action']}"
                       + (f" ({d['kind']}) to {d['to']['name']}, predicted "
                          f"{d['predicted_best_ms']:.0f} ms, switch cost {d['switch_cost_s']:.2f}"
                          f" s" if d["action"] == "switch" else f": {d['reason']}"))
            for c in d.get("candidates", [])[:6]:
                out.append(f"    candidate {c['plan']} ({c['kind']}): {c['predicted_ms']:.0f} ms,"
                           f" switch {c['switch_cost_s']:.2f} s")
            if d["action"] == "switch" and not d.get("trials"):
                after = [r["step_time_s"] * 1e3 for r in rows if r["step"] > d["step"] + 2]
                measured = statistics.median(after[:10]) if after else float("nan")
                out.append(f"  measured {measured:.0f} ms over the next steps")
    return out


if __name__ == "__main__":
    sys.exit(main())
