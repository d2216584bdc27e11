"""The adaptive demo's account of its three runs: the numbers (`summarize`), its criteria, and
the words printed and put in the report (`format_summary`). The runs themselves:
commpipe.adapt.demo.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from commpipe.adapt.demo import Scenario


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _median_ms(rows: list[dict], lo: int, hi: int | None = None) -> float | None:
    vals = [r["step_time_s"] * 1e3 for r in rows if r["step"] >= lo and (hi is None or r["step"] < hi)]
    return statistics.median(vals) if vals else None


def _layout_key(plan: dict) -> tuple:
    return tuple(plan[k] for k in ("tp", "cp", "pp", "dp")) + (tuple(plan["stage_layers"]),
                                                              plan.get("ep", 1))


def summarize(out: Path, sc: Scenario, applied: list, oracle: dict) -> dict:
    """The demo's numbers; `oracle` is candidates.json (commpipe.adapt.oracle.run_oracle)."""
    adaptive, static = (_metrics(out / n) for n in ("adaptive", "static"))
    decisions = [json.loads(x) for x in (out / "adaptive" / "adapt.jsonl").read_text().splitlines()
                 if x.strip()] if (out / "adaptive" / "adapt.jsonl").exists() else []
    degrade = next((s for s, mbit in applied if mbit == sc.slow_mbit and s >= sc.blip[1]),
                   sc.degrade_step)
    switches = [d for d in decisions if d["action"] == "switch"]
    first = switches[0] if switches else None
    # the degrade's detection: the first evaluation confirming a change that began with it (a
    # step early at most: the rate may change while that step's last transfers run); the
    # reaction: the first switch on such a detection
    def on_degrade(d):
        return d["step"] >= degrade and any(x.get("onset_step", -1) >= degrade - 1
                                            for x in d.get("detections", []))

    detected = [d for d in decisions if on_degrade(d)]
    if not detected:
        # trials that settle back restore the detector of the plan from before them, with its
        # shifted runs: a change confirmed after the degrade may then date from before it
        detected = [d for d in decisions if d["step"] >= degrade and "detections" in d][:1]
    first_after = next((d for d in switches if on_degrade(d) or d in detected), None)
    # the layout that ran the degraded steps (the reaction's, else the one in use at the
    # degrade), and from when: two steps after its switch (the switch step and the next are
    # its warm-up), never before the degrade
    ran = first_after or next((d for d in reversed(switches) if d["step"] <= degrade), None)
    # with trials (--adapt-trials), the layout is the one the phase settled on, from its settle
    settled = next((d for d in decisions if d["action"] == "settle" and ran
                    and d["step"] > ran["step"]), None)
    trials, trials_from = [], ran["step"] if ran else None
    if settled is not None:
        trials = [{"plan": d["plan"], "predicted_ms": d["predicted_ms"],
                   "measured_ms": d["measured_ms"]} for d in decisions
                  if d["action"] == "trial" and ran["step"] < d["step"] <= settled["step"]]
        ran = settled
    after = max(degrade + 1, ran["step"] + 2) if ran else None
    same_steps = [a["step"] for a in adaptive] == [b["step"] for b in static] == list(range(sc.steps))
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(adaptive, static))
    best = oracle["best"]
    # the oracle's candidates trained from step 0 too: their losses are the static run's
    static_loss = {r["step"]: r["loss"] for r in static}
    oracle_loss_diff = max(abs(x - static_loss[i]) for c in oracle["candidates"]
                           for ls in (c["losses"], c.get("losses_pass2", []))
                           for i, x in enumerate(ls))
    chosen = None
    if ran:
        key = _layout_key(ran["to"])
        chosen = next((c for c in oracle["candidates"] if _layout_key(c) == key), None)
    s = {
        "degrade_step": degrade,
        "switches_before_degrade": sum(d["step"] < degrade for d in switches),
        "first_switch_before_degrade": first["step"] if first and first["step"] < degrade
        else None,
        "detection_delay_steps": detected[0]["step"] - degrade if detected else None,
        "detection": [f"{x['key']} (onset step {x.get('onset_step')})"
                      for x in detected[0]["detections"]] if detected else None,
        "first_switch_step": first_after["step"] if first_after else None,
        "switch_delay_steps": first_after["step"] - degrade if first_after else None,
        "switch_to": ran["to"]["name"] if ran else None,
        "trials": trials,
        "settle_step": settled["step"] if settled else None,
        "trials_from_step": trials_from,
        "switch_trigger": [f"{x['key']} (onset step {x.get('onset_step')})"
                           for x in first_after.get("detections", [])] if first_after else None,
        "switch_time_s": first_after.get("switch_time_s") if first_after else None,
        "step_ms_before": _median_ms(adaptive, 2, sc.blip[0]),
        "step_ms_degraded_static": _median_ms(static, degrade + 1),
        "step_ms_after_switch": _median_ms(adaptive, after) if after else None,
        "step_ms_oracle": best["median_ms"],
        "oracle_layout": best["name"],
        "oracle_candidates": [{k: c[k] for k in ("name", "stage_layers", "split", "median_ms",
                                                 "steps_measured", "stopped_early")}
                              | {"predicted_ms": predicted_for(first_after, c)}
                              for c in oracle["candidates"]],
        "oracle_sweep_s": oracle["sweep_s"],
        "emulate_device": sc.emulate_device,
        "controller_choice_is_best": (chosen is not None and chosen["name"] == best["name"])
        if ran else None,
        "controller_choice_ms": chosen["median_ms"] if chosen else None,
        # the oracle runs 1f1b at each layout's default micro-batching: did the controller's?
        "controller_batching_differs": ran is not None and (
            chosen is None or any(ran["to"].get(k) != chosen.get(k)
                                  for k in ("schedule", "microbatches", "micro_batch_size"))),
        "same_steps_adaptive_static": same_steps,
        "max_loss_diff_adaptive_vs_static": loss_diff,
        "max_loss_diff_oracle_candidates_vs_static": oracle_loss_diff,
    }
    s["why_not_best"] = None if s["controller_choice_is_best"] else \
        why_not_best(decisions, first_after, detected, ran, best, s["trials"])
    o = s["step_ms_oracle"]
    s["static_vs_oracle"] = s["step_ms_degraded_static"] / o - 1
    if s["step_ms_after_switch"]:
        s["after_switch_vs_oracle"] = s["step_ms_after_switch"] / o - 1
    return s


