"""Predict one layout: validity, memory per stage, step time from the simulator, throughput.

Step time = simulated pipeline makespan (per-stage F/B/I/W costs with exposed TP/CP
collectives, point-to-point transfers on their links, bubbles) + the DP gradient reduction
left exposed + the optimizer step + the step's scalar all-reduces (`Job.step_syncs`) (+ the
tied-embedding gradient sync of GPT shapes), taken on the pipeline rank where that tail is
longest. When more ranks than `cluster.host_cores` share one machine, the host contention
(`commpipe.plan.host`) is solved first.

    >>> from commpipe.models.spec import resolve_model
    >>> from commpipe.plan.cluster import default_cluster
    >>> from commpipe.plan.gpus import resolve_gpu
    >>> e = estimate(resolve_model("llama3-8b"), Layout(tp=8, micro_batch_size=1, dp=1),
    ...              Job(global_batch=8, seq_len=8192), default_cluster(resolve_gpu("h100"), 8, 8))
    >>> e.feasible
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from commpipe.models.family import family_of, layer_form
from commpipe.models.spec import ModelSpec, flops_per_token
from commpipe.plan import host
from commpipe.plan import moe as moe_plan
from commpipe.plan.cluster import Cluster
from commpipe.plan.efficiency import Efficiency, default_efficiency
from commpipe.plan.layout import Job, Layout, layout_problem
from commpipe.plan.memory import StageMemory, chunk_stages, gb_text, memory_problem, rank_chunks, stage_memory
from commpipe.plan.moe_costs import summary as moe_summary
from commpipe.plan.pass_split import with_measured_pass
from commpipe.plan.pipeline import action_counts, braid_span, busy_overlap, peak_inflight, simulate_step
from commpipe.plan.timing import StageCosts, stage_costs
from commpipe.schedules.registry import info


@dataclass
class Estimate:
    layout: Layout
    feasible: bool
    reason: str
    memory: list[StageMemory] = field(default_factory=list)
    step_time_s: float = float("nan")
    tflops_per_gpu: float = float("nan")
    hw_tflops_per_gpu: float = float("nan")
    mfu: float = float("nan")
    bubble_fraction: float = float("nan")
    breakdown: dict = field(default_factory=dict)     # seconds per step, on the bottleneck rank
    microbatches: int = 0
    lower_bound_s: float = float("nan")
    host_contention: float = 1.0     # busy ranks per host core (plan.host); 1: no contention
    cpu_s: list[float] = field(default_factory=list)    # per pipeline rank: host CPU time in
    optimizer_s: list[float] = field(default_factory=list)   # the pipeline; in the optimizer
    busy_overlap: float = 1.0        # pipeline ranks using the CPU at once, seen by one of them
    presence_overlap: float = 1.0    # pipeline ranks inside an action at once, seen by one of them
    busy_s: list[float] = field(default_factory=list)   # per pipeline rank: inside actions
    wake_contention: float = 1.0     # ranks in play per host core (plan.host)
    interval: dict | None = None     # TFLOP/s prediction interval (plan.interval), GPU clusters
    moe: dict | None = None          # MoE models: ep, edp, all-to-all bytes and time (moe_costs)

    @property
    def memory_gb_per_gpu(self) -> float:
        return max((s.total_gb for s in self.memory), default=float("nan"))

    @property
    def activation_gb_per_gpu(self) -> float:
        """Bytes held for backward on the rank holding the most (activations and softmax)."""
        return max((s.activations_gb + s.logits_gb for s in self.memory), default=float("nan"))

    @property
    def exposed_comm_fraction(self) -> float:
        b = self.breakdown
        if not b or not self.step_time_s == self.step_time_s:
            return float("nan")
        comm = sum(b.get(k, 0.0) for k in ("tp", "cp", "zero", "pp_p2p", "dp", "embedding_sync", "ep"))
        return comm / self.step_time_s

    def to_dict(self) -> dict:
        d = dict(self.layout.to_dict())
        d.update(step_time_s=_num(self.step_time_s), tflops_per_gpu=_num(self.tflops_per_gpu),
                 hw_tflops_per_gpu=_num(self.hw_tflops_per_gpu), mfu=_num(self.mfu),
                 memory_gb_per_gpu=_num(self.memory_gb_per_gpu),
                 activation_gb_per_gpu=_num(self.activation_gb_per_gpu), feasible=self.feasible,
                 reason=self.reason, microbatches=self.microbatches,
                 bubble_fraction=_num(self.bubble_fraction),
                 exposed_comm_fraction=_num(self.exposed_comm_fraction),
                 breakdown_s={k: _num(v) for k, v in self.breakdown.items()},
                 host_contention=self.host_contention,
                 memory_gb_per_stage=[round(s.total_gb, 3) for s in self.memory],
                 reserve_gb_per_gpu=_num(max(self.memory, key=lambda s: s.total_gb).reserve_gb
                                         if self.memory else float("nan")))
        if self.interval:
            d["interval"] = self.interval
        if self.moe is not None:
            d["ep"] = self.layout.ep
            d["moe"] = self.moe
        return d


def _num(x: float):
    return None if x != x else x      # NaN -> null in JSON


def hardware_flops_per_token(spec: ModelSpec, seq_len: int, recompute: str, flash: bool) -> float:
    """FLOPs the GPUs execute: with full recompute the layers' forward runs twice (Megatron-LM
    papers report this); selective recompute replays only the attention core (s x s products)
    when it is not fused into flash attention. A MoE decoder's: its family's count (plan.moe)."""
    moe = moe_plan.routed_spec(spec)
    if moe is not None:
        return moe_plan.hardware_flops_per_token(moe, seq_len, recompute)
    if recompute == "full":
        return flops_per_token(spec, seq_len, recompute=True)
    base = flops_per_token(spec, seq_len)
    if recompute == "selective" and not flash:
        base += spec.layers * 2 * 2 * seq_len * spec.hidden
    if recompute == "op":
        # torchtitan's per-op SAC replays every other matmul (kernels.py): Llama's wk, wo, w3,
        # GPT's attention projection and fc2
        h, kv, f = spec.hidden, spec.kv_dim, spec.ffn_hidden
        gated = layer_form(spec).gated_mlp
        base += spec.layers * 2 * (h * kv + h * h + h * f if gated else h * h + f * h)
    return base


def braided_tp(costs: StageCosts, layout: Layout) -> list[float]:
    """Per stage, the TP collective time of one pass (F, and B or I) that a braided schedule
    runs on the simulator's TP stream, where the other pass of a braid hides it: the smaller of
    the forward's and the backward's (the rest, e.g. a full recompute's replayed collectives,
    stays exposed in its pass). Empty for unbraided schedules."""
    if layout.tp == 1 or not info(layout.schedule).braided:
        return []
    return [min(a, b) for a, b in zip(costs.tp_f, costs.tp_b)]


def braided_ep(costs: StageCosts, layout: Layout) -> list[float]:
    """A braided schedule's expert-parallel all-to-alls per stage and pass, which the
    simulator runs on its EP stream beside the braid's other pass (commpipe/sim/units.py), as
    DualPipe overlaps them; [] for other schedules and dense models. The forward's: under full
    recompute the backward's replayed exchanges (ep_b - ep_f) stay exposed in it."""
    if not costs.ep_f or not any(costs.ep_f) or not info(layout.schedule).braided:
        return []
    return list(costs.ep_f)


