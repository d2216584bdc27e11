"""The decision record: what one evaluation of the controller saw, predicted and decided.

One `Decision` per evaluation (after a detection, or the re-check of the plan one led to),
written to OUT/adapt.jsonl as one JSON object by `to_dict()`. Its keys are what
commpipe.report, commpipe.adapt.describe and the demo read:

  step, action ("stay" | "switch"), detections, signals, measured_step_ms, from,
  predicted_current_ms, model (the calibration), candidates (the best `logged_candidates`),
  candidates_considered, to, kind, predicted_best_ms, predicted_saving_s, horizon_steps,
  switch_cost_s, reason
  trials, trial_plans, trial_cost_s   when the switch is confirmed by trials
  switch_time_s                        once switched (measured, slowest rank)
  switch_phases                        with it, for an in-memory switch: {state_s, rebuild_s},
                                       the slowest rank's seconds of moving the state and of
                                       rebuilding groups and stages (commpipe.adapt.switch)
  switch_mode, checkpoint, save_time_s when switched by checkpoint and relaunch
  recheck                              true when no detection called the evaluation: the
                                       plan a detection led to, re-checked once its own
                                       baselines were armed (commpipe.adapt.controller)
  probed                               the link classes no transfer had given a rate for,
                                       measured before planning: {seconds, links: {"a->b":
                                       {latency_ms, gbps}}}, and once a run on gloo a
                                       collective call's time beyond its link, from the
                                       calls the `host` record timed at the start: {call_ms,
                                       call_ms_alone, sharing_factor}: as timed, and stretched
                                       by the ranks sharing the machine's cores in training
                                       (commpipe.adapt.link_probe.host_sharing)
  steps_left, candidates_admitted, candidates_over_memory, planning_s, time
                                       the steps the payback could count on, how many
                                       candidates paid back, how many the planner's memory
                                       model dropped, the seconds rank 0 spent planning, and
                                       the wall-clock time (Unix seconds) of the record

Keys of the optional groups are left out when they do not apply, as before. The phase records
that follow a switch (`trial`, `settle`, `relaunched`) and the `host` record written before
the first step are plain objects described in commpipe.adapt.describe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

OPTIONAL = ("kind", "predicted_best_ms", "horizon_steps", "trials", "trial_plans",
            "trial_cost_s", "switch_time_s", "switch_mode", "checkpoint", "save_time_s",
            "recheck", "probed")


@dataclass
class Decision:
    step: int
    action: str                          # "stay" | "switch"
    detections: list[dict]
    signals: dict[str, float | None]
    measured_step_ms: float
    from_plan: dict                      # written as "from"
    predicted_current_ms: float
    model: dict
    candidates: list[dict]
    candidates_considered: int
    to: dict | None
    predicted_saving_s: float
    switch_cost_s: float
    reason: str
    kind: str | None = None
    predicted_best_ms: float | None = None
    horizon_steps: int | None = None
    trials: list[dict] | None = None
    trial_plans: list[dict] | None = None
    trial_cost_s: float | None = None
    switch_time_s: float | None = None
    switch_mode: str | None = None
    checkpoint: str | None = None
    save_time_s: float | None = None
    recheck: bool | None = None          # True: the re-check of a plan reached on a detection
    probed: dict | None = None           # link classes measured first (adapt/link_probe.py)
    steps_left: int = 0
    candidates_admitted: int = 0
    candidates_over_memory: int = 0
    planning_s: float = 0.0
    time: float = field(default=0.0)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in OPTIONAL and value is None:
                continue
            out["from" if f.name == "from_plan" else f.name] = value
        return out