def _name_key(name: str) -> tuple | None:
    """The layout key of a plan name ("tp1-cp2-pp2-dp1 1f1b m8x1 layers 2,2", with an "ep2-"
    prefix under expert parallelism: Layout.title)."""
    import re

    dims = re.match(r"(?:ep(\d+)-)?tp(\d+)-cp(\d+)-pp(\d+)-dp(\d+)", name or "")
    layers = re.search(r"layers ([\d,]+)", name or "")
    if not dims or not layers:
        return None
    ep, *degrees = dims.groups()
    return tuple(int(x) for x in degrees) + (tuple(int(x) for x in layers[1].split(",")),
                                             int(ep or 1))


def predicted_for(decision: dict | None, c: dict) -> float | None:
    """What `decision` (the reaction to the degrade) predicted for oracle layout `c`: its logged
    candidate of the same title (degrees and expert parallelism, schedule, micro-batching,
    split; the default rank order, even micro-batches), if there is one."""
    if not decision or c.get("microbatches") is None:
        return None
    from commpipe.layout import Layout

    title = Layout(tp=c["tp"], cp=c["cp"], pp=c["pp"], dp=c["dp"], ep=c.get("ep", 1),
                   stage_layers=tuple(c["stage_layers"]), schedule=c["schedule"],
                   microbatches=c["microbatches"], micro_batch_size=c["micro_batch_size"]).title
    return next((x["predicted_ms"] for x in decision.get("candidates", []) if x["plan"] == title),
                None)


