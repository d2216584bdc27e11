"""The controller's decision log (OUT/adapt.jsonl) in words: the console lines `train --adapt`
prints as it decides, and the plain account `demo --adaptive` gives of a whole run.

One record, one or more lines: each detection it acted on, each link it measured first, then
the decision. Records:
  stay / switch  an evaluation after a detection (`detections`, `candidates`, `reason`, ...),
                 or the re-check of the plan one led to (`recheck`, no detections)
  trial          a plan measured during the trial phase (`plan`, `predicted_ms`, `measured_ms`)
  settle         the end of a trial phase (`to`, `measured`, `reason`)
  relaunched     a switch finished by checkpoint and relaunch
  resumed        a --resume of an adaptive run: the plan it continues in (`to`) and why
  host           what the controller measured of the host before the first step (on a CPU
                 `op_work`; on gloo the `calls` timed after compute: commpipe.adapt.link_probe)
"""

from __future__ import annotations

PREFIX = "adapt:"


def _ms(x) -> str:
    return "?" if x is None else f"{x:.0f} ms" if abs(x) >= 10 else f"{x:.3g} ms"


def _plan(d) -> str:
    return d.get("name", "?") if isinstance(d, dict) else str(d)


def detection_line(step: int, d: dict) -> str:
    where = ""
    if d.get("link_class"):
        nodes = d.get("nodes") or []
        span = f"node {nodes[0]}" if len(nodes) == 1 else "nodes " + "-".join(map(str, nodes))
        where = f" ({d['link_class'].replace('_', '-')}, {span})"
    return (f"{PREFIX} step {step}: detected {d['kind']} {d['key']}{where}: "
            f"{_ms(d['baseline'])} -> {_ms(d['current'])} ({d['shift']:+.0%}) since step "
            f"{d['onset_step']}")


def gain(rec: dict) -> float | None:
    """Predicted relative gain of the evaluated best plan over the running one."""
    cur, best = rec.get("predicted_current_ms"), rec.get("predicted_best_ms")
    return (cur - best) / cur if cur and best is not None else None


def decision_line(rec: dict) -> str:
    step, action = rec["step"], rec["action"]
    if action in ("stay", "switch"):
        g = gain(rec)
        predicted = (f"predicted {_ms(rec.get('predicted_current_ms'))} -> "
                     f"{_ms(rec.get('predicted_best_ms'))} per step "
                     f"({abs(g):.0%} {'less' if g >= 0 else 'more'})"
                     if g is not None else "")
        if action == "stay":
            best = f"; best candidate {_plan(rec['to'])}, {predicted}" if rec.get("to") else ""
            return f"{PREFIX} step {step}: stay on {_plan(rec['from'])}: {rec['reason']}{best}"
        trials = rec.get("trials")
        what = (f"trial {len(trials)} plan{'s' if len(trials) > 1 else ''}, first "
                f"{_plan(rec['to'])}" if trials else f"switch to {_plan(rec['to'])}")
        took = f"; took {rec['switch_time_s']:.2f} s" if "switch_time_s" in rec else ""
        return (f"{PREFIX} step {step}: {what} ({rec.get('kind')}): {predicted}; "
                f"{rec['reason']}{took}")
    if action == "trial":
        nxt = f"; next {_plan(rec['to'])}" if rec.get("to") else ""
        dropped = rec.get("dropped") or []
        gone = (f"; dropped {len(dropped)} that cannot beat the fastest measured: "
                f"{', '.join(dropped)}") if dropped else ""
        return (f"{PREFIX} step {step}: trial of {rec['plan']}: predicted "
                f"{_ms(rec['predicted_ms'])}, measured {_ms(rec['measured_ms'])}{gone}{nxt}")
    if action == "settle":
        moved = f", switched ({rec['kind']})" if rec.get("kind") else ""
        cost = f"; the trials cost {rec['trial_cost_s']:.2f} s" if "trial_cost_s" in rec else ""
        return (f"{PREFIX} step {step}: settled on {_plan(rec['to'])} at "
                f"{_ms(rec['measured_ms'])}, {rec.get('reason', 'fastest measured')}{moved}{cost}")
    if action == "resumed":
        return f"{PREFIX} step {step}: resumed in {_plan(rec['to'])} ({rec.get('reason')})"
    if action == "host":
        return host_line(rec)
    if action == "relaunched":
        return (f"{PREFIX} step {step}: relaunched under {_plan(rec['to'])} "
                f"({rec['switch_time_s']:.1f} s after the request)")
    return f"{PREFIX} step {step}: {action}"


def host_line(rec: dict) -> str:
    """The `host` record: what pricing candidates needs of the host, measured at the start."""
    parts = []
    if rec.get("calls"):
        parts.append("a gloo collective call after compute (ranks 0-1) took " + ", ".join(
            f"{op.replace('_', '-')} {_ms(v['mean_ms'])}" for op, v in rec["calls"].items())
            + " (mean)")
        share = rec.get("sharing") or {}
        if share.get("factor", 1.0) > 1.0:
            parts.append(f"{share['ranks']} ranks share this machine's {share['cores']} cores: "
                         f"calls in training priced x{share['factor']:.2g}")
    if rec.get("op_work"):
        parts.append(f"issuing an eager op takes as long as {rec['op_work']:.3g} FLOPs of "
                     "compute")
    took = (rec.get("op_work_seconds") or 0.0) + (rec.get("calls_seconds") or 0.0)
    return (f"{PREFIX} before step {rec['step'] + 1}: measured this host for pricing "
            f"candidates: {'; '.join(parts) or 'nothing'}; in {took:.2f} s")


def probe_lines(rec: dict) -> list[str]:
    """The link classes an evaluation measured first (commpipe.adapt.link_probe)."""
    probed = rec.get("probed") or {}
    lines = [f"{PREFIX} step {rec['step']}: measured link {pair} (no rate from the run's own "
             f"transfers): {v['gbps']:.3g} GB/s, latency {_ms(v['latency_ms'])}, in "
             f"{probed['seconds']:.2f} s" for pair, v in (probed.get("links") or {}).items()]
    if "call_ms" in probed:
        took = (f", in {probed['calls_seconds']:.2f} s" if "calls_seconds" in probed
                else " (timed at the start)")
        shared = (f" ({_ms(probed['call_ms_alone'])} timed alone, x{probed['sharing_factor']:.2g}"
                  " for the ranks sharing this machine's cores)"
                  if probed.get("sharing_factor", 1.0) > 1.0 else "")
        lines.append(f"{PREFIX} step {rec['step']}: a gloo collective call after compute "
                     f"(ranks 0-1) costs {_ms(probed['call_ms'])} beyond its link{shared}, added "
                     f"to each TP and CP call a candidate makes{took}")
    return lines


def record_lines(rec: dict) -> list[str]:
    """The console lines of one decision-log record: its detections (or that it re-checks the
    plan a detection led to), the links it measured first, then the decision."""
    why = [f"{PREFIX} step {rec['step']}: re-check of {_plan(rec['from'])} on its own baselines"] \
        if rec.get("recheck") else []
    return why + [detection_line(rec["step"], d) for d in rec.get("detections", ())] + \
        probe_lines(rec) + [decision_line(rec)]
