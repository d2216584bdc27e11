"""Time per action: the stage costs of a layout, compute (commpipe.plan.compute) plus
communication.

Communication (priced by `cluster.Cluster`, groups placed by rank order tp, cp, dp, pp):
- TP: per layer 2 collectives in forward and 2 in backward (all-reduce, or with sequence
  parallelism reduce-scatter + all-gather, the same bus traffic), 2 more when full recompute
  replays the forward; of [b*s/cp, h] bf16 activations. Not overlapped (Megatron default).
- CP (ring attention): K and V chunks circulate over cp-1 steps in forward, K,V and their
  gradients in backward; each step overlaps the attention on the previous chunk, so only
  (cp-1) * max(0, step transfer - step attention) is exposed.
- PP: the stage output [b*s/cp, h]/tp (SP-sharded, or Megatron's scatter-gather) per
  micro-batch per boundary, on the link the two stage ranks share; timed by the simulator.
- DP: gradients of the rank's parameters all-reduced over the dp*cp group (ZeRO-1: reduce-
  scatter of gradients + all-gather of weights, the same traffic); overlapped with the last
  micro-batch's backward when `job.dp_overlap`.
- Optimizer: HBM-bound Adam, 28 bytes touched per (sharded) parameter in bf16 mixed
  precision (read+write fp32 master, m, v; read grad; write bf16 weight), 24 in fp32.

Host terms, zero by default (GPU kernels are launched asynchronously and hide them), measured or
fitted for a CPU or a launch-bound runtime: `op_s` per eager op commpipe's own runtime dispatches
(counted per pass and per optimizer step in runtime_ops.py, the time per op measured on the
planning host by plan.cpu; on a CPU added to the pass, on a GPU the pass takes the larger of its
device and host times, in place of `overhead_s`), `coll_overhead_s` per collective call (gloo hands every call
to a worker thread), `optimizer_overhead_s` per layer a rank holds, per step (an unfused
optimizer loops over tensors), `wake_s` per blocking wait and per busy rank beyond the cores
(commpipe.plan.host). Activations travel as bf16 under mixed precision and fp32 otherwise.
The job names what the runtime sends (`Job.cp_comm`, `pp_sharded`, `sequence_parallel`,
`step_syncs`): with sequence parallelism the embedding ends in a reduce-scatter and the head
starts with an all-gather; without it, an all-reduce forward and one backward. The vocabulary-
parallel cross-entropy all-reduces 3 per-token fp32 values (max, target logit, sum of
exponentials; Megatron-LM's vocab_parallel_cross_entropy) when tp > 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commpipe.models.family import layer_form
from commpipe.models.spec import ModelSpec
from commpipe.plan.attention import kv_width, mla
from commpipe.plan.cluster import Cluster
from commpipe.plan.compute import FLASH_BWD_RATIO, fused_gemms, gemms_time, head_compute, layer_compute
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.kernels import (
    FP8_CAST_BYTES,
    cp_ring_merge_bytes,
    hbm_rate,
    layer_gemms,
    nccl_sm_share,
    op_sac_recomputed,
)
from commpipe.plan.layout import Job, Layout, zero_stage
from commpipe.plan.memory import (
    layer_activation_bytes,
    linear_params_per_layer,
    rank_chunks,
    stage_layer_counts,
    stage_params,
)
from commpipe.plan.moe_costs import add_routed_costs, expert_optimizer_seconds, expert_reduction
from commpipe.plan.runtime_ops import HostOps
from commpipe.plan.zero_costs import dp_cost, zero_exposed
from commpipe.schedules.registry import info as schedule_info


@dataclass
class StageCosts:
    """Per virtual stage (chunk) and micro-batch, seconds. f = comp_f + tp_f + cp_f,
    i = comp_i + tp_b + cp_b, w = comp_w, b = i + w (communication exposed, not overlapped).
    host_f / host_i: the part of tp_f + cp_f / tp_b + cp_b that keeps the host CPU busy (the
    collectives' call overheads); the rest is waiting, during which a CPU rank sleeps."""

    comp_f: list[float]
    comp_i: list[float]
    comp_w: list[float]
    tp_f: list[float]
    tp_b: list[float]
    cp_f: list[float]
    cp_b: list[float]
    p2p_bytes: float                        # per micro-batch per stage boundary
    pp_stride: int                          # global-rank distance between neighbouring stages
    dp_exposed: list[float] = field(default_factory=list)   # per pipeline rank, per step
    dp_total: list[float] = field(default_factory=list)
    dp_sm: list[float] = field(default_factory=list)   # compute lost to the hidden DP's NCCL SMs
    optimizer: list[float] = field(default_factory=list)
    step_sync: list[float] = field(default_factory=list)    # scalar all-reduces (Job.step_syncs)
    host_f: list[float] = field(default_factory=list)
    host_i: list[float] = field(default_factory=list)
    embedding_sync: float = 0.0
    zero_f: list[float] = field(default_factory=list)   # exposed ZeRO-3 parameter all-gathers
    zero_b: list[float] = field(default_factory=list)   # ... and ZeRO-2/3 gradient reduce-scatters
    ep_f: list[float] = field(default_factory=list)     # exposed EP all-to-alls (moe_costs.py)
    ep_b: list[float] = field(default_factory=list)
    moe_host: tuple = (0, 0, 0.0, 0.0)  # a MoE layer's host operations and seconds beyond a dense
    #                                     MLP's, forward and backward (moe_host.moe_host)

    @property
    def f(self) -> list[float]:
        z = self.zero_f or [0.0] * len(self.comp_f)
        e = self.ep_f or [0.0] * len(self.comp_f)
        return [a + b + c + d + x for a, b, c, d, x in zip(self.comp_f, self.tp_f, self.cp_f, z, e)]

    @property
    def i(self) -> list[float]:
        z = self.zero_b or [0.0] * len(self.comp_i)
        e = self.ep_b or [0.0] * len(self.comp_i)
        return [a + b + c + d + x for a, b, c, d, x in zip(self.comp_i, self.tp_b, self.cp_b, z, e)]

    @property
    def w(self) -> list[float]:
        return list(self.comp_w)

    @property
    def b(self) -> list[float]:
        return [x + y for x, y in zip(self.i, self.w)]


def _group_strides(layout: Layout) -> dict[str, tuple[int, int]]:
    """(size, stride) of each group in the rank order tp (innermost), cp, dp, pp."""
    t, c, d = layout.tp, layout.cp, layout.dp
    return {"tp": (t, 1), "cp": (c, t), "dp_cp": (c * d, t), "pp": (layout.pp, t * c * d)}


def stage_costs(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
                eff: Efficiency) -> StageCosts:
    stages = layout.pp * layout.vpp
    counts = stage_layer_counts(spec.layers, stages)
    groups = _group_strides(layout)
    t, s, h = layout.tp, job.seq_len, spec.hidden
    tokens = layout.micro_batch_size * s / layout.cp
    act_bytes = job.activation_bytes * tokens * h                   # [b, s/cp, h]
    lc = layer_compute(spec, layout, job, cluster, eff)
    host = HostOps(job, cluster.gpu, eff, layout.tp, layout.cp)
    comp_f = host.forward(lc["gemm_f"] + lc["attn"] + lc["elem"] + lc["copy_f"] + host.fixed)
    tp_size = groups["tp"][0]
    call = eff.coll_overhead_s
    # TP, per layer and pass: two all-reduces' traffic (RS+AG with SP moves the same bytes in the
    # same latency steps), made as 2 all-reduces, or with SP as 2 all-gathers and 2
    # reduce-scatters: 4 calls, each paying the per-call host time
    tp_calls = (4 if job.sequence_parallel else 2) if tp_size > 1 else 0
    tp_one = cluster.all_reduce(act_bytes, *groups["tp"])
    tp_f = tp_b = 2 * tp_one + tp_calls * call
    if job.tp_overlap and tp_size > 1:
        # TE's userbuffers (Megatron --tp-comm-overlap): each all-gather / reduce-scatter is split
        # into chunks pipelined with the GEMM it feeds or follows, so only the part longer than
        # the layer's GEMMs of that pass shows (forward: QKV, proj, fc1, fc2; backward: their
        # input-gradient GEMMs, the same shapes)
        tp_f = tp_b = max(0.0, tp_f - lc["gemm"])
    elif job.tp_grad_overlap and tp_size > 1 and not schedule_info(layout.schedule).splits_backward \
            and not mla(spec):      # commpipe's runtime, which runs no MLA under TP
        # each entry's backward collective (AR, or SP's RS: half the layer's backward traffic)
        # travels while the weight-gradient GEMMs of the projections it feeds run: QKV for the
        # attention, gate and up for the MLP (dW has the forward GEMM's shape and FLOPs)
        entry = (tp_one if not job.sequence_parallel else tp_one / 2) + call
        shapes = layer_gemms(spec, layout, job, fused=fused_gemms(job, cluster.gpu))
        fed = (shapes[:1], shapes[2:3]) if len(shapes) == 4 else (shapes[:3], shapes[4:6])
        tp_b -= sum(min(entry, gemms_time(g, job, cluster.gpu, eff)) for g in fed)
    cp_size, cp_stride = groups["cp"]
    cp_f = cp_b = merge_b = 0.0
    kv_bytes = job.activation_bytes * tokens * kv_width(spec) / t   # this rank's K (or V)
    if cp_size > 1 and job.cp_comm == "ring":
        # ring attention: K,V chunk [b, s/cp, 2*kv/tp] per step, overlapped with attention
        bw, link = cluster.bus_bandwidth(cp_size, cp_stride)
        step = 2 * kv_bytes / bw + link.latency_s + call
        cp_f = (cp_size - 1) * max(step - lc["attn"] / cp_size, 0.0)
        cp_b = (cp_size - 1) * max(2 * step - 2 * lc["attn"] / cp_size, 0.0)
        # the per-step merges of partial outputs and gradients (kernels.py), HBM-bound compute
        hbm = hbm_rate(cluster.gpu)
        merge_f, merge_b = (x / hbm for x in cp_ring_merge_bytes(spec, layout, job))
        comp_f += merge_f
    elif cp_size > 1:
        # all-gather K and V before attention, reduce-scatter their gradients after: exposed
        cp_f = 2 * (cluster.all_gather(cp_size * kv_bytes, cp_size, cp_stride) + call)
        cp_b = 2 * (cluster.reduce_scatter(cp_size * kv_bytes, cp_size, cp_stride) + call)
        if job.cp_overlap:      # attention over the rank's own chunk (1/cp of it) runs meanwhile
            cp_f = max(0.0, cp_f - lc["attn"] / cp_size)
    # recompute replays part of the forward inside the backward
    if layout.recompute == "full":
        re_comp, re_tp, re_cp = comp_f, tp_f, cp_f
    elif layout.recompute == "selective":
        full = layer_activation_bytes(spec, layout, job, recompute="none")
        kept = layer_activation_bytes(spec, layout, job, recompute="selective")
        dropped = (full - kept) / full if full else 0.0
        re_comp = lc["elem"] * dropped + (0.0 if job.uses_flash(spec) else lc["attn"])
        re_tp = re_cp = 0.0
    elif layout.recompute == "op":
        # torchtitan's per-op SAC (kernels.py): every other matmul and every non-GEMM op run
        # again; attention is saved. The replayed GEMMs' TP collectives are charged in full.
        re_comp = gemms_time(op_sac_recomputed(spec, layout, job), job, cluster.gpu, eff) + lc["elem"]
        re_tp, re_cp = tp_f, 0.0
    else:
        re_comp = re_tp = re_cp = 0.0
    # flash attention's backward recomputes the scores and runs 5 matmuls to the forward's 2
    # (Dao 2023, FlashAttention-2, Algorithm 2): 2.5 forwards; materialised scores: 2
    attn_b = FLASH_BWD_RATIO if job.uses_flash(spec) else 2.0
    layer_i = host.backward(lc["gemm"] + attn_b * lc["attn"] + lc["elem_b"] + lc["copy_b"] + merge_b
                            + host.fixed + re_comp, lc["gemm"])
    head_gemm, loss, loss_b = head_compute(spec, layout, job, cluster, eff)
    head_f, head_b, embed_tp = _head_and_embedding_tp(spec, layout, job, cluster, act_bytes, call)
    # collective calls per layer and pass (host CPU time = calls * coll_overhead_s)
    layer_calls = tp_calls + (2 if cp_size > 1 and job.cp_comm == "allgather" else 0)
    head_calls_f = (3 + job.sequence_parallel) if tp_size > 1 else 0
    head_calls_b = 1 if tp_size > 1 else 0
    re_calls = layer_calls if layout.recompute == "full" else 0
    p2p_bytes = act_bytes / t if job.pp_sharded else act_bytes
    out = StageCosts([], [], [], [], [], [], [], p2p_bytes, groups["pp"][1])
    for st in range(stages):
        n = counts[st]
        cf, ci, cw = n * comp_f, n * layer_i, n * lc["gemm"]
        tf, tb = n * tp_f, n * (tp_b + re_tp)
        hf, hb = n * layer_calls * call, n * (layer_calls + re_calls) * call
        if st == 0:
            tf += embed_tp
            hf += call if tp_size > 1 else 0.0
        if st == stages - 1:
            # the head, its loss and (in the count of ops) the embedding's: runtime_ops.py
            cf += host.forward(head_gemm + loss + host.fixed, outer=True)
            ci += host.backward(head_gemm + loss_b + host.fixed, head_gemm, outer=True)
            cw += head_gemm
            tf += head_f
            tb += head_b
            hf += head_calls_f * call
            hb += head_calls_b * call
        out.host_f.append(hf)
        out.host_i.append(hb)
        # per-layer ZeRO traffic: exposed, and the SMs its NCCL kernels take from the compute
        zf, zb, sm_f, sm_b = zero_exposed(spec, layout, job, cluster, n, comp_f, layer_i + lc["gemm"])
        out.comp_f.append(cf + sm_f)
        out.comp_i.append(ci + sm_b)
        out.comp_w.append(cw)
        out.tp_f.append(tf)
        out.tp_b.append(tb)
        out.cp_f.append(n * cp_f)
        out.cp_b.append(n * (cp_b + re_cp))
        out.zero_f.append(zf)
        out.zero_b.append(zb)
    # a MoE decoder's MLPs and all-to-alls (its layers above were priced with ffn_hidden = 0)
    add_routed_costs(spec, layout, job, cluster, eff, out, fused_gemms(job, cluster.gpu))
    _dp_and_optimizer(spec, layout, job, cluster, out, groups, eff)
    return out


def _head_and_embedding_tp(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
                           act_bytes: float, call: float) -> tuple[float, float, float]:
    """Exposed TP time of the head (forward, backward) and of the embedding (forward)."""
    size, stride = layout.tp, 1
    if size == 1:
        return 0.0, 0.0, 0.0
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    # vocabulary-parallel cross-entropy: 3 all-reduces of one fp32 value per token
    ce = 3 * (cluster.all_reduce(4 * tokens, size, stride) + call)
    if job.sequence_parallel:
        gather = cluster.all_gather(act_bytes, size, stride) + call     # head input (SP)
        return gather + ce, gather, cluster.reduce_scatter(act_bytes, size, stride) + call
    ar = cluster.all_reduce(act_bytes, size, stride) + call
    return ce, ar, ar          # head: copy forward, all-reduce of its input gradient backward


def _dp_and_optimizer(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
                      costs: StageCosts, groups: dict, eff: Efficiency) -> None:
    grad_b = 2 if job.mixed and not job.grad_fp32 else 4
    z = zero_stage(layout, job)
    group, stride = groups["dp_cp"]
    shard = layout.shard_size if z >= 1 else 1
    bytes_per_param_opt = 28 if job.mixed else 24
    hbm = hbm_rate(cluster.gpu)
    stages = layout.pp * layout.vpp
    chunks = rank_chunks(layout.schedule, layout.pp, layout.vpp)
    call = eff.coll_overhead_s
    lin = linear_params_per_layer(spec, layout.tp)
    sync = _step_sync(job, cluster, groups, call)
    prices: dict = {}
    f, b = costs.f, costs.b
    for rank, (layers, params) in enumerate(stage_params(spec, layout, job)):
        # a MoE rank's expert gradients reduce over edp, beside the rest over dp*cp
        total, exposed = dp_cost(spec, layout, job, cluster, f, b, groups, eff, chunks[rank], layers,
                                 params, prices, expert_reduction(spec, layout, groups, rank))
        costs.dp_total.append(total)
        costs.dp_exposed.append(exposed)
        # the hidden part runs beside the backward (forward) it overlaps, on fewer SMs (kernels.py)
        costs.dp_sm.append(nccl_sm_share(cluster, *groups["dp_cp"]) * max(0.0, total - exposed))
        # the embedding and the head (with the final norm) count as one layer each
        held = layers + (0 in chunks[rank]) + (stages - 1 in chunks[rank])
        opt = params / shard * bytes_per_param_opt / hbm + held * eff.optimizer_overhead_s
        opt += HostOps(job, cluster.gpu, eff).step(layers, 0 in chunks[rank], stages - 1 in chunks[rank])
        if job.precision == "fp8":
            # the new weights cast to FP8 and transposed once per step (read 2, write 1 + 1)
            opt += layers * lin / shard * FP8_CAST_BYTES / hbm
        costs.optimizer.append(opt + expert_optimizer_seconds(spec, layout, job, cluster, rank, z))
        costs.step_sync.append(sync)
    if layer_form(spec).tied_head and layout.pp > 1:
        # tied embedding: first and last stage all-reduce the word-embedding gradient
        pp_size, pp_stride = groups["pp"]
        last = (pp_size - 1) * pp_stride
        costs.embedding_sync = 2 * cluster.p2p(spec.vocab * spec.hidden / layout.tp * grad_b, 0, last)


def _step_sync(job: Job, cluster: Cluster, groups: dict, call: float) -> float:
    """The step's scalar all-reduces: gradient norm over TP and PP, loss over DP*CP and PP."""
    if not job.step_syncs:
        return 0.0
    total = 0.0
    for name in ("tp", "pp", "dp_cp", "pp"):
        size, stride = groups[name]
        if size > 1:
            total += cluster.all_reduce(8, size, stride) + call
    return total