def cost_table_args(costs: StageCosts, layout: Layout, cluster: Cluster) -> dict:
    """Per-stage costs in ms and the links between pipeline ranks for `simulate`. Braided
    schedules get their TP collectives as the simulator's `tp_comm` and a MoE model's
    all-to-alls as its `ep_comm` (own streams) instead of inside f, b and i."""
    lat, bw = {}, {}
    for s in range(layout.pp * layout.vpp - 1):
        a, b = _rank_of_stage(layout, s), _rank_of_stage(layout, s + 1)
        if a != b:
            link = cluster.p2p_link(a * costs.pp_stride, b * costs.pp_stride)
            lat[(a, b)] = link.latency_s * 1e3
            bw[(a, b)] = link.bandwidth_gbps

    return dict(compute_ms(costs, layout), latency_ms=lat or 0.0, bandwidth_gbps=bw or 1.0,
                activation_bytes=costs.p2p_bytes)


def compute_ms(costs: StageCosts, layout: Layout) -> dict:
    """f, b, i, w per stage in ms, plus `tp_comm` and `ep_comm` (taken out of f and i) for
    braided schedules."""
    def ms(xs):
        return [x * 1e3 for x in xs]
    tp, ep = braided_tp(costs, layout), braided_ep(costs, layout)
    if not tp and not ep:
        return dict(f=ms(costs.f), b=ms(costs.b), i=ms(costs.i), w=ms(costs.w))
    off = [c + e for c, e in zip(tp or [0.0] * len(costs.f), ep or [0.0] * len(costs.f))]
    f = [x - c for x, c in zip(costs.f, off)]
    i = [x - c for x, c in zip(costs.i, off)]
    out = dict(f=ms(f), b=ms([x + y for x, y in zip(i, costs.w)]), i=ms(i), w=ms(costs.w))
    if tp:
        out["tp_comm"] = ms(tp)
    if ep:
        out["ep_comm"] = ms(ep)
    return out


