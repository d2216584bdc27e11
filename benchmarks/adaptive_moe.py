"""Does the adaptive controller price Mixture-of-Experts layouts as they measure?

    sudo python benchmarks/adaptive_moe.py                      # ~10 min on 2 vCPUs
    sudo python benchmarks/adaptive_moe.py --slow-mbit 100      # a milder degrade

The adaptive demo's story (commpipe.adapt.demo: an emulated 2-node x 2-rank cluster, a one-step
blip of node 1's link to ignore, then a lasting degrade) on a MoE model instead of the dense one:
a 4-layer decoder of 4 routed experts (top-2) and one shared expert, started at dp4 with ep2
(each EP pair inside a node; the experts' gradients summed across the nodes). Three runs, as the
demo's: with --adapt, static, and the oracle, which measures every static layout of the 4 ranks
at every expert-parallel size it admits (commpipe.adapt.oracle) under the degraded link.

Printed: the demo's account, then each oracle layout the controller logged a prediction for at
its reaction to the degrade (its first decision after it that priced candidates, a switch or a
stay; the same degrees, ep, split and micro-batching) with measured / predicted; the Spearman
rank correlation of the two (scipy.stats.spearmanr), their median |measured / predicted - 1|,
and whether each trial measured within 20% of its prediction (the goal the demo has). The
predictions are the controller's cost model (commpipe.adapt.model with its MoE terms,
commpipe.adapt.model_moe) calibrated on the run's own steps before the degrade; nothing here
is fitted to the oracle. Needs root and iproute2; otherwise it says why and exits 0. The four
ranks share the machine's cores: quote ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

WINDOW = 3     # steps after the degrade from which a decision has measured the degraded link
MODEL = ("arch=moe,layers=4,hidden=128,heads=4,kv_heads=2,vocab=256,experts=4,top_k=2,"
         "expert_ffn=256,shared_experts=1")


def reaction(out: Path, degrade_step: int) -> dict | None:
    """The controller's first decision on a change that began with the degrade (a step early at
    most, as the demo reads it) that priced candidates: a switch, or a re-plan that stayed, both
    log every candidate's prediction. Failing one, the first that priced candidates on steps all
    from WINDOW steps after the degrade."""
    path = out / "adaptive" / "adapt.jsonl"
    if not path.exists():
        return None
    decisions = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    priced = [d for d in decisions if d.get("candidates")]
    on_it = [d for d in priced if d["step"] >= degrade_step and any(
        x.get("onset_step", -1) >= degrade_step - 1 for x in d.get("detections", []))]
    later = [d for d in priced if d["step"] >= degrade_step + WINDOW]
    return (on_it or later or [None])[0]


def score(out: Path, summary: dict) -> dict:
    """The oracle's layouts beside what the controller's reaction to the degrade predicted for
    each (commpipe.adapt.demo_summary.predicted_for: the same degrees, ep, split and micro-batching):
    rank correlation, median error, and its trials' measured / predicted."""
    from scipy.stats import spearmanr

    from commpipe.adapt.demo_summary import predicted_for

    decision = reaction(out, summary["degrade_step"])
    oracle = json.loads((out / "oracle" / "candidates.json").read_text())["candidates"]
    rows = [(c["name"], c["median_ms"], predicted_for(decision, c)) for c in oracle]
    pairs = [(m, p) for _, m, p in rows if p]
    got = {"decision_step": decision["step"] if decision else None,
           "decision": decision["action"] if decision else None,
           "rows": rows, "layouts_predicted": len(pairs), "layouts_measured": len(rows),
           "trials": [t["measured_ms"] / t["predicted_ms"] for t in summary.get("trials", [])]}
    if len(pairs) >= 3:
        got["spearman"] = float(spearmanr([m for m, _ in pairs], [p for _, p in pairs])[0])
    if pairs:
        got["median_abs_error"] = statistics.median(abs(m / p - 1) for m, p in pairs)
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/adaptive_moe", help="runs go here")
    p.add_argument("--slow-mbit", type=float, default=20.0,
                   help="node 1's link during the blip and the degrade, Mbit/s (default 20)")
    p.add_argument("--model", default=MODEL, help=f"a MoE model (default {MODEL})")
    args = p.parse_args(argv)
    from commpipe.adapt.demo import Scenario, run_adaptive_demo
    from commpipe.adapt.demo_summary import format_summary
    from commpipe.cluster.netns import available

    ok, why = available()
    if not ok:
        print(f"adaptive_moe: skipped, the emulated cluster is not available: {why}")
        return 0
    sc = Scenario(slow_mbit=args.slow_mbit, start={"dp": 4, "ep": 2},
                  train={"model": args.model, "seq_len": 32, "global_batch": 8, "seed": 0,
                         "log_every": 10})
    summary = run_adaptive_demo(Path(args.out), sc)
    print(format_summary(summary))
    s = score(Path(args.out), summary)
    print(f"\nthe controller's predictions beside the oracle: {s['layouts_predicted']} of "
          f"{s['layouts_measured']} layouts predicted at its reaction to the degrade "
          f"({s['decision']} at step {s['decision_step']})")
    for name, measured, predicted in s["rows"]:
        if predicted:
            print(f"  {name:<26} measured {measured:7.0f} ms  predicted {predicted:7.0f} ms  "
                  f"measured/predicted {measured / predicted:.2f}")
    if "spearman" in s:
        print(f"Spearman {s['spearman']:+.2f}; median |measured/predicted - 1| "
              f"{s['median_abs_error']:.1%}")
    for t, r in zip(summary.get("trials", []), s["trials"]):
        print(f"trial {t['plan']}: predicted {t['predicted_ms']:.0f} ms, measured "
              f"{t['measured_ms']:.0f} ms ({r:.2f}; {'within' if abs(r - 1) <= 0.2 else 'outside'} 20%)")
    (Path(args.out) / "moe_score.json").write_text(json.dumps(s, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
