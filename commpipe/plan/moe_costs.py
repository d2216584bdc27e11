"""Time of a Mixture-of-Experts decoder's MLPs in the layout planner: compute and the expert-
parallel all-to-alls per stage (added to timing.StageCosts), and the expert gradients' share of
the data-parallel reduction. What a rank holds: commpipe.plan.moe.

Compute, per MoE layer and micro-batch on the busiest rank (T = b*s/cp tokens, k = top_k,
imb = Job.expert_imbalance, L = E/ep local experts), every GEMM on compute.py's efficiency curve:
    router          (T, h, E)                              replicated over TP
    shared experts  (T, h, 2 S f/tp), (T, S f/tp, h)       a dense SwiGLU over every token
    routed experts  L times (M, h, 2 f/tp), (M, f/tp, h)   M = T k imb / L = T k imb ep / E rows
                                                           per expert: a grouped GEMM priced
                                                           per expert, so small per-expert M
                                                           loses efficiency
Every expert is split over TP (commpipe.parallel.tensor_moe, Megatron-Core's expert tensor
parallelism at its default size, tp): each TP rank runs the same M rows through its f/tp columns.
Dense-MLP layers: (T, h, 2 F/tp), (T, F/tp, h), as LLaMA's MLP. Gate and up run as one GEMM
(Megatron's GroupedMLP fc1, TE's fused layers), as separate GEMMs under per-matrix runtimes
(compute.fused_gemms). Backward: an input- and a weight-gradient GEMM of each forward shape.
Non-GEMM work (permutation, SwiGLU, routing) is HBM-bound, compute.py's rule: `elementwise` times
the bytes the MLP keeps for backward, over the HBM rate, forward; twice that backward. Full
recompute replays the MLP's forward in the backward; selective recompute's SwiGLU replay (one
HBM-bound product per row) is not charged.

FP8 (--precision fp8; Transformer Engine's Linear and GroupedLinear, as Megatron-Core runs MoE
layers under --fp8-format): every routed, shared and dense MLP GEMM at the FP8 rate
(compute.gemms_time), its input cast first (kernels.FP8_CAST_BYTES per M*K element, HBM-bound,
backward twice, as compute.py's dense layers); the router stays bf16 (Megatron's TopKRouter is a
plain linear, not a TE module); the experts' new weights are cast once per step beside Adam. What
FP8 changes in memory (saved inputs, weight copies): commpipe.plan.moe. Dispatch and combine
move bf16 activations (Megatron's all-to-all dispatcher casts nothing).

Communication, per MoE layer and micro-batch: dispatch and combine all-to-alls in the forward,
their transposes in the backward (commpipe.parallel.expert._AllToAll), two more under full
recompute (the forward replayed). Each moves, per rank, its T k token copies of h activations,
(ep-1)/ep of them to other ranks; the busiest rank receives imb times its share; TP inside the
experts leaves this as it was (every TP rank exchanges all T k copies with the ranks of its own
EP group, which hold the same TP slice of other experts), so
    bytes = T * k * h * activation_bytes * imb
    time  = (ep-1)/ep * bytes / NVLink   + one latency step      EP group inside a node
            max over the group's nodes of (peers on the node's share over NVLink, the other
            nodes' share over the NIC) + one latency step        EP group across nodes
where the NIC is each member's share of the node's scale-out links (Cluster.node_links: with
fewer NICs than GPUs, every EP group crossing from a node shares them, as the dispatch runs at
the same layer on every rank).
The EP group is `ep` consecutive ranks of the dp*cp group (stride tp in commpipe's rank grid),
placed by Cluster.placement. The MoE layer's TP all-reduce (the routed and shared experts'
partial sums reduced together) is the layer's second TP collective, which the layer machinery
charges as for LLaMA's MLP; the gate weights' gradient all-reduce TP inside experts adds (T k
values, k/h of that one) is not priced. Priced exposed in the stage's forward and backward (as TP
collectives without overlap) under every schedule but the braided ones (dualpipev, stp), which
run MoE stages unit by unit with the all-to-alls in flight behind the other pass (docs/moe.md):
there they go to the simulator's EP stream (`estimate.braided_ep`, commpipe/sim/units.py), and
what it leaves exposed is the breakdown's `ep`.
"""