def lower_bound(costs: StageCosts, layout: Layout, cluster: Cluster, m: int) -> float:
    """A valid lower bound on the step time (seconds), for branch-and-bound search: each rank
    waits for micro-batch 0 to reach its first chunk, does all its work, and (schedules without
    a split backward) its last backward must still travel down to stage 0. A braided schedule
    holds each rank's compute stream for its actions' durations, a braid for its span alone
    (`pipeline.braid_span`)."""
    stages = layout.pp * layout.vpp
    f, b = costs.f, costs.b
    braided = bool(braided_tp(costs, layout) or braided_ep(costs, layout))
    rank_of = [_rank_of_stage(layout, s) for s in range(stages)]
    hop = [0.0] * stages
    for s in range(stages - 1):
        if rank_of[s] != rank_of[s + 1]:
            hop[s] = cluster.p2p(costs.p2p_bytes, rank_of[s] * costs.pp_stride,
                                 rank_of[s + 1] * costs.pp_stride)
    reach_f = [0.0] * stages      # time for micro-batch 0's forward to reach stage s
    back_b = [0.0] * stages       # time for a gradient at stage s to finish stage 0's backward
    for s in range(1, stages):
        reach_f[s] = reach_f[s - 1] + f[s - 1] + hop[s - 1]
        back_b[s] = back_b[s - 1] + b[s - 1] + hop[s - 1]
    split = info(layout.schedule).splits_backward
    best = 0.0
    busies = _braided_busy(costs, layout, m) if braided else None
    for r, chunks in enumerate(rank_chunks(layout.schedule, layout.pp, layout.vpp)):
        busy = busies[r] if busies else m * sum(f[c] + b[c] for c in chunks)
        tail = 0.0 if split else back_b[min(chunks)]
        best = max(best, min(reach_f[c] for c in chunks) + busy + tail)
    return best + _tail(costs)


def _braided_busy(costs: StageCosts, layout: Layout, m: int) -> list[float]:
    """Per pipeline rank, the least time its compute stream is busy in a braided schedule:
    plain actions with their TP collectives and EP all-to-alls exposed, braids for their span
    alone."""
    args = compute_ms(costs, layout)
    f, b, i, w = (args[k] for k in ("f", "b", "i", "w"))
    zeros = [0.0] * len(f)
    tpc, epc = args.get("tp_comm", zeros), args.get("ep_comm", zeros)
    comm = [c + e for c, e in zip(tpc, epc)]
    plain = {"F": [x + c for x, c in zip(f, comm)], "B": [x + c for x, c in zip(b, comm)],
             "I": [x + c for x, c in zip(i, comm)], "W": w}
    spans: dict = {}
    out = []
    for counts in action_counts(layout.schedule, layout.pp, layout.vpp, m):
        total = 0.0
        for parts, n in counts.items():
            if len(parts) == 1:
                op, st = parts[0]
                total += n * plain[op][st]
            else:
                if parts not in spans:
                    spans[parts] = braid_span(parts, f, b, i, w, tpc, epc)
                total += n * spans[parts]
        out.append(total / 1e3)
    return out


def _rank_of_stage(layout: Layout, s: int) -> int:
    return _stage_ranks(layout.schedule, layout.pp, layout.vpp)[s]


@lru_cache(maxsize=4096)
def _stage_ranks(schedule: str, pp: int, vpp: int) -> tuple[int, ...]:
    return tuple(info(schedule).stage_to_rank(pp, vpp))


def _tails(costs: StageCosts) -> list[float]:
    """Per pipeline rank: exposed DP reduction + optimizer + scalar all-reduces + the compute the
    hidden DP traffic's NCCL kernels slow down (`dp_sm`)."""
    zeros = [0.0] * len(costs.dp_exposed)
    syncs, sm = costs.step_sync or zeros, costs.dp_sm or zeros
    return [d + o + y + c for d, o, y, c in zip(costs.dp_exposed, costs.optimizer, syncs, sm)]


def _tail(costs: StageCosts) -> float:
    return max(_tails(costs)) + costs.embedding_sync


