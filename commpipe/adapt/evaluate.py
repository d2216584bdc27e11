"""One evaluation of the controller, as a pure function of what the running plan measured.

    measured (calibrated costs, links, step time)  ->  CostModel  ->  candidates  ->  predicted
    step time and switch cost of each  ->  payback rule  ->  trials  ->  Decision

`Controller.decide` gathers the measurements on rank 0 and calls `evaluate`; tests call it on
synthetic measurements.
"""

from __future__ import annotations

import time
from dataclasses import replace

from commpipe.adapt.candidates import candidates
from commpipe.adapt.config import AdaptConfig
from commpipe.adapt.model import CostModel, Measured
from commpipe.adapt.plan import moved_s, payback
from commpipe.adapt.records import Decision
from commpipe.adapt.trial import overlaps_best, plan_trials
from commpipe.layout import Layout
from commpipe.models.family import layout_planned


def switch_cost(cur: Layout, plan: Layout, model: CostModel, spec, acfg: AdaptConfig,
                measured_cost: dict[str, float]) -> float:
    """Fixed (--adapt-switch-cost), else the last measured switch of this kind, else a
    rebuild allowance (AdaptConfig.base_switch_s: this run's own build time) plus the time the
    slowest rank takes to receive what it lacks (parameters and two AdamW moments, fp32; DP
    replicas and TP groups already hold full copies of their stages), each part over the link
    from its nearest holder as the model prices that link (commpipe.adapt.plan.moved_s, the
    sender the switch uses): a re-placement moves only the stages of the ranks whose role
    changes, inside a node where a node holds them, so a degraded link between nodes does not
    price it."""
    kind = cur.kind_of_switch(plan)
    if acfg.switch_cost_s is not None:
        return acfg.switch_cost_s
    if kind in measured_cost:
        return measured_cost[kind]
    rebuild = acfg.base_switch_s(kind, model.m.rebuild_s, model.m.groups_s)
    return rebuild + moved_s(cur, plan, spec, lambda a, b: model.link(a, b)[1], model.rpn)


def memory_need_gb(cfg, plan: Layout, on_cpu: bool, ranks_per_node: int) -> float:
    """GiB `plan` needs by the planner's memory model (commpipe.plan.fits): on CPU the sum over
    the ranks of one host, on a GPU the heaviest rank (stage memory at an even split)."""
    from commpipe.plan.fits import host_need_gb
    from commpipe.plan.layout import Job, runtime_job

    layout = replace(plan, recompute=cfg.recompute, zero=1 if cfg.optim.zero1 else 0)
    job = Job(cfg.global_batch, cfg.seq_len, precision=cfg.precision or "fp32",
              **runtime_job(cfg.features()))
    world = plan.world_size
    local = list(range(min(ranks_per_node, world))) if on_cpu else list(range(world))
    return host_need_gb(cfg.spec, layout, job, on_cpu, local)


def evaluate(cfg, acfg: AdaptConfig, measured: Measured, *, step: int, steps_left: int,
             world: int, ranks_per_node: int, detections: list[dict],
             signals: dict[str, float | None],
             measured_cost: dict[str, float] | None = None,
             free_gb: float | None = None, on_cpu: bool = True) -> Decision:
    """Stay or switch, and why. `cfg` is the running, resolved TrainConfig; `measured.plan` is
    its plan. With `free_gb` (memory free now: the host's on CPU, the device's on a GPU) a
    candidate is dropped when the planner's memory model says it needs more than that plus what
    the running plan needs (freed by the switch). Among the switches that pay back, the largest
    net saving wins; the fastest candidate is reported otherwise."""
    t0 = time.perf_counter()
    spec = cfg.spec
    cur = measured.plan
    model = CostModel(spec, cfg.seq_len, world, ranks_per_node, measured, acfg)
    current_ms = model.predict(cur)
    rows, over_memory = [], 0
    capacity = None
    if free_gb is not None and layout_planned(spec):
        capacity = free_gb + memory_need_gb(cfg, cur, on_cpu, ranks_per_node)
    for plan in candidates(cur, model, spec, cfg.seq_len, cfg.global_batch, world,
                           ranks_per_node, acfg):
        if capacity is not None and memory_need_gb(cfg, plan, on_cpu, ranks_per_node) > capacity:
            over_memory += 1
            continue
        try:
            ms = model.predict(plan)
        except ValueError:          # a schedule that does not take this micro-batch count
            continue
        rows.append({"plan": plan, "kind": cur.kind_of_switch(plan), "predicted_ms": ms,
                     "switch_cost_s": switch_cost(cur, plan, model, spec, acfg,
                                                  measured_cost or {})})
    for r in rows:
        r["verdict"] = payback(current_ms, r["predicted_ms"], r["switch_cost_s"], steps_left,
                               acfg.horizon, acfg.margin, acfg.min_gain)
    rows.sort(key=lambda r: r["predicted_ms"])
    admitted = [r for r in rows if r["verdict"].admit]
    d = Decision(
        step=step, action="stay", detections=detections, signals=signals,
        measured_step_ms=measured.step_ms, from_plan=cur.record(),
        predicted_current_ms=current_ms, model=model.describe(),
        candidates=[{"plan": r["plan"].title, "kind": r["kind"],
                     "predicted_ms": r["predicted_ms"], "switch_cost_s": r["switch_cost_s"]}
                    for r in rows[:acfg.logged_candidates]],
        candidates_considered=len(rows), to=None, predicted_saving_s=0.0, switch_cost_s=0.0,
        reason="no other plan fits", steps_left=steps_left,
        candidates_admitted=len(admitted), candidates_over_memory=over_memory,
        time=time.time())
    if not rows:
        d.planning_s = time.perf_counter() - t0
        return d
    from commpipe.plan.interval import trial_factors

    trials = acfg.trials > 0 and not acfg.relaunch
    interval = trial_factors(on_cpu) if trials else None
    if trials:
        # trials run only among candidates the model cannot tell from the best predicted: the
        # switch made first is one of them where one pays back (a cheap switch that keeps its
        # collectives on the slow link is predicted far slower, and is not worth a trial)
        close = [r for r in admitted
                 if overlaps_best(r["predicted_ms"], rows[0]["predicted_ms"], interval)]
        admitted = close or admitted
    best = max(admitted, key=lambda r: r["verdict"].saving_s - r["switch_cost_s"]) \
        if admitted else rows[0]
    verdict = best["verdict"]
    if verdict.admit and trials:
        # confirm by measurement: trial the candidates the model cannot tell from the best
        # (prediction intervals overlapping); their cost joins the payback
        picked, cost, verdict = plan_trials(rows, best, current_ms, steps_left, acfg, interval)
        if verdict.admit:
            d.trials = [{"plan": r["plan"].title, "predicted_ms": r["predicted_ms"],
                         "switch_cost_s": r["switch_cost_s"]} for r in picked]
            d.trial_plans = [r["plan"].record() for r in picked]
            d.trial_cost_s = cost
    d.action = "switch" if verdict.admit else "stay"
    d.to, d.kind = best["plan"].record(), best["kind"]
    d.predicted_best_ms = best["predicted_ms"]
    d.predicted_saving_s, d.horizon_steps = verdict.saving_s, verdict.horizon_steps
    d.switch_cost_s, d.reason = best["switch_cost_s"], verdict.reason
    d.planning_s = time.perf_counter() - t0
    return d
