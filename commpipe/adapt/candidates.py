"""Candidate plans for the same processes and the same global batch, cheapest switch first:
(a) another split of layers over the pipeline stages, (b) another micro-batch count or
schedule, (d) the same plan with the micro-batches shared unevenly across DP replicas (a
rebalance: nothing moves), (c) the same degrees with the ranks placed in another order (a
re-placement: which groups cross the slow link), and every other tp x cp x pp x dp layout (each
with its balanced split, at every micro-batch size and schedule), in both orders. For a
Mixture-of-Experts model a layout is also its expert-parallel size: every ep the layout
admits (commpipe.parallel.expert.check_ep: ep divides dp*cp and the expert count;
commpipe.train.moe.layout_problem) is a candidate of its own, the running tp x cp x pp x dp
with another ep included; a dense model's plans keep ep = 1."""

from __future__ import annotations

from dataclasses import replace

from commpipe.adapt.config import AdaptConfig
from commpipe.adapt.model import CostModel
from commpipe.layout import Layout
from commpipe.models.spec import ModelSpec, divisors
from commpipe.parallel.dims import DEFAULT_ORDER
from commpipe.plan.moe import ep_choices, routed_spec
from commpipe.schedules.registry import ONE_CHUNK, info

# rank placements tried (commpipe.parallel.dims): DP inside PP (Megatron's default) or PP inside
# DP (consecutive stages on consecutive ranks); TP and CP stay innermost, on the fastest links
ORDERS = (DEFAULT_ORDER, "tp-cp-pp-dp")
# one stage per rank (any uneven split works), the running default first
SCHEDULES = ("1f1b",) + tuple(n for n in ONE_CHUNK if n != "1f1b")


def _feasible(plan: Layout, spec: ModelSpec, seq_len: int, global_batch: int) -> bool:
    dims = plan.dims
    if plan.ep not in ep_choices(spec, plan.dp * plan.cp):
        return False
    if routed_spec(spec) is not None:
        from commpipe.train.dp_split import check_ep_blocks
        from commpipe.train.moe import layout_problem

        if layout_problem(spec, dims, plan.ep):
            return False
        try:                    # an EP group's replicas run one count (rebalances keeps to it)
            check_ep_blocks(plan.dp_microbatches, plan.ep)
        except ValueError:
            return False
    try:
        dims.check_model(spec, seq_len, list(plan.stage_layers))
        m = dims.check_batch(global_batch, plan.micro_batch_size)
    except ValueError:
        return False
    return m == plan.microbatches and plan.microbatches >= 1


def resplits(cur: Layout, model: CostModel) -> list[Layout]:
    """The balanced split and every one-layer move between neighbouring stages."""
    out = {model.balanced_split(cur)}
    layers = list(cur.stage_layers)
    for s in range(len(layers) - 1):
        for d in (-1, 1):
            new = layers.copy()
            new[s] += d
            new[s + 1] -= d
            if min(new) >= 1:
                out.add(tuple(new))
    out.discard(cur.stage_layers)
    return [replace(cur, stage_layers=s, dp_microbatches=()) for s in sorted(out)]


def rebatches(base: Layout, global_batch: int, max_per_stage: int,
              schedules=SCHEDULES) -> list[Layout]:
    """Other micro-batch counts (same global batch), from pp to max_per_stage x max(pp, 2), and
    schedules for `base`'s layout and split. One stage runs its micro-batches one after another
    whatever the schedule, so without a pipeline only the running schedule is kept."""
    if base.pp == 1:
        schedules = (base.schedule,)
    per_dp = global_batch // base.dp
    out = []
    for mbs in divisors(per_dp):
        m = per_dp // mbs
        if m < base.pp or m > max_per_stage * max(base.pp, 2):
            continue
        for sched in schedules:
            if info(sched).m_problem(base.pp, m):
                continue
            p = Layout(tp=base.tp, cp=base.cp, pp=base.pp, dp=base.dp, ep=base.ep,
                       stage_layers=base.stage_layers, schedule=sched, microbatches=m,
                       micro_batch_size=mbs, order=base.order)
            if p != base:
                out.append(p)
    return out