from __future__ import annotations

from dataclasses import replace

from commpipe.models import moe_spec as M
from commpipe.parallel.dims import split_layers
from commpipe.plan.cluster import Cluster
from commpipe.plan.compute import gemms_time
from commpipe.plan.kernels import FP8_CAST_BYTES, fp8_cast_bytes, hbm_rate
from commpipe.plan.moe import (
    edp_size,
    expert_params,
    mlp_activation_bytes,
    mlp_fp8_params,
    routed_rows,
    routed_spec,
)
from commpipe.plan.moe_host import NONE, moe_host


def all_to_all(cluster: Cluster, nbytes: float, size: int, stride: int) -> float:
    """Seconds of an all-to-all in which every rank of the group {0, stride, ...} holds `nbytes`
    addressed evenly to the `size` ranks (its own share stays)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    counts = cluster.node_counts(size, stride)
    intra = cluster.intra.bandwidth_gbps * 1e9
    if len(counts) == 1:                             # inside one node
        return (size - 1) / size * nbytes / intra + cluster.intra.latency_s
    slowest = 0.0
    for here in counts:                              # the node with fewest members sends most
        # each member's share of the node's NICs (Cluster.node_links: every EP group crossing
        # from the node exchanges at the same layer)
        nic = cluster.inter.bandwidth_gbps * 1e9 * cluster.node_links(here) / here
        local = (here - 1) / size * nbytes / intra
        remote = (size - here) / size * nbytes / nic
        slowest = max(slowest, local, remote)
    return slowest + cluster.inter.latency_s


def a2a_bytes(spec, layout, job) -> float:
    """Bytes the busiest rank holds for one dispatch (or combine) of one MoE layer and
    micro-batch: its token copies (times the imbalance) of h activations."""
    moe = routed_spec(spec)
    return routed_rows(layout, job, moe) * moe.hidden * job.activation_bytes


def a2a_seconds(spec, layout, job, cluster: Cluster) -> float:
    """One dispatch (or combine) all-to-all of one MoE layer and micro-batch on the busiest rank."""
    return all_to_all(cluster, a2a_bytes(spec, layout, job), layout.ep, layout.tp)


def mlp_gemms(moe, i: int, layout, job, fused: bool) -> list[tuple]:
    """(M, K, N) of layer i's MLP GEMMs in one forward (module docstring)."""
    h = moe.hidden
    tokens = layout.micro_batch_size * job.seq_len / layout.cp

    def swiglu(m, f):
        return [(m, h, 2 * f), (m, f, h)] if fused else [(m, h, f), (m, h, f), (m, f, h)]

    if not moe.is_moe_layer(i):
        return swiglu(tokens, moe.dense_ffn / layout.tp)
    local = moe.experts // layout.ep
    rows = routed_rows(layout, job, moe) / local          # per local expert
    f = moe.expert_ffn / layout.tp                        # this TP rank's columns of an expert
    out = [(tokens, h, moe.experts)]
    if moe.shared_experts:
        out += swiglu(tokens, moe.shared_experts * f)
    # the grouped GEMM's fc1 is gate and up together whatever the runtime (one weight [2f, h])
    return out + local * [(rows, h, 2 * f), (rows, f, h)]


