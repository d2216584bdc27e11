"""The scores and the printed report of benchmarks/planner_rank.py, and the CPU interval it writes.

Not a benchmark itself: imported as a sibling module.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _log(msg: str) -> None:
    print(msg, flush=True)


def probe_spare(out: Path, name: str) -> str:
    """ ", which had S of N cores to spare" for set `name`'s probe, when it was metered."""
    path = out / f"probe-{name}-host.json"
    if not path.exists():
        return ""
    host = json.loads(path.read_text())
    return f", which had {host['spare_cores']:.2f} of {host['cores']} cores to spare"


def score(rows: list[dict]) -> dict:
    from scipy.stats import spearmanr

    meas = [r["measured_ms"] for r in rows]
    pred = [r["predicted_ms"] for r in rows]
    picked = min(rows, key=lambda r: r["predicted_ms"])
    return {"layouts": len(rows), "spearman": float(spearmanr(meas, pred)[0]),
            "predicted_best": picked["layout"],
            "measured_best": min(rows, key=lambda r: r["measured_ms"])["layout"],
            "best_gap": picked["measured_ms"] / min(meas) - 1,
            "median_abs_error": statistics.median(abs(r["error"]) for r in rows)}


def report(sets: dict, fitted: dict) -> None:
    how = ("calibrated on" if fitted.get("fitted", True) else "measured (ops x time per op), "
           "nothing fitted; MAPE on")
    print(f"\nwake-up wait {fitted['wake_s'] * 1e3:.2f} ms per busy rank ahead (the scheduler's "
          f"half slice); host terms {how} the {fitted['runs']} runs of 1 and 2 ranks (MAPE "
          f"{fitted['mape']:.0%}): "
          + ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in fitted["params"].items()))
    for name, rows in sets.items():
        print(f"\n{name}: host time per gloo call {rows[0]['call_ms']:.2f} ms "
              f"({rows[0]['call_from']}); passes at {rows[0]['pass_from']}")
        print(f"{'layout':<18}{'measured ms':>12}{'predicted ms':>14}{'error':>8}{'spare':>7}"
              f"{'kappa':>7}   largest predicted terms (ms)")
        for r in sorted(rows, key=lambda r: r["measured_ms"]):
            terms = sorted(r["breakdown_ms"].items(), key=lambda kv: -kv[1])[:3]
            print(f"{r['layout']:<18}{r['measured_ms']:>12.1f}{r['predicted_ms']:>14.1f}"
                  f"{r['error']:>+8.1%}{r['spare_cores']:>7.2f}{r['kappa']:>7.2f}   "
                  + ", ".join(f"{k} {v:.1f}" for k, v in terms))
    print(f"\n{'set':<16}{'layouts':>8}{'Spearman':>10}{'best gap':>10}{'median |err|':>14}   "
          "predicted best / measured best")
    for name, rows in sets.items():
        s = score(rows)
        print(f"{name:<16}{s['layouts']:>8}{s['spearman']:>+10.2f}{s['best_gap']:>+10.1%}"
              f"{s['median_abs_error']:>14.1%}   {s['predicted_best']} / {s['measured_best']}")
    print("goals: Spearman >= 0.90, best gap <= 5%, median |error| <= 15%")


def write_interval(sets: dict, pooled: list[Path] = ()) -> None:
    """The 10th, 50th and 90th percentile of measured / predicted step time over every layout of
    every set, and of the runs in `pooled` (other OUT folders' result.json: runs of other hours,
    whose host ran at another speed), into commpipe/plan/interval.py (the planner's CPU
    interval)."""
    import numpy as np
    from _interval_file import write_block

    ratios = [r["measured_ms"] / r["predicted_ms"] for rows in sets.values() for r in rows]
    for folder in pooled:
        other = json.loads((folder / "result.json").read_text())["sets"]
        ratios += [r["measured_ms"] / r["predicted_ms"] for s in other.values() for r in s["rows"]]
    q = {k: round(float(np.percentile(ratios, k)), 4) for k in (10, 50, 90)}
    path = write_block("planner_rank.py", f"CPU_STEP_QUANTILES = {q}\nCPU_LAYOUTS = {len(ratios)}")
    _log(f"wrote {path}: measured / predicted step time {q} over {len(ratios)} layouts")
