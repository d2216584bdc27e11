"""What the running plan measured, as the adaptive cost model reads it (rank 0, at an
evaluation): the pipeline ranks' step timelines calibrated as `simulate --compare` does, the
window's per-rank summaries (busy time, link and collective rates) and the run's own costs of
rebuilding (commpipe.adapt.model.Measured)."""

from __future__ import annotations

import statistics

from commpipe.adapt.model import Measured
from commpipe.adapt.signals import collective_rates, link_rates
from commpipe.layout import Layout


def measured(trainer, timelines: dict, entries: list, ranks_per_node: int,
             min_bytes: int) -> Measured:
    """What the running plan measured over `entries` (the controller window's (signals,
    summaries)), calibrated on the pipeline ranks' `timelines` ({pp rank: event dicts})."""
    from commpipe.sim.compare import calibrate
    from commpipe.timeline import events_from_dicts

    cfg = trainer.cfg
    per_rank = {pp: events_from_dicts(evs) for pp, evs in timelines.items()}
    element_bytes = 2 if cfg.precision == "bf16" else 4   # stage boundaries' dtype
    act_bytes = element_bytes * cfg.micro_batch_size * (cfg.seq_len // cfg.dims.cp) \
        * cfg.spec.hidden
    costs = calibrate(cfg.program(), per_rank, act_bytes)
    busy: dict[int, list[float]] = {}
    for _, summaries in entries:
        for s in summaries:
            if s["busy_ms"]:
                busy.setdefault(s["rank"], []).append(s["busy_ms"])
    window = [x for _, x in entries]
    return Measured(
        Layout.of(cfg), costs, host_ms(costs, per_rank),
        statistics.median(s[("step", "step")] for s, _ in entries),
        links=link_rates(window, min_bytes),
        collective_gbps=collective_rates(window, ranks_per_node, min_bytes),
        rank_busy={r: statistics.median(v) for r, v in busy.items()},
        element_bytes=element_bytes,
        backend="nccl" if trainer.device.type == "cuda" else "gloo",
        rebuild_s=trainer.build_s, groups_s=getattr(trainer.comm, "groups_s", 0.0),
        op_work=op_work(trainer), dp_bucket_bytes=cfg.dp_bucket_mb * 1e6,
        sequence_parallel=cfg.sequence_parallel_capable())


def one_clock(timelines) -> list[dict]:
    """Steps' timelines one after another on one clock (each step's own starts at 0):
    calibration then takes medians over all of them."""
    out, offset = [], 0.0
    for events in timelines:
        out += [e | {"start_ms": e["start_ms"] + offset, "end_ms": e["end_ms"] + offset}
                for e in events]
        offset += max((e["end_ms"] for e in events), default=0.0) + 1e3
    return out


def host_ms(costs, per_rank) -> float:
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


def op_work(trainer) -> float:
    """On a CPU, the part of a pass fixed per micro-batch, as work per counted op, measured on a
    first stage of this run's model (commpipe.plan.pass_split, once per process, ~0.2-0.5 s);
    on a GPU the ops are issued while kernels run, and on a model too large to probe the
    FLOPs dominate: the model keeps to FLOPs (0)."""
    from commpipe.plan.pass_split import measure, worth_probing

    if trainer.device.type == "cuda" or not worth_probing(trainer.cfg.spec):
        return 0.0
    return measure(trainer.cfg.spec, trainer.cfg.seq_len).op_work
