"""The opening of an adaptive report (`commpipe train --adapt`, `commpipe demo --adaptive`): what
the controller saw, what it decided and where it settled, from the decision log (adapt.jsonl)
and the step times; against the oracle (oracle/candidates.json) and the static run when the
folder has them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from commpipe.report.adaptive import degrade_steps, plan_key, plan_label, settled_layout
from commpipe.report.tables import fmt, read_jsonl


def _median_ms(metrics: list[dict], lo: int, hi: int | None = None) -> float | None:
    vals = [m["step_time_s"] * 1e3 for m in metrics if m["step"] >= lo and (hi is None or m["step"] < hi)]
    return statistics.median(vals) if vals else None


def run_story(run: Path) -> list[str]:
    """Statements about one adaptive run folder."""
    decisions = read_jsonl(run / "adapt.jsonl")
    metrics = sorted(read_jsonl(run / "metrics.jsonl"), key=lambda m: m["step"])
    if not metrics:
        return []
    out = []
    marks = degrade_steps(run)
    if marks:
        out.append("Injected: " + ", ".join(f"{label} at step {step}" for step, label in sorted(marks)) + ".")
    evals = [d for d in decisions if d.get("action") in ("stay", "switch")]
    if not evals:
        out.append(f"{run.name}: the controller saw no change worth re-planning in {len(metrics)} steps.")
        return out
    first = evals[0]
    found = "; ".join(x.get("key", "?") for x in first.get("detections", [])) or "a change"
    out.append(f"{run.name}: first detection at step {first['step']} ({found}); "
               f"{len(evals)} evaluation{'s' if len(evals) > 1 else ''}, "
               f"{sum(d['action'] == 'switch' for d in evals)} leading to a switch.")
    switch = next((d for d in evals if d["action"] == "switch"), None)
    settled = settled_layout(decisions)
    if switch is None:
        out.append(f"It stayed on {plan_label(first['from'])}: {evals[-1].get('reason', 'no gain')}.")
        return out
    text = (f"At step {switch['step']} it switched from {plan_label(switch['from'])} "
            f"({fmt(switch.get('measured_step_ms'))} ms per step) to {plan_label(switch['to'])}, predicted "
            f"{fmt(switch.get('predicted_best_ms'))} ms")
    n_trials = len(switch.get("trial_plans") or [])
    if n_trials:
        text += f", as the first of {n_trials} layouts to try" if n_trials > 1 else ", to try it"
    out.append(text + ".")
    trials = [d for d in decisions if d.get("action") == "trial"]
    if trials:
        dropped = [name for d in trials for name in d.get("dropped") or ()]
        out.append("Trials (predicted → measured ms per step): " + "; ".join(
            f"{d['plan']} {fmt(d.get('predicted_ms'))} → {fmt(d.get('measured_ms'))}" for d in trials) + "." +
            (f" Dropped untried, as the measured trials ruled them out: {', '.join(dropped)}."
             if dropped else ""))
    settle = [d for d in decisions if d.get("action") == "settle"]
    at = settle[-1]["step"] if settle else switch["step"]
    if settled is not None:
        after = _median_ms(metrics, at + 2)
        before = _median_ms(metrics, 1, first["step"] - 1) if first["step"] > 2 else None
        out.append(f"Settled on {plan_label(settled)} at step {at}" +
                   (f" ({settle[-1].get('reason')})" if settle else "") +
                   (f": {fmt(after)} ms per step from step {at + 2} on" if after else "") +
                   (f", against {fmt(before)} ms before the first detection." if before else "."))
    else:
        out.append("A trial phase was still running when the run ended: the controller settled on nothing.")
    probed = [(d["step"], pair, v) for d in evals for pair, v in
              ((d.get("probed") or {}).get("links") or {}).items()]
    if probed:
        out.append("Measured before planning, as nothing the run sent had given their rate: " +
                   "; ".join(f"link {pair} at step {step}, {v['gbps']:.3g} GB/s"
                             for step, pair, v in probed) + ".")
    calls = [(d["step"], d["probed"]["call_ms"]) for d in evals
             if "call_ms" in (d.get("probed") or {})]
    if calls:
        step, ms = calls[0]
        out.append(f"A gloo collective call, timed after compute, cost {fmt(ms)} ms beyond its "
                   f"link (priced at step {step}); each TP and CP call of a candidate was priced "
                   "with it.")
    rechecks = [d for d in decisions if d.get("recheck")]
    if rechecks:
        out.append("Re-checked on its own baselines: " + "; ".join(
            f"{plan_label(d['from'])} at step {d['step']}, "
            + (f"switched to {plan_label(d['to'])}" if d["action"] == "switch" else "stayed")
            for d in rechecks) + ".")
    return out


def fault_start(marks: list[tuple[int, str]]) -> tuple[int, str] | None:
    """(step, label) where the lasting fault began: the last injected fault that is not a blip."""
    lasting = [m for m in marks if not m[1].startswith("blip")]
    return max(lasting) if lasting else None


def recovery_story(root: Path, rows: list[dict]) -> list[str]:
    """The headline of an adaptive report: over the steps from the lasting fault to the end, the
    adaptive run's mean step time against the static run's (the start layout kept through the
    fault) and the oracle's (the best static layout under the degraded network), and the share
    of the fault's cost the controller won back, (T_static - T_adaptive) / (T_static - T_oracle).
    Means, not medians: the time lost is the sum over steps, trials and slow steps included."""
    from commpipe.report.tables import run_path

    role = {r.get("role"): r for r in rows if r.get("role") and r["status"] == "ok"}
    if "adaptive" not in role or "static" not in role:
        return []
    adaptive = {m["step"]: m["step_time_s"] * 1e3 for m in read_jsonl(run_path(root, role["adaptive"])
                                                                        / "metrics.jsonl")}
    static = {m["step"]: m["step_time_s"] * 1e3 for m in read_jsonl(run_path(root, role["static"])
                                                                      / "metrics.jsonl")}
    fault = fault_start(degrade_steps(run_path(root, role["adaptive"])))
    if fault is None:
        return []
    steps = sorted(s for s in adaptive.keys() & static.keys() if s >= fault[0])
    if not steps:
        return []
    t_adaptive = statistics.mean(adaptive[s] for s in steps)
    t_static = statistics.mean(static[s] for s in steps)
    rec = read_json(root / "oracle" / "candidates.json")
    t_oracle = rec["best"]["median_ms"] if rec else (role.get("oracle") or {}).get("step_time_ms")
    span = f"Over steps {steps[0]}–{steps[-1]} ({fault[1]} to the end of the run, {len(steps)} steps)"
    text = (f"{span} the adaptive run took {fmt(t_adaptive)} ms per step on average, the static run "
            f"({role['static'].get('label')}) {fmt(t_static)} ms")
    if t_oracle is None:
        return [text + "; no oracle was measured, so the share of the loss recovered is unknown."]
    text += f" and the best static layout (oracle) {fmt(t_oracle)} ms"
    if t_static - t_oracle <= 0:
        return [text + ": the static run was no slower than the oracle, so there was nothing to recover."]
    share = (t_static - t_adaptive) / (t_static - t_oracle)
    return [text + f": the controller recovered {share:.0%} of the time the fault cost the static run "
            "((T_static − T_adaptive) / (T_static − T_oracle), step-time means)."]


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def oracle_story(out_dir: Path, static_told: bool = False) -> list[str]:
    """The settled layout against the oracle's every static layout and, unless the headline
    told it (static_told), the static run."""
    path = out_dir / "oracle" / "candidates.json"
    if not path.exists():
        return []
    rec = json.loads(path.read_text())
    best = rec["best"]
    settled = settled_layout(read_jsonl(out_dir / "adaptive" / "adapt.jsonl"))
    out = [f"The best static layout under the degraded network (the oracle, every layout measured from "
           f"step 0) is {plan_label(best)}: {fmt(best['median_ms'])} ms per step."]
    if settled is not None:
        mine = next((c for c in rec["candidates"] if plan_key(c) == plan_key(settled)), None)
        if mine is None:
            out.append(f"The controller's layout, {plan_label(settled)}, is not among the oracle's "
                       "candidates.")
        elif mine["name"] == best["name"]:
            out.append(f"The controller settled on that same layout, {plan_label(settled)}.")
        else:
            order = sorted(rec["candidates"], key=lambda c: c["median_ms"])
            rank = [c["name"] for c in order].index(mine["name"])
            gap = mine["median_ms"] / best["median_ms"] - 1
            out.append(f"The controller settled on {plan_label(settled)}, which measured "
                       f"{fmt(mine['median_ms'])} ms in the oracle sweep, {gap:+.0%} against the best "
                       f"(number {rank + 1} of {len(rec['candidates'])}).")
    static = read_jsonl(out_dir / "static" / "metrics.jsonl")
    marks = degrade_steps(out_dir / "static")
    if static and marks and not static_told:
        step = max(s for s, label in marks if not label.startswith("blip")) if any(
            not label.startswith("blip") for _, label in marks) else marks[0][0]
        ms = _median_ms(static, step + 1)
        if ms:
            out.append(f"Without the controller (static run) the degraded steps took {fmt(ms)} ms "
                       f"({ms / best['median_ms'] - 1:+.0%} against the oracle).")
    return out


def adaptive_findings(root, rows: list[dict]) -> list[str]:
    from commpipe.report.tables import run_path

    root = Path(root)
    headline = recovery_story(root, rows)
    out = list(headline)
    for r in rows:
        run = run_path(root, r)
        if (run / "adapt.jsonl").exists():
            out += run_story(run)
    return out + oracle_story(root, static_told=bool(headline))