def proportional(total: int, speeds: list[float], least: int = 1) -> tuple[int, ...]:
    """`total` micro-batches split in proportion to `speeds`, each replica at least `least`:
    the ideal shares rounded down (raised to `least`), then one at a time to the replica
    furthest below its share, or from the one furthest above it."""
    n = len(speeds)
    least = min(least, total // n)
    ideal = [total * s / sum(speeds) for s in speeds]
    counts = [max(least, int(x)) for x in ideal]
    while sum(counts) > total:
        i = max((i for i in range(n) if counts[i] > least), key=lambda i: counts[i] - ideal[i])
        counts[i] -= 1
    while sum(counts) < total:
        counts[max(range(n), key=lambda i: ideal[i] - counts[i])] += 1
    return tuple(counts)


def rebalances(cur: Layout, model: CostModel) -> list[Layout]:
    """Micro-batches per DP replica in proportion to each replica's measured speed (its slowest
    rank), every one-micro-batch move from there between two replicas, and the even split;
    counts the schedule cannot run are left out (the model prices the rest). Under expert
    parallelism the ep consecutive replicas of an EP group run one count (their all-to-alls pair
    up micro-batch by micro-batch: commpipe.train.dp_split.check_ep_blocks), so the shares go to
    the groups, each at its slowest replica's speed."""
    ep = cur.ep if cur.ep > 1 else 1
    groups = cur.dp // ep
    if groups < 2:
        return []
    total = cur.microbatches * cur.dp // ep          # per group: each of its replicas runs it
    least = info(cur.schedule).min_m(cur.pp)
    speeds = [min(1.0 / model.replica_slowdown(cur, d) for d in range(g * ep, (g + 1) * ep))
              for g in range(groups)]
    base = proportional(total, speeds, least)
    found = {base, (cur.microbatches,) * groups}
    for a in range(groups):
        for b in range(groups):
            if a != b:
                moved = list(base)
                moved[a], moved[b] = moved[a] - 1, moved[b] + 1
                found.add(tuple(moved))
    found = {tuple(c for c in counts for _ in range(ep)) for counts in found}
    out = []
    for counts in sorted(found):
        if any(info(cur.schedule).m_problem(cur.pp, c) for c in counts):
            continue
        even = len(set(counts)) == 1
        plan = replace(cur, dp_microbatches=() if even else counts)
        if plan != cur:
            out.append(plan)
    return out


def layouts(cur: Layout, model: CostModel, spec: ModelSpec, seq_len: int, global_batch: int,
            world: int, ranks_per_node: int) -> list[Layout]:
    """Every other tp x cp x pp x dp (x ep) of this world (TP kept within a node), with the
    balanced split and the running schedule, at the running micro-batch size where it
    divides."""
    out = []
    for tp in divisors(world):
        if tp > ranks_per_node and tp > 1:
            continue
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if pp > spec.layers:
                    continue
                per_dp = global_batch // dp if global_batch % dp == 0 else 0
                mbs = cur.micro_batch_size if per_dp and per_dp % cur.micro_batch_size == 0 else 1
                m = per_dp // mbs if per_dp else 0
                if m < pp:
                    continue
                sched = cur.schedule if cur.schedule in SCHEDULES else "1f1b"
                even = tuple([spec.layers // pp + (1 if s < spec.layers % pp else 0)
                              for s in range(pp)])
                for ep in ep_choices(spec, dp * cp):
                    if (tp, cp, pp, dp, ep) == (cur.tp, cur.cp, cur.pp, cur.dp, cur.ep):
                        continue
                    draft = Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, stage_layers=even,
                                   schedule=sched, microbatches=m, micro_batch_size=mbs)
                    plan = replace(draft, stage_layers=model.balanced_split(draft))
                    if _feasible(plan, spec, seq_len, global_batch):
                        out.append(plan)
    return out


def replacements(plans: list[Layout], world: int, ranks_per_node: int) -> list[Layout]:
    """The same plans with their ranks placed in the other order (`ORDERS`): which of the
    pipeline stages and the DP replicas sit inside a node and which span nodes. Only where it
    changes a group (pp > 1 and dp > 1) and the world spans more than one node."""
    if world <= ranks_per_node:
        return []
    return [replace(p, order=o) for p in plans if p.pp > 1 and p.dp > 1
            for o in ORDERS if o != p.order]


def candidates(cur: Layout, model: CostModel, spec: ModelSpec, seq_len: int, global_batch: int,
               world: int, ranks_per_node: int, acfg: AdaptConfig) -> list[Layout]:
    """Every feasible plan other than `cur`, in the order (a), (b), (d), (c); (d) only with
    acfg.rebalance, (c) only with acfg.layouts. A Mixture-of-Experts model's plans keep the
    running micro-batch size: its load-balancing loss is taken per micro-batch, so another
    size trains another objective from the first step after the switch (commpipe.models.moe),
    where a dense model's only sums in another order."""
    found: list[Layout] = []
    splits = resplits(cur, model) if cur.pp > 1 else []
    found += splits
    best_split = next((p for p in splits if p.stage_layers == model.balanced_split(cur)), cur)
    found += rebatches(best_split, global_batch, acfg.max_microbatches_per_stage)
    if best_split is not cur:
        found += rebatches(cur, global_batch, acfg.max_microbatches_per_stage)
    if acfg.rebalance:
        found += rebalances(cur, model)
    if acfg.layouts:
        others = layouts(cur, model, spec, seq_len, global_batch, world, ranks_per_node)
        # and each re-batched: another layout often pays only at another micro-batch size
        # (fewer, larger micro-batches issue fewer ops: commpipe.adapt.model)
        others += [r for p in others
                   for r in rebatches(p, global_batch, acfg.max_microbatches_per_stage)]
        found += replacements([cur], world, ranks_per_node) + others
        found += replacements(others, world, ranks_per_node)
    if routed_spec(spec) is not None:
        found = [p for p in found if p.micro_batch_size == cur.micro_batch_size]
    seen, out = {cur}, []
    for p in found:
        if p not in seen and _feasible(p, spec, seq_len, global_batch):
            seen.add(p)
            out.append(p)
    return out
