"""The adaptive suite's metrics of one adaptive run against its static run and best static
layout, and its table (benchmarks/adaptive_suite.py runs the scenarios and says what each
metric means).

A run is a dict: rows (metrics.jsonl), wall ({step: monotonic seconds its record appeared}),
applied ([(first step, Mbit/s)] of the link changes), decisions (adapt.jsonl).
"""

from __future__ import annotations


# -- metrics ---------------------------------------------------------------------------------------
def wall_ms(run: dict, lo: int, hi: int) -> float | None:
    """Mean wall time per step over steps [lo, hi): from step lo-1's record to step hi-1's."""
    seen = run["wall"]
    if lo - 1 not in seen or hi - 1 not in seen or hi <= lo:
        return None
    return (seen[hi - 1] - seen[lo - 1]) * 1e3 / (hi - lo)


def wall_s(run: dict, a: int, b: int) -> float | None:
    seen = run["wall"]
    return seen[b] - seen[a] if a in seen and b in seen else None


def fault_window(case, run: dict) -> tuple[int, int] | None:
    """[onset, end) of the lasting fault as it happened (link changes land at step boundaries
    read from metrics.jsonl: the applied steps, not the planned ones)."""
    if case.lasting is None:
        return None
    applied = run["applied"]
    onset = applied[0][0] if case.link else case.lasting[0]
    if case.slow_rank and case.link:
        onset = min(onset, case.lasting[0])
    end = case.lasting[1]
    if end is not None and len(applied) > 1:
        end = applied[1][0]
    return onset, end if end is not None else case.steps


def measure(case, adaptive: dict, static: dict, best: dict | None) -> dict:
    """The suite's metrics of one adaptive run against its static run and best static layout."""
    decisions = adaptive["decisions"]
    window = fault_window(case, adaptive)
    switches = [d for d in decisions if d["action"] == "switch"]
    onset = window[0] if window else None
    m = {"scenario": case.name, "what": case.what,
         "false_switches": sum(onset is None or d["step"] < onset for d in switches),
         "switches": len(switches), "final_layout": adaptive["rows"][-1].get("layout")}
    loss = {r["step"]: r["loss"] for r in static["rows"]}
    m["max_loss_diff"] = max((abs(r["loss"] - loss[r["step"]]) for r in adaptive["rows"]
                              if r["step"] in loss), default=None)
    if window is None:
        m["overhead"] = _ratio(wall_ms(adaptive, 2, case.steps), wall_ms(static, 2, case.steps))
        return m
    onset, end = window
    m["fault_steps"] = [onset, end]
    healthy = wall_ms(static, 2, onset)
    t_static, t_adapt = wall_ms(static, onset, end), wall_ms(adaptive, onset, end)
    t_best = best["best"]["median_ms"] if best else None
    m |= {"severity": _ratio(t_static, healthy, 0.0), "t_static_ms": t_static,
          "t_adaptive_ms": t_adapt, "t_best_ms": t_best,
          "best_layout": best["best"]["name"] if best else None}
    m["recovered"] = ((t_static - t_adapt) / (t_static - t_best)
                      if None not in (t_static, t_adapt, t_best) and t_static - t_best > 1e-9
                      else None)
    if end < case.steps:   # after a recovery
        m["after_ms"] = {"static": wall_ms(static, end, case.steps),
                         "adaptive": wall_ms(adaptive, end, case.steps)}
    evals = [d for d in decisions if d["action"] in ("stay", "switch") and d["step"] >= onset]
    # the reaction to the fault: the first evaluation called by a change that began with it,
    # or the re-check of a plan reached meanwhile (on a change before the fault), whose
    # calibration on that plan's own steps sees the fault
    det = next((d for d in evals if d.get("recheck") or any(
        x.get("onset_step", -1) >= onset - 1 for x in d.get("detections", []))), None)
    det = det or (evals[0] if evals else None)
    if det is None:
        return m
    step = det["step"]
    m |= {"detect_steps": step - onset, "detect_s": wall_s(adaptive, onset - 1, step),
          "detected": [x["key"] for x in det.get("detections", [])], "reaction": det["action"],
          "planning_s": det.get("planning_s"), "switch_s": det.get("switch_time_s")}
    settled = det
    if det["action"] == "switch" and det.get("trials"):
        settled = next((d for d in decisions if d["action"] == "settle" and d["step"] > step),
                       det)
    phase = [d for d in decisions if step <= d["step"] <= settled["step"]
             and d["action"] in ("switch", "trial", "settle")]
    m |= {"settle_steps": settled["step"] - step, "settle_s": wall_s(adaptive, step,
                                                                     settled["step"]),
          "switches_in_phase_s": sum(d.get("switch_time_s") or 0.0 for d in phase)}
    # once settled: the steps of the faulty period after the reaction's last switch, against
    # the same static and best (what the reaction buys after its trials; the share above also
    # pays for the steps before detection and for the trials)
    after = settled["step"] + 1
    if det["action"] == "switch" and after < end:
        m["settled_ms"] = wall_ms(adaptive, after, end)
        m["recovered_settled"] = ((t_static - m["settled_ms"]) / (t_static - t_best)
                                  if None not in (t_static, m["settled_ms"], t_best)
                                  and t_static - t_best > 1e-9 else None)
    phases = [d.get("switch_phases") for d in phase if d.get("switch_phases")]
    if phases:
        m["switch_split_s"] = {k: sum(p.get(k, 0.0) for p in phases) for k in phases[0]}
    return m


def _ratio(a, b, minus: float = 1.0):
    return None if a is None or not b else a / b - minus


# -- output ----------------------------------------------------------------------------------------
COLUMNS = ("scenario", "sev", "detect", "false", "settle", "plan/state/rebuild s", "T static/adapt/best",
           "recovered (settled)", "ends on", "max dloss")


def row(m: dict) -> list[str]:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    det = (f"{m['detect_steps']} st {f(m.get('detect_s'), '.1f')} s" if "detect_steps" in m
           else ("-" if "fault_steps" not in m else "none"))
    settle = (f"{m['settle_steps']} st {f(m.get('settle_s'), '.1f')} s" if "settle_steps" in m
              else "-")
    split = m.get("switch_split_s") or {}
    sw = ("/".join(f(x, ".2f") for x in (m.get("planning_s"), split.get("state_s"),
                                          split.get("rebuild_s")))
          if "detect_steps" in m else "-")
    if "overhead" in m:
        times = f"overhead {f(m['overhead'], '+.1%')}"
    else:
        times = "/".join(f(m.get(k), ".0f") for k in ("t_static_ms", "t_adaptive_ms",
                                                      "t_best_ms")) + " ms"
    return [m["scenario"] + (f" #{m['repeat']}" if m.get("repeat") else ""),
            f(m.get("severity"), ".2f") + ("x" if m.get("severity") else ""), det,
            str(m["false_switches"]), settle, sw, times,
            f(m.get("recovered"), ".2f") + (f" ({f(m['recovered_settled'], '.2f')})"
                                            if "recovered_settled" in m else ""),
            _short(m.get("final_layout")), f(m.get("max_loss_diff"), ".1e")]


def _short(layout: str | None) -> str:
    return "-" if not layout else layout.replace("tp1-cp1-", "").replace(" 1f1b", "")


def table(results: list[dict]) -> str:
    rows = [list(COLUMNS)] + [row(m) for m in results if "skipped" not in m]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for m in results:
        if "skipped" in m:
            lines.append(f"{m['scenario']}: not run: {m['skipped']}")
    return "\n".join(lines)