def estimate(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
             eff: Efficiency | None = None, simulate: bool = True, detail: bool = True) -> Estimate:
    """Everything about one layout. `simulate=False` stops after memory (and the lower bound);
    `detail` runs one more simulation without point-to-point cost to split the pipeline's
    idle time into bubble and exposed transfers."""
    if eff is None:
        eff = with_measured_pass(default_efficiency(cluster.gpu), spec, job, cluster.gpu)
    problem = layout_problem(spec, job, layout, cluster.num_gpus)
    if problem:
        return Estimate(layout, False, problem)
    m = layout.microbatches_for(job)
    inflight = list(peak_inflight(layout.schedule, layout.pp, layout.vpp, m))
    memory = stage_memory(spec, layout, job, inflight)
    problem = memory_problem(memory, cluster.gpu.mem_gb)
    costs = stage_costs(spec, layout, job, cluster, eff)
    est = Estimate(layout, problem is None, problem or fits_reason(memory, cluster), memory, microbatches=m,
                   lower_bound_s=lower_bound(costs, layout, cluster, m))
    if simulate:
        finish_estimate(est, spec, job, cluster, costs, detail, eff)
    return est


def fits_reason(memory: list[StageMemory], cluster: Cluster) -> str:
    worst = max(memory, key=lambda s: s.total_gb)
    return (f"fits: largest stage (pipeline rank {worst.rank}) needs {worst.total_gb:.1f} of "
            f"{gb_text(cluster.gpu.mem_gb)} GB")


def step_time(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster, eff: Efficiency) -> float:
    """Predicted step time in seconds, whether or not the layout fits in memory (calibration
    prices measured runs, which evidently fit)."""
    problem = layout_problem(spec, job, layout, cluster.num_gpus)
    if problem:
        raise ValueError(f"{layout.short()}: {problem}")
    est = Estimate(layout, True, "", microbatches=layout.microbatches_for(job))
    costs = stage_costs(spec, layout, job, cluster, eff)
    return finish_estimate(est, spec, job, cluster, costs, detail=False, eff=eff).step_time_s


def finish_estimate(est: Estimate, spec: ModelSpec, job: Job, cluster: Cluster, costs: StageCosts,
                    detail: bool = True, eff: Efficiency | None = None) -> Estimate:
    """Simulate the step; with `eff` and more ranks than `cluster.host_cores`, iterate the host
    contention to its fixed point (commpipe.plan.host), re-pricing the costs each time."""
    _finish_once(est, spec, job, cluster, costs, detail)
    if eff is None or not host.oversubscribed(cluster, est.layout):
        return est
    kappa = wake = 1.0
    for _ in range(host.MAX_ITERS):
        lay = est.layout
        args = cost_table_args(costs, lay, cluster)
        est.busy_overlap = busy_overlap(lay.schedule, lay.pp, lay.vpp, est.microbatches, **args,
                                        cpu_share=_cpu_share(costs))
        est.presence_overlap = busy_overlap(lay.schedule, lay.pp, lay.vpp, est.microbatches, **args)
        new, new_wake = host.contention(est, cluster)
        if abs(new - kappa) <= host.TOLERANCE * kappa and abs(new_wake - wake) <= host.TOLERANCE * wake:
            break
        # damped: busy time itself grows with the contention
        kappa, wake = (kappa + new) / 2, (wake + new_wake) / 2
        c, e = host.contended(cluster, eff, kappa, wake)
        costs = stage_costs(spec, lay, job, c, e)
        _finish_once(est, spec, job, c, costs, detail)
    est.host_contention, est.wake_contention = kappa, wake
    est.mfu = est.tflops_per_gpu / cluster.gpu.peak_tflops(job.precision)
    return est


def _cpu(costs: StageCosts) -> dict[str, list[float]]:
    """Host CPU seconds of each action per stage: compute plus collective call overheads."""
    host_f = costs.host_f or [0.0] * len(costs.comp_f)
    host_i = costs.host_i or [0.0] * len(costs.comp_f)
    i = [c + h for c, h in zip(costs.comp_i, host_i)]
    return {"F": [c + h for c, h in zip(costs.comp_f, host_f)], "I": i, "W": list(costs.comp_w),
            "B": [x + y for x, y in zip(i, costs.comp_w)]}


def _cpu_share(costs: StageCosts) -> dict[str, list[float]]:
    """Share of each action's simulated duration that uses the CPU (the rest is waiting)."""
    cpu, dur = _cpu(costs), {"F": costs.f, "B": costs.b, "I": costs.i, "W": costs.w}
    return {op: [min(1.0, c / d) if d > 0 else 1.0 for c, d in zip(cpu[op], dur[op])] for op in cpu}