def add_routed_costs(spec, layout, job, cluster: Cluster, eff, costs, fused: bool) -> None:
    """Add every stage's MLP compute and EP all-to-alls to `costs` (a timing.StageCosts whose
    layers were priced with ffn_hidden = 0); nothing for a dense model."""
    moe = routed_spec(spec)
    if moe is None:
        return
    hbm = hbm_rate(cluster.gpu)
    a2a = a2a_seconds(spec, layout, job, cluster)
    full = layout.recompute == "full"
    per_layer: dict = {}
    for i in range(moe.layers):
        key = moe.is_moe_layer(i)
        if key not in per_layer:
            shapes = mlp_gemms(moe, i, layout, job, fused)
            router = shapes[:1] if key else []
            gemm = (gemms_time(router, job, cluster.gpu, eff, fp8=False)
                    + gemms_time(shapes[len(router):], job, cluster.gpu, eff))
            elem = eff.elementwise * mlp_activation_bytes(moe, i, layout, job, "none") / hbm
            # under fp8 every expert and MLP GEMM's input is cast first (kernels.FP8_CAST_BYTES
            # per element, HBM-bound, as compute.py's dense layers); backward: twice, as there
            elem += fp8_cast_bytes(shapes[len(router):], job) / hbm
            calls = 2 if key and layout.ep > 1 else 0
            host = moe_host(moe, layout, job, cluster.gpu, eff) if key else NONE
            if key:
                costs.moe_host = host
            per_layer[key] = (gemm, elem, calls * a2a, host[2:])
    ep_f, ep_b = [], []
    for s, layers in enumerate(split_layers(moe.layers, layout.pp * layout.vpp)):
        f = i = w = comm_f = comm_b = 0.0
        for layer in layers:
            gemm, elem, comm, (host_f, host_b) = per_layer[moe.is_moe_layer(layer)]
            f += gemm + elem + host_f
            # backward: input-gradient GEMMs, twice the forward's HBM traffic, and under full
            # recompute the forward (with its all-to-alls) replayed first; the MoE layer's host
            # operations (moe_host.py, the replay's included)
            i += gemm + 2 * elem + (gemm + elem if full else 0.0) + host_b
            w += gemm
            comm_f += comm
            comm_b += comm * (2 if full else 1)
        costs.comp_f[s] += f
        costs.comp_i[s] += i
        costs.comp_w[s] += w
        ep_f.append(comm_f)
        ep_b.append(comm_b)
    costs.ep_f, costs.ep_b = ep_f, ep_b


def expert_reduction(spec, layout, groups: dict, rank: int):
    """(expert parameters of pipeline rank `rank`, the layout they reduce over, their edp group
    (size, stride)), or None for a dense model: what zero_costs.dp_cost adds to the rank's
    data-parallel traffic. The edp group is every ep-th rank of the dp*cp group."""
    if routed_spec(spec) is None:
        return None
    size, stride = groups["dp_cp"]
    edp = edp_size(layout)
    # ZeRO states of the experts shard over edp (Megatron's expert data-parallel group)
    return expert_params(spec, layout, rank), replace(layout, dp_shard=edp), (edp, stride * layout.ep)


def expert_optimizer_seconds(spec, layout, job, cluster: Cluster, rank: int, zero: int) -> float:
    """HBM-bound Adam over the rank's expert parameters (timing.py's 28 or 24 bytes each),
    sharded over edp under ZeRO-1."""
    n = expert_params(spec, layout, rank)
    shard = edp_size(layout) if zero >= 1 else 1
    adam = n / shard * (28 if job.mixed else 24)
    if job.precision != "fp8":
        return adam / hbm_rate(cluster.gpu)
    # under fp8 the new weights of every FP8 GEMM are cast and transposed once per step, as
    # timing.py's attention linears: the experts over edp, shared experts and dense MLPs over
    # the ZeRO shard group (their Adam is timing.py's, with the rest of the rank's parameters)
    experts, linears = mlp_fp8_params(spec, layout, rank)
    dense_shard = layout.shard_size if zero >= 1 else 1
    cast = FP8_CAST_BYTES * (experts / shard + linears / dense_shard)
    return (adam + cast) / hbm_rate(cluster.gpu)


def summary(spec, layout, job, cluster: Cluster, host: tuple = NONE) -> dict:
    """What `estimate --json` reports of the MoE layers under `layout` (key "moe"); `host`:
    StageCosts.moe_host, the host operations a MoE layer adds (moe_host.py)."""
    moe = routed_spec(spec)
    rows = routed_rows(layout, job, moe)
    a2a = a2a_seconds(spec, layout, job, cluster)
    return {"ep": layout.ep, "edp": edp_size(layout), "expert_imbalance": job.expert_imbalance,
            "tokens_per_expert": rows / (moe.experts // layout.ep),
            "a2a_bytes_per_call": rows * moe.hidden * job.activation_bytes,
            "a2a_s_per_call": a2a,
            "active_params": M.active_param_count(moe), "total_params": M.param_count(moe),
            "host_ops_per_layer": {"forward": host[0], "backward": host[1]},
            "host_s_per_layer": {"forward": host[2], "backward": host[3]}}
