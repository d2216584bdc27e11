"""Layout search: enumerate, prune by memory, bound, simulate the survivors, rank, explain.

1. enumerate every (tp, cp, pp, dp, vpp, micro-batch size, schedule, recompute) valid for the
   GPU count (`layout.enumerate_layouts`);
2. price memory per stage with the simulator's in-flight counts (cached per schedule shape)
   and drop layouts that do not fit;
3. compute per-stage costs and a lower bound on the step time for every survivor
   (`estimate.lower_bound`: pipeline fill, the busiest rank's work, the backward drain, and the
   exact DP/optimizer tail);
4. branch and bound: simulate survivors in order of their bound, stop when the next bound
   exceeds the K-th best simulated step time. The answer is the same as simulating all of
   them, since no unsimulated layout can beat the K-th.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

from commpipe.models.spec import ModelSpec
from commpipe.plan.cluster import Cluster
from commpipe.plan.efficiency import Efficiency, default_efficiency
from commpipe.plan.estimate import Estimate, estimate, finish_estimate, fits_reason, lower_bound
from commpipe.plan.layout import Job, Layout, enumerate_layouts, layout_problem
from commpipe.plan.memory import gb_text, memory_problem, stage_memory, static_memory_gb
from commpipe.plan.pass_split import with_measured_pass
from commpipe.plan.pipeline import peak_inflight
from commpipe.plan.timing import stage_costs
from commpipe.sim.engine import gc_paused


@dataclass
class Candidate:
    est: Estimate
    costs: object


@dataclass
class SearchResult:
    top: list[Estimate]
    considered: int
    feasible: int
    simulated: int
    alternatives: list[tuple[str, Estimate | None, str]] = field(default_factory=list)
    rejected: dict = field(default_factory=dict)   # reason kind -> count
    example_rejection: str = ""
    explanation: dict | None = None    # when nothing fits: plan.explain.explain_none's account


def _prepare(spec, job, cluster, eff, layout) -> Candidate | str:
    static = static_memory_gb(spec, layout, job)
    if static > cluster.gpu.mem_gb:
        return (f"out of memory: weights, gradients and optimizer states alone need {static:.1f} GB "
                f"> {gb_text(cluster.gpu.mem_gb)} GB; use more tp/pp or a higher --zero stage")
    m = layout.microbatches_for(job)
    inflight = list(peak_inflight(layout.schedule, layout.pp, layout.vpp, m))
    memory = stage_memory(spec, layout, job, inflight)
    problem = memory_problem(memory, cluster.gpu.mem_gb)
    if problem:
        return problem
    costs = stage_costs(spec, layout, job, cluster, eff)
    est = Estimate(layout, True, fits_reason(memory, cluster), memory, microbatches=m,
                   lower_bound_s=lower_bound(costs, layout, cluster, m))
    return Candidate(est, costs)


def rank_key(e: Estimate) -> tuple[float, int, int, int]:
    """Order of the ranking: step time, and among layouts the model prices the same (to 9
    significant digits: layouts that differ only in what the model does not price) the one with
    the least model parallelism, tp*cp*pp,
    then the smaller cp and pp: a rule for equal predictions, not a cost (what more parallelism
    costs beyond the model, such as more kernels and more stages, can only add to it)."""
    lay = e.layout
    return float(f"{e.step_time_s:.9g}"), lay.tp * lay.cp * lay.pp, lay.cp, lay.pp


def _branch_and_bound(cands: list[Candidate], k: int, spec, job, cluster,
                      eff=None) -> tuple[list[Estimate], int]:
    """The k best of `cands` by `rank_key` (sorted by lower bound), simulating as few as possible."""
    cands = sorted(cands, key=lambda c: c.est.lower_bound_s)
    heap: list[tuple] = []          # the worst kept on top: rank key negated, then the index
    simulated = 0
    for n, c in enumerate(cands):
        if len(heap) >= k and c.est.lower_bound_s > heap[0][-1].step_time_s:
            break
        finish_estimate(c.est, spec, job, cluster, c.costs, detail=False, eff=eff)
        simulated += 1
        item = (*(-x for x in rank_key(c.est)), n, c.est)
        if len(heap) < k:
            heapq.heappush(heap, item)
        elif item[:4] > heap[0][:4]:
            heapq.heapreplace(heap, item)
    best = sorted((item[-1] for item in heap), key=rank_key)
    return best, simulated


def search(spec: ModelSpec, job: Job, cluster: Cluster, eff: Efficiency | None = None,
           fixed: dict | None = None, top: int = 5, explain: bool = True) -> SearchResult:
    # the programs it generates and caches are ~1e6 long-lived objects, which the cyclic
    # collector would rescan over and over (a fifth of the search's time): it runs once, after
    with gc_paused():
        return _search(spec, job, cluster, eff, fixed, top, explain)


def _search(spec, job, cluster, eff, fixed, top, explain) -> SearchResult:
    if eff is None:
        eff = with_measured_pass(default_efficiency(cluster.gpu), spec, job, cluster.gpu)
    cluster.gpu.peak_tflops(job.precision)         # fp8 on a GPU without FP8 fails here
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    layouts = enumerate_layouts(spec, job, cluster.num_gpus, fixed)
    if not layouts:
        raise ValueError(_why_none(spec, job, cluster, fixed))
    cands: list[Candidate] = []
    rejected: dict[str, int] = {}
    example = ""
    for layout in layouts:
        c = _prepare(spec, job, cluster, eff, layout)
        if isinstance(c, str):
            rejected["out of memory"] = rejected.get("out of memory", 0) + 1
            example = example or f"{layout.short()}: {c}"
            continue
        cands.append(c)
    result = SearchResult([], len(layouts), len(cands), 0, rejected=rejected, example_rejection=example)
    if not cands:
        from commpipe.plan.explain import explain_none

        result.explanation = explain_none(spec, job, cluster, fixed, layouts)
        return result
    best, simulated = _branch_and_bound(cands, top, spec, job, cluster, eff)
    for e in best:                      # split idle time into bubble and transfers for the table
        _detail(e, spec, job, cluster, eff)
    result.top, result.simulated = best, simulated
    if explain:
        result.alternatives, extra = _alternatives(best[0], cands, spec, job, cluster, eff, layouts)
        result.simulated += extra
    return result


def _detail(e: Estimate, spec, job, cluster, eff) -> None:
    costs = stage_costs(spec, e.layout, job, cluster, eff)
    finish_estimate(e, spec, job, cluster, costs, detail=True, eff=eff)


def _why_none(spec, job, cluster, fixed) -> str:
    probe = Layout(**{k: v for k, v in fixed.items()})
    if "dp" not in fixed:
        rest = cluster.num_gpus // (probe.tp * probe.cp * probe.pp)
        probe = replace(probe, dp=max(1, rest))
    problem = layout_problem(spec, job, probe, cluster.num_gpus)
    return ("no valid layout for " + ", ".join(f"{k}={v}" for k, v in fixed.items())
            + f" on {cluster.num_gpus} GPUs" + (f": {problem}" if problem else ""))


# -- why common alternatives lose ----------------------------------------------------------------
def _alternative_filters(best: Layout, cluster: Cluster) -> list[tuple[str, object]]:
    g = cluster.gpus_per_node
    out = []
    if best.tp <= g:
        out.append((f"TP beyond a node (tp>{g})", lambda lay: lay.tp > g))
    if best.tp != min(g, 8):
        out.append((f"TP{min(g, 8)} (a full node)", lambda lay: lay.tp == min(g, 8)))
    if best.pp > 1:
        out.append(("no pipeline (pp=1)", lambda lay: lay.pp == 1))
    else:
        out.append(("with a pipeline (pp>1)", lambda lay: lay.pp > 1))
    out.append(("pure data parallel", lambda lay: lay.tp == lay.cp == lay.pp == 1))
    if best.cp == 1:
        out.append(("context parallel (cp>1)", lambda lay: lay.cp > 1))
    if best.pp > 1 and best.schedule != "1f1b":
        out.append(("plain 1F1B schedule", lambda lay: lay.schedule == "1f1b" and lay.pp == best.pp))
    if best.recompute != "none":
        out.append(("no recompute", lambda lay: lay.recompute == "none"))
    else:
        out.append(("full recompute", lambda lay: lay.recompute == "full"))
    return out


def _alternatives(best: Estimate, cands, spec, job, cluster, eff, layouts):
    rows, extra = [], 0
    for label, pred in _alternative_filters(best.layout, cluster):
        if pred(best.layout):                     # the best layout is itself of this kind
            continue
        group = [c for c in cands if pred(c.est.layout)]
        if not group:
            valid = [lay for lay in layouts if pred(lay)]
            if not valid:
                continue
            # nothing fits: report the smallest-memory one with its reason
            ests = [estimate(spec, lay, job, cluster, eff, simulate=False) for lay in valid[:2000]]
            worst = min(ests, key=lambda e: e.memory_gb_per_gpu)
            rows.append((label, worst, worst.reason))
            continue
        fresh = [Candidate(replace(c.est), c.costs) for c in group]
        top, n = _branch_and_bound(fresh, 1, spec, job, cluster, eff)
        extra += n
        alt = top[0]
        _detail(alt, spec, job, cluster, eff)
        rows.append((label, alt, explain_loss(alt, best, cluster)))
    return rows, extra


def group_place(layout: Layout, cluster: Cluster, dim: str) -> str:
    size, stride = {"tp": (layout.tp, 1), "cp": (layout.cp, layout.tp),
                    "dp": (layout.dp * layout.cp, layout.tp)}[dim]
    inside, _ = cluster.placement(size, stride)
    return "inside a node" if inside else "across nodes"


# breakdown terms without a branch of their own in explain_loss
OTHER_TERMS = {"dp_sm": "compute slowed by the DP reduction's NCCL SMs",
               "step_sync": "the step's scalar all-reduces (loss, gradient norm)",
               "embedding_sync": "the tied embedding's gradient all-reduce"}


def explain_loss(alt: Estimate, best: Estimate, cluster: Cluster) -> str:
    """One line: the term of the step-time breakdown that grew most against the best."""
    lay = alt.layout
    deltas = {k: alt.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in alt.breakdown}
    term = max(deltas, key=deltas.get)
    x = _ms(alt.breakdown.get(term, 0.0))
    slower = (alt.step_time_s / best.step_time_s - 1) * 100
    head = f"{slower:+.0f}% step time: "
    if term == "tp":
        where = group_place(lay, cluster, "tp")
        link = "the inter-node link" if where == "across nodes" else "NVLink"
        return head + f"TP{lay.tp} {where}: TP collectives on {link} cost {x} ms per step"
    if term == "pp_bubble":
        return head + (f"pipeline bubble {x} ms per step ({lay.schedule}, pp={lay.pp}, "
                       f"m={alt.microbatches} micro-batches)")
    if term == "pp_p2p":
        return head + f"pipeline transfers exposed {x} ms per step"
    if term == "dp":
        return head + (f"DP gradient reduction over {lay.dp * lay.cp} ranks "
                       f"{group_place(lay, cluster, 'dp')} exposes {x} ms per step")
    if term == "zero":
        return head + (f"ZeRO-{lay.zero} per-layer gathers and reduce-scatters over {lay.shard_size} "
                       f"ranks {group_place(lay, cluster, 'dp')} expose {x} ms per step")
    if term == "cp":
        return head + f"CP{lay.cp} ring exchange {group_place(lay, cluster, 'cp')} exposes {x} ms"
    if term == "optimizer":
        return head + f"optimizer step {x} ms (states not sharded or more parameters per GPU)"
    if term == "ep":
        inside, _ = cluster.placement(lay.ep, lay.tp)
        where = "inside a node" if inside else "across nodes"
        return head + (f"EP{lay.ep} all-to-alls {where} expose {x} ms per step "
                       f"({alt.microbatches} micro-batches of {lay.micro_batch_size})")
    if term in OTHER_TERMS:
        return head + f"{OTHER_TERMS[term]} {x} ms per step"
    if term != "compute":
        return head + f"{term} {x} ms per step"
    return head + f"compute {x} ms per step on the busiest rank ({compute_cause(alt, best)})"


def compute_cause(alt: Estimate, best: Estimate) -> str:
    """Why `alt` computes longer than `best`, from what differs between them: recomputation
    only when it replays more (its hardware over model FLOPs is higher: flash attention leaves
    selective recompute nothing to replay), then a finer split of the GEMMs, a different
    micro-batch size, more layers on the busiest rank."""
    a, b = alt.layout, best.layout
    causes = []
    replay = alt.hw_tflops_per_gpu / alt.tflops_per_gpu if alt.tflops_per_gpu else 1.0
    replay_best = best.hw_tflops_per_gpu / best.tflops_per_gpu if best.tflops_per_gpu else 1.0
    if replay > replay_best * (1 + 1e-9):
        causes.append({"full": "full recompute replays the forward", "op": "per-op selective "
                       "recompute", "selective": "selective recompute"}.get(a.recompute, "recompute"))
    if a.tp * a.cp > b.tp * b.cp:
        causes.append(f"smaller GEMMs per GPU (tp{a.tp} cp{a.cp})")
    if a.micro_batch_size != b.micro_batch_size:
        causes.append(f"mbs={a.micro_batch_size} against {b.micro_batch_size}")
    if a.pp < b.pp:
        causes.append(f"more layers per stage (pp{a.pp})")
    return ", ".join(causes) or f"mbs={a.micro_batch_size}"


def _ms(seconds: float) -> str:
    """Milliseconds, three significant digits below 100, whole above: never an exponent."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:#.3g}".rstrip(".")


def describe(e: Estimate, cluster: Cluster) -> str:
    """One line for a top entry: what its step time is made of."""
    b, step = e.breakdown, e.step_time_s
    parts = [f"fits in {gb_text(e.memory_gb_per_gpu)}/{gb_text(cluster.gpu.mem_gb)} GB"]
    share = {k: v / step for k, v in b.items()}
    parts.append(f"compute {share.get('compute', 0):.0%}")
    if e.layout.pp > 1:
        parts.append(f"bubble {share.get('pp_bubble', 0):.0%} ({e.layout.schedule}, m={e.microbatches})")
    if e.layout.tp > 1:
        parts.append(f"TP{e.layout.tp} {group_place(e.layout, cluster, 'tp')} {share.get('tp', 0):.0%}")
    if e.layout.cp > 1:
        parts.append(f"CP {share.get('cp', 0):.0%}")
    if e.layout.dp * e.layout.cp > 1:
        parts.append(f"DP {share.get('dp', 0):.1%}")
    if share.get("zero", 0) > 0:
        parts.append(f"ZeRO-{e.layout.zero} traffic {share['zero']:.1%}")
    return "; ".join(parts)