def _finish_once(est: Estimate, spec: ModelSpec, job: Job, cluster: Cluster, costs: StageCosts,
                 detail: bool) -> Estimate:
    layout, m = est.layout, est.microbatches
    args = cost_table_args(costs, layout, cluster)
    if moe_plan.routed_spec(spec) is not None:
        est.moe = (moe_summary(spec, layout, job, cluster, costs.moe_host)
                   | {"a2a_braided": "ep_comm" in args})
    makespan_ms, busy_ms = simulate_step(layout.schedule, layout.pp, layout.vpp, m, **args)
    tails = _tails(costs)
    worst = max(range(layout.pp), key=lambda r: tails[r])
    cpu = _cpu(costs)
    est.cpu_s = [m * sum(cpu["F"][c] + cpu["B"][c] for c in chunk_stages(layout, r))
                 for r in range(layout.pp)]
    est.optimizer_s, est.busy_s = list(costs.optimizer), [b / 1e3 for b in busy_ms]
    step = makespan_ms / 1e3 + tails[worst] + costs.embedding_sync
    rb = max(range(layout.pp), key=lambda r: busy_ms[r])
    chunks = chunk_stages(layout, rb)
    per = {k: m * sum(getattr(costs, a)[c] + getattr(costs, b_)[c] for c in chunks)
           for k, a, b_ in (("tp", "tp_f", "tp_b"), ("cp", "cp_f", "cp_b"))}
    compute = m * sum(costs.comp_f[c] + costs.comp_i[c] + costs.comp_w[c] for c in chunks)
    if costs.ep_f:      # MoE: the EP all-to-alls of the busiest rank, exposed (moe_costs.py)
        per["ep"] = m * sum(costs.ep_f[c] + costs.ep_b[c] for c in chunks)
    if "ep_comm" in args:       # braided: the EP time the simulator left exposed on this rank
        _, bare = simulate_step(layout.schedule, layout.pp, layout.vpp, m, **dict(args, ep_comm=None))
        per["ep"] = max(0.0, (busy_ms[rb] - bare[rb]) / 1e3) \
            + m * sum(costs.ep_b[c] - costs.ep_f[c] for c in chunks)
    if "tp_comm" in args:       # braided: the TP time the simulator left exposed on this rank
        rest = compute + per["cp"] + m * sum((costs.zero_f[c] if costs.zero_f else 0.0)
                                             + (costs.zero_b[c] if costs.zero_b else 0.0)
                                             for c in chunks)
        per["tp"] = max(0.0, busy_ms[rb] / 1e3 - rest - per.get("ep", 0.0))
    idle = makespan_ms / 1e3 - busy_ms[rb] / 1e3
    p2p = 0.0
    if detail and layout.pp > 1:
        free = dict(args, latency_ms=0.0, bandwidth_gbps=1e12)
        span0, _ = simulate_step(layout.schedule, layout.pp, layout.vpp, m, **free)
        p2p = max(0.0, (makespan_ms - span0) / 1e3)
    zero = m * sum((costs.zero_f[c] if costs.zero_f else 0.0) + (costs.zero_b[c] if costs.zero_b else 0.0)
                   for c in chunks)
    est.breakdown = {"compute": compute, "tp": per["tp"], "cp": per["cp"], "zero": zero,
                     "pp_bubble": max(0.0, idle - p2p), "pp_p2p": min(p2p, idle),
                     "dp": costs.dp_exposed[worst], "dp_sm": costs.dp_sm[worst] if costs.dp_sm else 0.0,
                     "optimizer": costs.optimizer[worst],
                     "step_sync": costs.step_sync[worst] if costs.step_sync else 0.0,
                     "embedding_sync": costs.embedding_sync}
    if "ep" in per:
        est.breakdown["ep"] = per["ep"]
    est.step_time_s = step
    est.bubble_fraction = sum(1 - b / makespan_ms for b in busy_ms) / len(busy_ms)
    tokens = job.global_batch * job.seq_len
    n = layout.gpus
    # the family's one FLOPs definition (a MoE decoder's counts its active experts)
    est.tflops_per_gpu = family_of(spec).flops_per_unit(spec, job.seq_len) * tokens / step / n / 1e12
    hw = hardware_flops_per_token(spec, job.seq_len, layout.recompute, job.uses_flash(spec))
    est.hw_tflops_per_gpu = hw * tokens / step / n / 1e12
    # MFU against the peak of the precision the GEMMs run in (FP8's under --precision fp8)
    est.mfu = est.tflops_per_gpu / cluster.gpu.peak_tflops(job.precision)
    return est
