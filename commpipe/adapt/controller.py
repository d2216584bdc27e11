"""The adaptive controller: run after every training step by `commpipe train --adapt`.

    signals (every rank, every step)  ->  detection with hysteresis (same verdict on every rank)
      -> on a detection: recalibrate on the running timeline, predict candidates (rank 0)
      -> payback rule  ->  decision broadcast  ->  switch in memory (every rank)  ->  adapt.jsonl

Every rank gathers every rank's small per-step summary (one object all-gather through Comm), so
all ranks run the same deterministic detector on the same numbers and agree on when to
evaluate without another message; the evaluation itself runs on rank 0 and its decision is
broadcast. Controller traffic is kept out of the monitor's link records.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from commpipe.adapt.candidates import candidates
from commpipe.adapt.describe import record_lines
from commpipe.adapt.detect import Detector
from commpipe.adapt.model import CostModel, Measured
from commpipe.adapt.plan import Plan, moved_bytes, payback
from commpipe.adapt.signals import (
    CollectiveTimer,
    collective_rates,
    link_rates,
    rank_summary,
    step_signals,
)
from commpipe.adapt.trial import Trials, plan_trials

# before the first switch of a kind is measured: seconds to rebuild stages (and, for a layout
# change, process groups) on top of moving the state; replaced by the measured time afterwards
BASE_SWITCH_S = {"rebatch": 0.1, "resplit": 0.3, "reshard": 1.0}
# link times come from a few sampled calls per step: median of the last 3 (large collectives
# are timed on every call, see signals.CollectiveTimer)
SMOOTH = {"link": 3}


@contextmanager
def unmonitored(trainer):
    mon = trainer.monitor
    if mon is None or mon not in trainer.comm.observers:
        yield
        return
    mon.detach()
    try:
        yield
    finally:
        mon.attach()


def worth_replanning(d, stragglers: set[str]) -> bool:
    """Whether a detection calls for re-planning. Links count both ways (a degrade, a repair).
    A rank whose compute got slower is a straggler. One that got faster only matters when it
    recovers from a slowdown detected before (the split made room for it); otherwise it is the
    host becoming less busy: the detector has already taken the new level as its baseline, and
    re-planning on it would reset the baselines the next real change is measured against."""
    if d.kind != "compute":
        return True
    if d.shift > 0:
        stragglers.add(d.key)
        return True
    if d.key in stragglers:
        stragglers.discard(d.key)
        return True
    return False


def ranks_per_node(world: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE (processes on this node); the whole world otherwise."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world


class Controller:
    def __init__(self, trainer, out, log=None):
        self.acfg = trainer.cfg.adapt.validate()
        self.out = Path(out)
        self.world = trainer.comm.dims.world_size
        self.rpn = ranks_per_node(self.world)
        a = self.acfg
        self.detector = Detector(a.min_steps, a.min_shift, a.baseline_steps)
        self.stragglers: set[str] = set()   # ranks whose slowdown was detected (see worth_replanning)
        self.before_trials: Detector | None = None
        self.window: deque = deque(maxlen=max(a.min_steps, a.baseline_steps))
        self.timelines: deque = deque(maxlen=a.min_steps)   # this rank's recent step timelines
        self.steps_in_plan = 0
        self.measured_cost: dict[str, float] = {}
        self.decisions: list[dict] = []
        self.log = None
        self.say = log                      # console lines of each record (logging rank only)
        self.is_logger = False
        self.timer = CollectiveTimer()
        self.trials: Trials | None = None   # the running trial phase, if any
        if trainer.comm.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.log = open(self.out / "adapt.jsonl", "a")
        self.prepare(trainer)
        req = self.acfg.resumed_from
        if req is not None:   # this start continues a switch by checkpoint and relaunch
            self._write({"step": trainer.step - 1, "action": "relaunched",
                         "from": req.get("from"), "to": req["to"],
                         "switch_time_s": time.time() - req["requested_at"],
                         "reason": f"resumed from {req['checkpoint']} under the new plan"})

    def prepare(self, trainer) -> None:
        self.is_logger = trainer.is_logger        # the rank that prints step lines, per plan
        trainer.runtime.events = []               # the step's timeline (cleared every step)
        if self.timer not in trainer.comm.observers:
            trainer.comm.observers.append(self.timer)
        if trainer.monitor is not None:
            trainer.monitor.exchange_every = 1    # records of step s are ready after step s

    def close(self) -> None:
        if self.log is not None:
            self.log.close()

    # -- every step ----------------------------------------------------------------------------
    def after_step(self, trainer, rec: dict, metrics_file=None):
        """Observe the step just done; maybe switch. Returns (trainer, metrics_file), either
        of them new after a switch. Collective: every rank calls it after every step."""
        step = rec["step"]
        summary = rank_summary(trainer, step, self.rpn, self.timer)
        summary["step_ms"] = rec["step_time_s"] * 1e3
        c = trainer.comm.coords
        if c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0:
            self.timelines.append([e.to_dict() for e in trainer.runtime.events or ()])
        with unmonitored(trainer):
            summaries = trainer.comm.gather_objects(summary, "world")
        signals = step_signals(summaries, rec["step_time_s"] * 1e3)
        self.window.append((signals, summaries))
        self.steps_in_plan += 1
        if self.trials is not None:     # the slowest rank's step time: the same on every rank
            return self._trial_step(trainer, step, max(s["step_ms"] for s in summaries),
                                    metrics_file)
        if self.steps_in_plan <= self.acfg.warmup_steps:
            return trainer, metrics_file
        found = [d for d in self.detector.observe_all(step, signals, SMOOTH)
                 if d.kind != "step" and worth_replanning(d, self.stragglers)]
        if not found or trainer.step >= trainer.cfg.steps:
            return trainer, metrics_file
        decision = self._evaluate(trainer, step, found, signals)
        if decision["action"] != "switch":
            self._write(decision)
            return trainer, metrics_file
        if decision.get("trial_plans"):
            # the running plan's baselines, kept in case the trials settle back on it
            self.before_trials = copy.deepcopy(self.detector)
        trainer, metrics_file = self._switch(trainer, decision, metrics_file)
        if decision.get("trial_plans"):
            self.trials = Trials([(_plan(d), r["predicted_ms"])
                                  for d, r in zip(decision["trial_plans"], decision["trials"])],
                                 (_plan(decision["from"]), decision["measured_step_ms"]),
                                 steps=self.acfg.trial_steps, warmup=1)
            self.trials.switch_s.append(decision["switch_time_s"])
        return trainer, metrics_file

    # -- the trial phase (collective) -----------------------------------------------------------
    def _trial_step(self, trainer, step: int, step_ms: float, metrics_file):
        """One step of the trial phase: when the plan on trial has its measured steps, log a
        `trial` record and switch to the next candidate, or after the last one log `settle` and
        switch to the fastest measured (none if it is the plan running)."""
        t = self.trials
        if not t.observe(step_ms) and trainer.step < trainer.cfg.steps:
            return trainer, metrics_file
        r = t.finish()
        running = r["plan"]
        record = {"step": step, "action": "trial", "plan": running.name,
                  "predicted_ms": r["predicted_ms"], "measured_ms": r["measured_ms"],
                  "steps_ms": r["steps_ms"], "warmup_ms": r["warmup_ms"]}
        if not t.done and trainer.step < trainer.cfg.steps:
            nxt = t.plan
            record |= {"to": nxt.to_dict(), "kind": running.kind_of_switch(nxt)}
            trainer, metrics_file = self._switch(trainer, record, metrics_file)
            t.switch_s.append(record["switch_time_s"])
            return trainer, metrics_file
        self._write(record)
        best, best_ms = t.settle()
        self.trials = None
        settle = {"step": step, "action": "settle", "to": best.to_dict(), "measured_ms": best_ms,
                  "measured": [{"plan": t.current[0].name, "measured_ms": t.current[1],
                                "before_trials": True}]
                  + [{"plan": p.name, "measured_ms": m, "steps_ms": k} for p, m, k in t.results],
                  "trial_cost_s": t.cost_s(best_ms),
                  "reason": "fastest measured" + (" (the plan before the trials)"
                                                  if best == t.current[0] else "")}
        back = best == t.current[0]
        if best != running and trainer.step < trainer.cfg.steps:
            settle["kind"] = running.kind_of_switch(best)
            trainer, metrics_file = self._switch(trainer, settle, metrics_file)
        else:
            settle["kind"] = None
            self._write(settle)
            self.detector.reset()       # a new baseline under the settled plan
            self.window.clear()
            self.timelines.clear()
            self.steps_in_plan = 0
        if back:
            # Back on the plan the trials left: its levels from before them are still its
            # reference. New baselines taken now would absorb any change that began during
            # the trials (a link that degraded meanwhile would read as normal).
            self.detector = self.before_trials
        self.before_trials = None
        return trainer, metrics_file

    # -- evaluation (collective; planning on rank 0) -----------------------------------------------
    def _evaluate(self, trainer, step, found, signals) -> dict:
        comm = trainer.comm
        c = comm.coords
        mine = None
        if c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0:
            # the window's steps one after another on one clock (each step's own starts at 0):
            # calibration then takes medians over all of them
            mine, offset = [], 0.0
            for events in self.timelines:
                mine += [e | {"start_ms": e["start_ms"] + offset, "end_ms": e["end_ms"] + offset}
                         for e in events]
                offset += max((e["end_ms"] for e in events), default=0.0) + 1e3
        with unmonitored(trainer):
            timelines = comm.gather_objects((c["pp"], mine), "world")
            decision = None
            if comm.rank == 0:
                decision = self.decide(trainer, step, found, signals,
                                       {pp: evs for pp, evs in timelines if evs is not None})
            decision = comm.broadcast_object(decision, 0)
        return decision

    def decide(self, trainer, step, found, signals, timelines: dict) -> dict:
        from commpipe.sim.compare import calibrate
        from commpipe.timeline import events_from_dicts

        cfg = trainer.cfg
        spec = cfg.spec
        cur = Plan.of(cfg)
        per_rank = {pp: events_from_dicts(evs) for pp, evs in timelines.items()}
        act_bytes = 4.0 * cfg.micro_batch_size * (cfg.seq_len // cfg.dims.cp) * spec.hidden
        costs = calibrate(cfg.program(), per_rank, act_bytes)
        host = _host_ms(costs, per_rank)
        recent = list(self.window)[-self.acfg.min_steps:]
        step_ms = statistics.median(s[("step", "step")] for s, _ in recent)
        busy: dict[int, list[float]] = {}
        for _, summaries in recent:
            for s in summaries:
                if s["busy_ms"]:
                    busy.setdefault(s["rank"], []).append(s["busy_ms"])
        measured = Measured(cur, costs, host, step_ms, links=link_rates([x for _, x in recent]),
                            collective_gbps=collective_rates([x for _, x in recent], self.rpn),
                            rank_busy={r: statistics.median(v) for r, v in busy.items()})
        model = CostModel(spec, cfg.seq_len, self.world, self.rpn, measured)
        current_ms = model.predict(cur)
        rows = []
        for plan in candidates(cur, model, spec, cfg.seq_len, cfg.global_batch, self.world,
                               self.rpn, with_layouts=self.acfg.layouts):
            try:
                ms = model.predict(plan)
            except ValueError:          # a schedule that does not take this micro-batch count
                continue
            kind = cur.kind_of_switch(plan)
            rows.append({"plan": plan, "kind": kind, "predicted_ms": ms,
                         "switch_cost_s": self.switch_cost(cur, plan, model, spec)})
        steps_left = cfg.steps - trainer.step
        a = self.acfg
        for r in rows:
            r["verdict"] = payback(current_ms, r["predicted_ms"], r["switch_cost_s"], steps_left,
                                   a.horizon, a.margin, a.min_gain)
        rows.sort(key=lambda r: r["predicted_ms"])
        record = {
            "step": step, "detections": [d.to_dict() | self._where(d) for d in found],
            "signals": {f"{k} {n}": v for (k, n), v in sorted(signals.items())},
            "measured_step_ms": step_ms, "from": cur.to_dict(),
            "predicted_current_ms": current_ms, "model": model.describe(),
            "candidates": [{"plan": r["plan"].name, "kind": r["kind"],
                            "predicted_ms": r["predicted_ms"], "switch_cost_s": r["switch_cost_s"]}
                           for r in rows[:20]],
            "candidates_considered": len(rows),
        }
        if not rows:
            return record | {"action": "stay", "to": None, "predicted_saving_s": 0.0,
                             "switch_cost_s": 0.0, "reason": "no other plan fits"}
        # among the switches that pay back, the largest net saving; else the fastest candidate
        admitted = [r for r in rows if r["verdict"].admit]
        best = max(admitted, key=lambda r: r["verdict"].saving_s - r["switch_cost_s"]) \
            if admitted else rows[0]
        verdict = best["verdict"]
        trials = {}
        if verdict.admit and a.trials > 0 and not a.relaunch:
            # confirm by measurement: trial the best predicted; their cost joins the payback
            picked, cost, verdict = plan_trials(rows, best, current_ms, steps_left, a)
            if verdict.admit:
                trials = {"trials": [{"plan": r["plan"].name, "predicted_ms": r["predicted_ms"],
                                      "switch_cost_s": r["switch_cost_s"]} for r in picked],
                          "trial_plans": [r["plan"].to_dict() for r in picked],
                          "trial_cost_s": cost}
        return record | trials | {
            "action": "switch" if verdict.admit else "stay",
            "to": best["plan"].to_dict(), "kind": best["kind"],
            "predicted_best_ms": best["predicted_ms"],
            "predicted_saving_s": verdict.saving_s, "horizon_steps": verdict.horizon_steps,
            "switch_cost_s": best["switch_cost_s"], "reason": verdict.reason,
        }

    def _where(self, d) -> dict:
        """The nodes and link class a link or collective detection spans."""
        import re

        if d.kind not in ("link", "collective"):
            return {}
        ranks = [int(x) for x in re.findall(r"\d+", d.key.split(" ", 1)[1].split("]")[0])]
        nodes = sorted({r // self.rpn for r in ranks})
        return {"nodes": nodes, "link_class": "intra_node" if len(nodes) == 1 else "inter_node"}

    def switch_cost(self, cur: Plan, plan: Plan, model: CostModel, spec) -> float:
        """Fixed (--adapt-switch-cost), else the last measured switch of this kind, else a
        rebuild allowance plus moving what the busiest rank lacks (parameters and two AdamW
        moments, fp32; DP replicas and TP groups already hold full copies of their stages).
        Bulk data moves at about the best rate a link showed (small activation messages
        measure latency more than bandwidth), so that rate is used."""
        kind = cur.kind_of_switch(plan)
        if self.acfg.switch_cost_s is not None:
            return self.acfg.switch_cost_s
        if kind in self.measured_cost:
            return self.measured_cost[kind]
        rates = [bw for _, bw in model.m.links.values() if bw]
        best = max(rates) if rates else min(model.class_gbps("intra_node"),
                                             model.class_gbps("inter_node"))
        return BASE_SWITCH_S[kind] + moved_bytes(cur, plan, spec) / (best * 1e9)

    # -- switching (collective) -------------------------------------------------------------------
    def _switch(self, trainer, decision: dict, metrics_file):
        from commpipe.adapt.switch import switch
        from commpipe.train.run_files import open_metrics

        plan = _plan(decision["to"])
        if self.acfg.relaunch:
            from commpipe.adapt.relaunch import request

            try:
                request(trainer, plan, decision)
            finally:
                self._write(decision)
        if metrics_file is not None:
            metrics_file.close()
            metrics_file = None
        new, seconds = switch(trainer, plan)
        times = new.comm.gather_objects(seconds, "world")
        decision["switch_time_s"] = max(times)
        self.measured_cost[decision["kind"]] = max(times)
        if decision["action"] == "settle":
            decision["trial_cost_s"] += max(times)
        if new.is_logger and new.cfg.out:
            metrics_file = open_metrics(Path(new.cfg.out) / "metrics.jsonl", new.step)
        self.detector.reset()
        self.window.clear()
        self.timelines.clear()
        self.steps_in_plan = 0
        self.prepare(new)
        self._write(decision)
        return new, metrics_file

    def _write(self, decision: dict) -> None:
        self.decisions.append(decision)
        if self.log is not None:
            self.log.write(json.dumps(decision, default=str) + "\n")
            self.log.flush()
        if self.say and self.is_logger:
            for line in record_lines(decision):
                self.say(line)


def _plan(d: dict) -> Plan:
    return Plan(**{k: v for k, v in d.items() if k != "name"} |
                {"stage_layers": tuple(d["stage_layers"])})


def _host_ms(costs, per_rank) -> float:
    """The host time calibrate charged to each action: its F cost minus the median F duration."""
    from commpipe.schedules import Action

    by_stage: dict[int, list[float]] = {}
    for events in per_rank.values():
        for e in events:
            if e.stream == "compute":
                a = Action.parse(e.name)
                if a.op == "F":
                    by_stage.setdefault(a.stage, []).append(e.dur_ms)
    diffs = [costs.f[s] - statistics.median(v) for s, v in by_stage.items()]
    return max(statistics.median(diffs), 0.0) if diffs else 0.0
