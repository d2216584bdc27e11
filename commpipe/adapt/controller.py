"""The adaptive controller: run after every training step by `commpipe train --adapt`.

    signals (every rank, every step)  ->  detection with hysteresis (same verdict on every rank)
      -> on a detection: recalibrate on the running timeline, predict candidates (rank 0)
      -> payback rule  ->  decision broadcast  ->  switch in memory (every rank)  ->  adapt.jsonl

Every rank gathers every rank's small per-step summary (one object all-gather through Comm, read
a step later: commpipe.adapt.exchange), so all ranks run the same deterministic detector on the
same numbers and agree on when to evaluate without another message; the evaluation itself runs
on rank 0 and its decision is broadcast. Controller traffic is kept out of the monitor's link records.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path

from commpipe.adapt import link_probe
from commpipe.adapt.calibration import measured, one_clock
from commpipe.adapt.describe import record_lines
from commpipe.adapt.detect import Watch, record_levels, where
from commpipe.adapt.evaluate import evaluate
from commpipe.adapt.exchange import Exchange
from commpipe.adapt.model import Measured
from commpipe.adapt.rates import KnownRates
from commpipe.adapt.records import Decision
from commpipe.adapt.signals import CollectiveTimer, step_calls, step_signals
from commpipe.adapt.trial import Trials, present_ms
from commpipe.layout import Layout
from commpipe.monitor import unmonitored
from commpipe.plan.interval import trial_factors


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
        self.watch = Watch(a)               # what to act on: detections that call for re-planning
        self.before_trials = None           # the running plan's detector, kept during trials
        self.window: deque = deque(maxlen=max(a.min_steps, a.baseline_steps))
        self.timelines: deque = deque(maxlen=a.min_steps)   # this rank's recent step timelines
        self.measured_cost: dict[str, float] = {}
        self.decisions: list[dict] = []
        self.log = None
        self.say = log                      # console lines of each record (logging rank only)
        self.is_logger = False
        self.timer = CollectiveTimer(a.collective_min_bytes)
        self.exchange = Exchange(self.rpn, self.timer)   # every rank's summary of every step
        self.trials: Trials | None = None   # the running trial phase, if any
        self.recheck = False                # evaluate once more when the new plan is armed
        self.rates = KnownRates()           # rates measured across plans (rank 0)
        # the model's interval of relative error: which candidates a trial phase can drop
        self.trial_interval = trial_factors(trainer.device.type != "cuda")
        self.switch_phases: dict | None = None   # parts of the last switch, until recorded
        # the running plan's healthy steps: (window entries, this rank's timelines) of the steps
        # its detector's baselines came from; the cost model's constants are calibrated on them
        self.reference: tuple | None = None
        self.reference_before_trials: tuple | None = None
        self.running = self.command_plan = Layout.of(trainer.cfg)
        self.plan_baselines: dict[str, dict] = {}   # plan name -> its healthy levels
        self.first_visit: str | None = None         # the plan on its first visit, if one is
        resumed = self.acfg.resume_state
        if resumed:   # a checkpoint of this run: re-arm against the levels it recorded
            self.command_plan = Layout.from_record(resumed["command_plan"])
            self.plan_baselines = dict(resumed.get("baselines") or {})
            self.watch.restore({"baselines": self.plan_baselines.get(self.running.title, {}),
                                "stragglers": resumed.get("stragglers", [])})
            self.reference = ()   # armed levels without their steps: no healthy reference
        if trainer.comm.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self.log = open(self.out / "adapt.jsonl", "a")
        with unmonitored(trainer):   # once, before the first step: what pricing needs of the host
            self.rates.host = trainer.comm.broadcast_object(link_probe.measure_host(trainer), 0)
        self.prepare(trainer)
        if self.rates.host is not None:
            self._write(self.rates.host)
        if resumed:
            self._write({"step": trainer.step - 1, "action": "resumed", "to": self.running.record(),
                         "baselines": len(self.plan_baselines.get(self.running.title, {})),
                         "reason": resumed.get("note") or "the checkpoint's plan"})
        req = self.acfg.resumed_from
        if req is not None:   # this start continues a switch by checkpoint and relaunch
            self._write({"step": trainer.step - 1, "action": "relaunched",
                         "from": req.get("from"), "to": req["to"],
                         "switch_time_s": time.time() - req["requested_at"],
                         "reason": f"resumed from {req['checkpoint']} under the new plan"})

    def prepare(self, trainer) -> None:
        self.is_logger = trainer.is_logger        # the rank that prints step lines, per plan
        self.running = Layout.of(trainer.cfg)
        trainer.adapt_state = self.checkpoint_state   # saved with every checkpoint
        trainer.runtime.events = []               # the step's timeline (cleared every step)
        if self.timer not in trainer.comm.observers:
            trainer.comm.observers.append(self.timer)
        if trainer.monitor is not None:
            # the monitor's exchange rides in the controller's own gather after every step:
            # records of step s are ready after step s, at no collective of their own
            trainer.monitor.exchange_by_caller = True

    def close(self, together: bool = True) -> None:
        """The run ends. `together`: every rank ends here alike (a collective is safe), so the
        summary in flight is read and its monitor records written."""
        if together:
            self._drain()
        else:
            self.exchange.abandon()
        if self.log is not None:
            self.log.close()

    # -- every step ----------------------------------------------------------------------------
    def after_step(self, trainer, rec: dict, metrics_file=None, stop: bool = False):
        """Observe a step; maybe switch. Returns (trainer, metrics_file), either of them new
        after a switch. Collective: every rank calls it after every step. `stop`: this rank was
        signalled; `stop_agreed` then says whether any rank was (the flags ride in the gather,
        so the loop needs no all-reduce of its own).

        While watching, the step's summary is gathered in the background and read after the
        next step (`AdaptConfig.lagged`): no rank waits for the slowest at the end of a step,
        and the detector sees every step one step later. The trial phase and the run's last
        step gather at once (a trial measures the step just run)."""
        lagged = self.acfg.lagged and self.trials is None and trainer.step < trainer.cfg.steps
        for taken in self.exchange.step(trainer, rec, stop, lagged):
            signals = self._keep(taken)
            trainer, metrics_file = self._turn(trainer, taken.step, rec["step"], signals,
                                               taken.summaries, metrics_file)
        if self.exchange.stop_agreed:    # the loop stops after this step: nothing in flight
            self._drain()
        return trainer, metrics_file

    @property
    def stop_agreed(self) -> bool:
        """Whether any rank asked to stop (after_step's `stop`), the same on every rank."""
        return self.exchange.stop_agreed

    def _keep(self, taken) -> dict:
        """A step's summaries into the window (and this rank's timeline); its signals."""
        if taken.timeline is not None:
            self.timelines.append(taken.timeline)
        signals = step_signals(taken.summaries)
        self.window.append((signals, taken.summaries))
        return signals

    def _drain(self) -> None:
        """Read the summary in flight (before a switch replaces the process groups it travels
        on, and when the run stops): its step joins the window and the monitor's records, not
        the detector (a switch starts it over)."""
        taken = self.exchange.drain()
        if taken is not None:
            self._keep(taken)

    def _turn(self, trainer, step: int, now: int, signals: dict, summaries: list, metrics_file):
        """The controller's turn on the signals of `step`, after step `now` ran (the next one
        when lagged): detection, and on a detection evaluation and maybe a switch, recorded
        at `now` (a detection's own `step` is the one its signals came from)."""
        if self.trials is not None:     # the slowest rank's step time: the same on every rank
            return self._trial_step(trainer, step, signals[("step", "step")], metrics_file)
        found = self.watch.observe(step, signals, step_calls(summaries))
        armed = False
        if self.reference is None and self.watch.detector.baseline("step", "step") is not None:
            n = self.acfg.baseline_steps
            self.reference = (list(self.window)[-n:], list(self.timelines)[-n:])
            armed = True
        if self.running.title not in self.plan_baselines:
            self.first_visit = self.running.title
        record_levels(self.plan_baselines, self.running.title, self.watch.detector,
                      self.first_visit == self.running.title)
        recheck = armed and self.recheck and not found
        if armed:
            self.recheck = False
        if not (found or recheck) or trainer.step >= trainer.cfg.steps:
            return trainer, metrics_file
        decision = self._evaluate(trainer, now, found, signals)
        decision.recheck = recheck or None
        if not recheck:
            # a plan reached on a detection is evaluated once more when its own baselines are
            # armed: a fault that began while the controller switched (or trialled) is part
            # of those baselines and no later detection would see it, but the calibration on
            # the new plan's steps does (a straggler's slowdown factor is relative to its peers)
            self.recheck = decision.action == "switch"
        if decision.action != "switch":
            self._write(decision)
            return trainer, metrics_file
        self._drain()
        if decision.trial_plans:
            # the running plan's baselines, kept in case the trials settle back on it, and its
            # step time now, measured as the candidates will be
            self.before_trials = copy.deepcopy(self.watch.detector)
            self.reference_before_trials = self.reference
            before_ms = present_ms([x for _, x in self.window], self.acfg.trial_steps)
        target = Layout.from_record(decision.to)
        if self.acfg.relaunch:
            from commpipe.adapt.relaunch import request

            try:
                request(trainer, target, decision)   # raises: the job stops
            finally:
                self._write(decision)
        trainer, metrics_file, took = self._switch(trainer, target, metrics_file)
        decision.switch_time_s = self.measured_cost[decision.kind] = took
        self._write(decision)
        if decision.trial_plans:
            a = self.acfg
            self.trials = Trials([(Layout.from_record(d), r["predicted_ms"])
                                  for d, r in zip(decision.trial_plans, decision.trials)],
                                 (Layout.from_record(decision.from_plan), before_ms),
                                 steps=a.trial_steps, warmup=a.trial_warmup_steps)
            self.trials.switch_s.append(took)
        return trainer, metrics_file

    def checkpoint_state(self) -> dict:
        """What a resumed run needs to keep the adaptation (commpipe.adapt.resume)."""
        plan = self.trials.current[0] if self.trials is not None else self.running
        return {"plan": plan.record(), "command_plan": self.command_plan.record(),
                "baselines": self.plan_baselines, "stragglers": sorted(self.watch.stragglers)}

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
        record = {"step": step, "action": "trial", "plan": running.title,
                  "predicted_ms": r["predicted_ms"], "measured_ms": r["measured_ms"],
                  "steps_ms": r["steps_ms"], "warmup_ms": r["warmup_ms"]}
        dropped = t.prune(self.trial_interval, trainer.cfg.steps - trainer.step)
        if dropped:
            record["dropped"] = [p.title for p in dropped]
        if not t.done and trainer.step < trainer.cfg.steps:
            nxt = t.plan
            record |= {"to": nxt.record(), "kind": running.kind_of_switch(nxt)}
            trainer, metrics_file, took = self._switch(trainer, nxt, metrics_file)
            record["switch_time_s"] = self.measured_cost[record["kind"]] = took
            self._write(record)
            t.switch_s.append(took)
            return trainer, metrics_file
        self._write(record)
        best, best_ms = t.settle()
        self.trials = None
        settle = {"step": step, "action": "settle", "to": best.record(), "measured_ms": best_ms,
                  "measured": [{"plan": t.current[0].title, "measured_ms": t.current[1],
                                "before_trials": True}]
                  + [{"plan": p.title, "measured_ms": m, "steps_ms": k} for p, m, k in t.results],
                  "trial_cost_s": t.cost_s(best_ms),
                  "reason": "fastest measured" + (" (the plan before the trials)"
                                                  if best == t.current[0] else "")}
        back = best == t.current[0]
        if best != running and trainer.step < trainer.cfg.steps:
            settle["kind"] = running.kind_of_switch(best)
            trainer, metrics_file, took = self._switch(trainer, best, metrics_file)
            settle["switch_time_s"] = self.measured_cost[settle["kind"]] = took
            settle["trial_cost_s"] += took
        else:
            settle["kind"] = None
            self.watch.new_plan()       # a new baseline under the settled plan
            self.window.clear()
            self.timelines.clear()
            self.reference = None
        self._write(settle)
        if back:
            # Back on the plan the trials left: its levels from before them are still its
            # reference. New baselines taken now would absorb any change that began during
            # the trials (a link that degraded meanwhile would read as normal).
            self.watch.detector = self.before_trials
            self.reference = self.reference_before_trials
        self.before_trials = self.reference_before_trials = None
        return trainer, metrics_file

    # -- evaluation (collective; planning on rank 0) -----------------------------------------------
    def _evaluate(self, trainer, step, found, signals) -> Decision:
        comm = trainer.comm
        c = comm.coords
        mine = ref = None
        if c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0:
            mine = one_clock(self.timelines)
            ref = one_clock(self.reference[1]) if self.reference else None
        with unmonitored(trainer):
            probed = self.rates.measure_unrated(comm, [x for _, x in self.window],
                                                self.acfg.collective_min_bytes, self.world,
                                                self.rpn)
            timelines = comm.gather_objects((c["pp"], mine, ref), "world")
            decision = None
            if comm.rank == 0:
                refs = {pp: evs for pp, _, evs in timelines if evs}
                decision = self.decide(trainer, step, found, signals,
                                       {pp: evs for pp, evs, _ in timelines if evs is not None},
                                       refs if self.reference else None)
                decision.probed = probed
            decision = comm.broadcast_object(decision, 0)
        return decision

    def decide(self, trainer, step, found, signals, timelines: dict,
               reference: dict | None = None) -> Decision:
        """Rank 0: calibrate on the gathered timelines and the window's summaries (and on the
        healthy steps' when `reference` holds their timelines), then `evaluate`
        (commpipe.adapt.evaluate)."""
        cfg = trainer.cfg
        measured = self._measured(trainer, timelines, list(self.window)[-self.acfg.min_steps:])
        self.rates.recall(measured, learn=True)
        if reference is not None and len(reference) == cfg.dims.pp:
            try:
                measured.reference = self._measured(trainer, reference, self.reference[0])
                self.rates.recall(measured.reference, learn=False)
            except (ValueError, KeyError, statistics.StatisticsError):
                measured.reference = None   # healthy steps without a full timeline: uncalibrated
        from commpipe.plan.fits import available_gb

        on_cpu = trainer.device.type != "cuda"
        return evaluate(cfg, self.acfg, measured, step=step, steps_left=cfg.steps - trainer.step,
                        world=self.world, ranks_per_node=self.rpn,
                        free_gb=available_gb(on_cpu, trainer.device.index or 0), on_cpu=on_cpu,
                        detections=[d.to_dict() | where(d, self.rpn) for d in found],
                        signals={f"{k} {n}": v for (k, n), v in sorted(signals.items())},
                        measured_cost=self.measured_cost)

    def _measured(self, trainer, timelines: dict, entries: list) -> Measured:
        return measured(trainer, timelines, entries, self.rpn, self.acfg.collective_min_bytes)

    # -- switching (collective) -------------------------------------------------------------------
    def _switch(self, trainer, plan: Layout, metrics_file):
        """Every rank to `plan`, in memory. Returns (trainer, metrics file, seconds the
        slowest rank took); the detector starts over under the new plan."""
        from commpipe.adapt.switch import switch
        from commpipe.train.run_files import open_metrics

        self._drain()      # the summary in flight travels on the process groups it replaces
        if metrics_file is not None:
            metrics_file.close()
            metrics_file = None
        self.first_visit = None
        phases: dict[str, float] = {}
        new, seconds = switch(trainer, plan, phases, self.rpn)
        gathered = new.comm.gather_objects((seconds, phases), "world")
        took = max(s for s, _ in gathered)
        # the slowest rank's time of each part, for the record that reports this switch
        self.switch_phases = {k: max(p[k] for _, p in gathered) for k in phases}
        if new.is_logger and new.cfg.out:
            metrics_file = open_metrics(Path(new.cfg.out) / "metrics.jsonl", new.step)
        self.watch.new_plan()
        self.window.clear()
        self.timelines.clear()
        self.reference = None
        self.prepare(new)
        return new, metrics_file, took

    def _write(self, record: Decision | dict) -> None:
        decision = record.to_dict() if isinstance(record, Decision) else record
        if "switch_time_s" in decision and self.switch_phases is not None:
            decision["switch_phases"], self.switch_phases = self.switch_phases, None
        self.decisions.append(decision)
        if self.log is not None:
            self.log.write(json.dumps(decision, default=str) + "\n")
            self.log.flush()
        if self.say and self.is_logger:
            for line in record_lines(decision):
                self.say(line)