def why_not_best(decisions: list[dict], reacted: dict | None, detected: list[dict],
                 ran: dict | None, best: dict, trials: list[dict]) -> str:
    """Why the controller did not end on the best static layout, from its decision log."""
    if reacted is None:
        if not detected:
            return "nothing was detected after the degrade, so the controller never re-planned"
        stay = next((d for d in detected if d["action"] == "stay"), detected[0])
        return f"it re-planned at step {stay['step']} and stayed: {stay.get('reason')}"
    key = _layout_key(best)
    cands = reacted.get("candidates", [])
    names = [c["plan"] for c in cands]
    hit = next((i for i, c in enumerate(cands) if _name_key(c["plan"]) == key), None)
    if not cands:
        return f"the decision at step {reacted['step']} lists no candidates"
    if hit is None:
        n = reacted.get("candidates_considered", len(cands))
        where = (f"below the {len(cands)} fastest predictions of {n} plans" if n > len(cands)
                 else f"not among the {n} plans it considered")
        return f"the cost model had {best['name']} {where} at step {reacted['step']}"
    pred = cands[hit]["predicted_ms"]
    tried = [t for t in trials if _name_key(t["plan"]) == key]
    if tried:
        t, end = tried[0], ran["to"]["name"] if ran else names[0]
        mine = next((x for x in trials if x["plan"] == end), None)
        than = f" against {mine['measured_ms']:.0f} ms for {end}" if mine else ""
        return (f"its trial measured {t['measured_ms']:.0f} ms{than}, so the trials settled "
                f"elsewhere (the oracle measured it at {best['median_ms']:.0f} ms)")
    picked = reacted.get("trials") or [{"plan": reacted["to"]["name"],
                                        "predicted_ms": reacted.get("predicted_best_ms")}]
    chosen = ", ".join(f"{p['plan']} {p['predicted_ms']:.0f} ms" for p in picked)
    return (f"the cost model predicted {best['name']} at {pred:.0f} ms per step, number "
            f"{hit + 1} of {len(cands)} candidates, and chose{' to try' if len(picked) > 1 else ''} "
            f"{chosen}")


LIMIT_S = 8 * 60


def criteria(s: dict) -> list[tuple[str, bool, str]]:
    """The issue's demo criteria: (what, passed, measured)."""
    limit = LIMIT_S * max(s.get("emulate_device") or 1.0, 1.0)   # an emulated device's steps
    delay, after = s["switch_delay_steps"], s.get("after_switch_vs_oracle")
    return [
        ("no switch before the degrade", s["switches_before_degrade"] == 0,
         f"{s['switches_before_degrade']} switches"),
        ("first switch within 20 steps after the degrade", delay is not None and delay <= 20,
         "none" if delay is None else f"{delay} steps"),
        ("after the switch within 15% of the oracle", after is not None and abs(after) <= 0.15,
         "no switch" if after is None else f"{after:+.1%}"),
        ("static at least 25% slower than the oracle after the degrade",
         s["static_vs_oracle"] >= 0.25, f"{s['static_vs_oracle']:+.0%}"),
        ("adaptive losses = static losses within 1e-5 at every step",
         s["same_steps_adaptive_static"] and s["max_loss_diff_adaptive_vs_static"] <= 1e-5,
         f"max {s['max_loss_diff_adaptive_vs_static']:.1e}"),
        (f"whole demo under {limit / 60:g} minutes", s["elapsed_s"] < limit,
         f"{s['elapsed_s']:.0f} s"),
    ]


