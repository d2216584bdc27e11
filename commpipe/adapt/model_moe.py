"""The Mixture-of-Experts terms of the adaptive cost model (commpipe.adapt.model).

A MoE stage's compute is priced as any stage's, from its family's FLOPs per layer
(models/moe_spec.py: attention, the router, the top_k routed and the shared experts per token;
the same whatever ep, since each rank's experts process its share of the token copies). What
expert parallelism adds (commpipe.parallel.expert):

    all-to-alls   a dispatch and a combine per MoE layer and micro-batch forward, their
                  transposes backward, in the EP group: priced by the planner
                  (commpipe.plan.moe_costs: its bytes per call, T*top_k*imbalance rows of h
                  activations, and its all-to-all over the group's nodes) at the rates this run
                  measured between the group's ranks, exposed in the stage's F and B as the
                  planner prices them; the stage waits for its slowest EP group
    gradients     the routed experts (E/ep per MoE layer on a rank) are summed over edp, the
                  ranks holding the same experts; everything else over dp x cp (GradReducer)
"""

from __future__ import annotations

from commpipe.adapt.model_links import MEASURED_RUN, groups_of
from commpipe.models import moe_spec
from commpipe.models.spec import layer_param_count
from commpipe.plan.cluster import Cluster, Link
from commpipe.plan.moe import routed_spec


def stage_params(spec, plan, s: int) -> tuple[float, float]:
    """(parameters summed over dp x cp, routed-expert parameters of all E experts) of stage s
    of `plan`: the family's counts (models/spec.py, models/moe_spec.py); (all, 0) for a dense
    model."""
    n = len(plan.stage_layers)
    emb = spec.vocab * spec.hidden
    ends = (emb if s == 0 else 0) + (emb if s == n - 1 else 0)
    moe = routed_spec(spec)
    if moe is None:
        return plan.stage_layers[s] * layer_param_count(spec) + ends, 0.0
    start = sum(plan.stage_layers[:s])
    ids = range(start, start + plan.stage_layers[s])
    experts = sum(moe.experts * moe_spec.swiglu_params(moe.hidden, moe.expert_ffn)
                  for i in ids if moe.is_moe_layer(i))
    return sum(moe_spec.layer_param_count(moe, i) for i in ids) - experts + ends, experts


def group_cluster(model, ranks: list[int], senders: int = 1) -> Cluster:
    """The planner's cluster (commpipe.plan.cluster) as the group `ranks` sees it, for
    `model` (a CostModel): its members at positions 0..n-1 (stride 1) on their nodes, each link
    class at the slowest rate measured between the group's ranks of that class (`model.link`:
    per pair, else per node pair, else the class's rate); across nodes each member at its share
    of its node's link, which `senders` ranks use at once (`MeasuredLinks.a2a_senders`)."""
    def rate(cls: str) -> float:
        rates = [model.link(a, b)[1] for a in ranks for b in ranks
                 if a != b and model.link_class(a, b) == cls]
        return min(rates) if rates else model.class_gbps(cls)

    lat = model.base_latency / 1e3
    nodes = tuple(model.node(r) for r in ranks)
    nodes += tuple(model.node(r) for r in range(len(ranks), model.world))
    return Cluster(MEASURED_RUN, max(model.world, len(ranks)), model.rpn,
                   intra=Link(rate("intra_node"), lat),
                   inter=Link(rate("inter_node") / senders, lat),
                   source="measured", backend=model.m.backend, node_of=nodes)


def a2a_ms(model, plan, ranks: list[int]) -> float:
    """One dispatch (or combine) all-to-all of one MoE layer and micro-batch in the EP group
    `ranks` under `plan`: the planner's bytes per call and all-to-all
    (commpipe.plan.moe_costs) at the rates `model` measured between the group's ranks, a node
    link's rate shared by every rank sending across it at once (the members there of each EP
    group crossing it: with one link per node, as the planner's `nics_per_node` 1 prices)."""
    from commpipe.plan.layout import Job
    from commpipe.plan.moe_costs import a2a_bytes, all_to_all

    if len(ranks) < 2:
        return 0.0
    job = Job(plan.microbatches * plan.micro_batch_size * plan.dp, model.seq_len,
              precision="fp32" if model.m.element_bytes == 4 else "bf16")
    cluster = group_cluster(model, ranks, model.a2a_senders(plan, ranks))
    return 1e3 * all_to_all(cluster, a2a_bytes(model.spec, plan, job), len(ranks), 1)


def ep_stage_ms(model, plan, s: int, ranks: list[int]) -> float:
    """The EP all-to-alls of stage s per pass, which the simulator adds to its F and to its B:
    a dispatch and a combine per MoE layer, in the slowest EP group holding any of `ranks`;
    0 without expert parallelism."""
    moe = routed_spec(model.spec)
    if moe is None or plan.ep < 2:
        return 0.0
    start = sum(plan.stage_layers[:s])
    layers = sum(1 for i in range(start, start + plan.stage_layers[s]) if moe.is_moe_layer(i))
    if not layers:
        return 0.0
    groups = [g for g in groups_of(plan, "ep") if set(g) & set(ranks)]
    return 2 * layers * max(a2a_ms(model, plan, g) for g in groups)


def edp_group(plan) -> list[int]:
    """The ranks holding rank 0's experts under `plan` (its edp group)."""
    return list(groups_of(plan, "edp")[0])