def format_summary(s: dict) -> str:
    """The demo's account: what happened, step times, and how far from the best static layout
    the controller ended (and why, when it missed it)."""
    def ms(x):
        return "-" if x is None else f"{x:.0f} ms"

    before = s["switches_before_degrade"]
    lines = [f"the link degraded at step {s['degrade_step']}; "
             + (f"{before} switch{'es' if before > 1 else ''} before that (the first at step "
                f"{s['first_switch_before_degrade']})" if before else "no switch before that")]
    if s["detection"] is None:
        lines.append("the controller did not detect the degrade")
    else:
        lines.append(f"detected {s['detection_delay_steps']} steps later: "
                     f"{'; '.join(s['detection'])}")
    if s["first_switch_step"] is None and s["detection"] is not None:
        lines.append("no switch on that detection")
    elif s["first_switch_step"] is not None:
        lines.append(f"switched at step {s['first_switch_step']} ({s['switch_delay_steps']} steps "
                     f"after the degrade, {s['switch_time_s'] or 0:.2f} s), on "
                     f"{'; '.join(s['switch_trigger'])}")
    if s.get("trials"):
        lines.append(f"trials (steps {s['trials_from_step']} to {s['settle_step']}, predicted -> "
                     "measured median): " + "; ".join(f"{t['plan']} {t['predicted_ms']:.0f} -> "
                                                      f"{t['measured_ms']:.0f} ms"
                                                      for t in s["trials"]))
    lines.append(f"layout during the degrade: {s['switch_to'] or 'the start layout'}")
    lines.append(f"step time (median): before the degrade {ms(s['step_ms_before'])}; after it "
                 f"without the controller {ms(s['step_ms_degraded_static'])}, with it "
                 f"{ms(s['step_ms_after_switch'])}; best static layout {ms(s['step_ms_oracle'])} "
                 f"({s['oracle_layout']})")
    lines.append(f"oracle sweep ({s['oracle_sweep_s']:.0f} s, every static layout of the 4 ranks "
                 "under the degraded link from step 0, median step time):")
    for c in s["oracle_candidates"]:
        note = f", {c['steps_measured']} steps, stopped early" if c["stopped_early"] else ""
        if c.get("predicted_ms"):
            note += (f"; the controller predicted {c['predicted_ms']:.0f} ms "
                     f"(measured/predicted {c['median_ms'] / c['predicted_ms']:.2f})")
        lines.append(f"  {c['name']:<26} layers {','.join(map(str, c['stage_layers'])):<8} "
                     f"{c['median_ms']:8.0f} ms{note}")
    lines += outcome(s)
    lines.append(f"largest loss difference adaptive vs static: "
                 f"{s['max_loss_diff_adaptive_vs_static']:.2e}; oracle candidates vs static: "
                 f"{s['max_loss_diff_oracle_candidates_vs_static']:.2e}; took {s['elapsed_s']:.0f} s")
    return "\n".join(lines)


def outcome(s: dict) -> list[str]:
    """How far from the best static layout the controller ended, in words."""
    after, static = s.get("after_switch_vs_oracle"), s["static_vs_oracle"]
    best = f"{s['oracle_layout']} ({s['step_ms_oracle']:.0f} ms)"
    ran = (f"after the switch its steps took {s['step_ms_after_switch']:.0f} ms ({after:+.0%}); "
           if after is not None else "")
    without = (f"without the controller {s['step_ms_degraded_static']:.0f} ms "
               f"({static:+.0%})")
    if s["controller_choice_is_best"]:
        if s.get("controller_batching_differs"):
            return [f"the controller reached the best static layout's degrees and split, {best}, "
                    f"running them as {s['switch_to']} (the oracle ran 1f1b at the default "
                    f"micro-batching); {ran}{without}"]
        return [f"the controller reached the best static layout, {best}; {ran}{without}"]
    if s["controller_choice_is_best"] is None:
        head = "the controller did not switch to another layout"
    else:
        measured = (f" ({s['controller_choice_ms']:.0f} ms in the oracle sweep)"
                    if s.get("controller_choice_ms") else "")
        head = (f"the controller did not reach the best static layout, {best}: it ended on "
                f"{s['switch_to']}{measured}")
        if after is not None and after < 0 and s.get("controller_batching_differs"):
            head += (", and with its schedule and micro-batching ran faster than every layout "
                     "the oracle measured (1f1b, default micro-batches)")
    return [f"{head}; {ran}{without}", f"why: {s['why_not_best']}"]
