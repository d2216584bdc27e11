"""Time per action: compute from FLOPs and a GEMM-shape efficiency curve, plus communication.

Compute. Every matmul of a layer is priced on its own shape after TP/CP sharding:
    time = 2*M*K*N / (mamf * eff),   eff = e_max * x / (x + x_half),
    x = arithmetic intensity M*K*N / (M*K + K*N + M*N)   (FLOP per byte, 2-byte operands),
    x_half = ai_half_ridge * (mamf FLOP/s / HBM byte/s)  (the GPU's roofline ridge point),
    mamf = the GPU's maximum achievable matmul FLOP/s, measured (`gpus.py`: 87% of the datasheet
    peak on A100, 80% on H100, 71% for H100 FP8): e_max is a fraction of what the GPU can reach,
    so a value fitted on one GPU carries to another whose clocks throttle more under load.
Since flops / x is the bytes a GEMM moves, this is time = flops/(e_max*peak) + bytes*const:
an additive roofline whose two constants (e_max, ai_half_ridge) are dimensionless and carry
over between GPUs. Backward GEMMs (input and weight gradient) have the same shapes as the
forward, so each costs one forward. Flash attention is priced at the counted (full s x s)
FLOPs on half the work (causal blocks are skipped) at `attn_rel` of e_max (FlashAttention-2,
Dao 2023: ~70% of A100 peak vs ~85% for large GEMMs; on Hopper and newer the fused kernel that
Transformer Engine picks there, cuDNN's, at the same share), its backward at 2.5 forwards (5
matmuls to the forward's 2, the scores recomputed). `Job.attn_kernel` "fa2" (FlashAttention-2,
PyTorch SDPA's default flash backend) caps that rate on GPUs newer than Ampere at the 35% of the
bf16 peak that FlashAttention-2 reaches on an H100 (`attention_rate`); without flash the score
and value products are
batched GEMMs of shape (s/cp, d, s) per head, and their backward costs two forwards.
Non-GEMM work (norms, activations, softmax, dropout, residual adds) is HBM-bound: forward time
= `elementwise` * (bytes the layer stores for backward) / HBM bandwidth, backward twice that.
A fixed `overhead_s` per layer and pass is what a layer costs beyond those terms (the vocabulary
head with its loss counts as one more layer); on GPUs its default is measured (`MEASURED_GPU`).

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

from dataclasses import asdict, dataclass, field

from commpipe.models.family import layer_form
from commpipe.models.spec import ModelSpec, head_flops_per_token, layer_flops_per_token
from commpipe.plan.attention import kv_width, mla, score_dims
from commpipe.plan.cluster import Cluster
from commpipe.plan.kernels import (
    CE_BYTES,
    FP8_CAST_BYTES,
    cp_ring_merge_bytes,
    eager_elementwise_bytes,
    fp8_cast_time,
    fp8_gemm_time,
    hbm_rate,
    layer_gemms,
    nccl_sm_share,
    op_sac_recomputed,
    ub_margin_gemms,
    ub_sm_slowdown,
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
from commpipe.plan.runtime_kernels import commpipe_elementwise_bytes
from commpipe.plan.runtime_ops import HostOps
from commpipe.plan.zero_costs import dp_cost, fsdp_copies, zero_exposed
from commpipe.schedules.registry import info as schedule_info

FLASH_BWD_RATIO = 2.5  # flash attention backward / forward matmul work


@dataclass(frozen=True)
class Efficiency:
    """Calibratable compute-efficiency parameters (see module docstring)."""

    e_max: float = 0.92           # fraction of the GPU's achievable matmul rate (MAMF, gpus.py) a
                                  # large GEMM of the model reaches: 0.8 of the A100's peak, the
                                  # former default, is 0.92 of its MAMF (0.869); at most 1
    ai_half_ridge: float = 0.5    # intensity at half efficiency, in units of the ridge point
    attn_rel: float = 0.8         # flash-attention efficiency relative to e_max
    elementwise: float = 1.0      # HBM bytes of non-GEMM ops per stored activation byte
    overhead_s: float = 20e-6     # per layer and pass (tens of kernel launches at ~1 us)
    coll_overhead_s: float = 0.0  # host time per collective call
    optimizer_overhead_s: float = 0.0   # host time per layer held, per optimizer step
    wake_s: float = 0.0           # per blocking wait per unit of host contention (plan.host)
    fp8_rel: float = 1.0          # FP8 GEMM efficiency relative to e_max (see FP8 below)
    op_s: float = 0.0             # host seconds per eager op of commpipe's own runtime, measured
                                  # (plan.cpu.measure_op_seconds; runtime_ops.py); 0: not priced
    work_s: float = 0.0           # a CPU's seconds of a layer's forward and backward per unit of
                                  # its forward FLOPs, measured on the model's own first layer
                                  # (plan.pass_split.with_measured_pass); 0: the GEMM curve

    def to_dict(self) -> dict:
        return asdict(self)


# The GPU defaults: the four constants `plan --calibrate` fits (calibrate.fit, trust-region least
# squares on log step time) on vTrain's 109 measured iteration times (GPT 3.6B-175B, 64-512 A100,
# Megatron-DeepSpeed, full recompute; MICRO 2024, data/ground_truth_multi.csv), no public run
# among them; in-sample MAPE 16.5% untuned -> 8.6%. Reproduce: benchmarks/plan_public.py prints
# the refit beside these. The GEMM curve reaches half its e_max at 2.74x the ridge intensity, not
# 0.5x: an H100 GEMM of M=4096, K=2048, N=6144 (intensity 4.7x the ridge) runs at 0.63 of MAMF,
# not 0.83 (docs/planner.md, "Validation on public runs"). `overhead_s` (0.67 ms per layer and
# pass) is the measured fixed cost of a layer beyond its GEMM, attention and HBM-bound bytes:
# far more than launching its kernels (microseconds each, issued ahead of the GPU), and added to
# the pass, since a fit that overlaps it with the kernels instead (max of the two) fits vTrain no
# better (8.5% against 8.6%) and only with non-GEMM traffic at 0.29 of the stored bytes.
# The Efficiency() field values stay the untuned starting point of every fit, and the default
# of a CPU (`--gpu cpu`), whose rates are measured on the machine and whose host terms are
# fitted on its own runs (commpipe.plan.host).
MEASURED_GPU = Efficiency(e_max=0.9912, ai_half_ridge=2.742, elementwise=1.160, overhead_s=674.9e-6)


def default_efficiency(gpu) -> Efficiency:
    """The Efficiency `plan` and `estimate` use without a --profile: MEASURED_GPU on GPUs; on a
    CPU the untuned Efficiency() with its host terms measured instead of the 20 us per layer
    pass: each pass's eager ops at this host's measured time per op (runtime_ops.py). Where the
    model is known (`plan`, `estimate`, and `estimate()`/`search()` called without an
    Efficiency), plan.pass_split.with_measured_pass then measures a CPU pass on the model's own
    first layer: its time per op and per unit of work replace the micro-benchmark's op time and
    the GEMM curve."""
    if gpu.name != "cpu":
        return MEASURED_GPU
    from commpipe.plan.cpu import host_op_seconds

    return Efficiency(overhead_s=0.0, op_s=host_op_seconds())


# "FlashAttention-2 achieving only 35% utilization on the H100 GPU" (Shah et al. 2024,
# FlashAttention-3, arXiv:2407.08608, abstract; FlashAttention-3 is 1.5-2.0x faster there): its
# kernels are written for Ampere's instructions, without Hopper's asynchronous tensor cores (wgmma)
# and copy engine (TMA). A share of the datasheet bf16 peak; Blackwell assumed no better.
FA2_NEWER_GPU_UTILIZATION = 0.35


def attention_rate(job, gpu, eff: Efficiency) -> float:
    """FLOP/s flash attention's matmuls run at: `attn_rel` of a large GEMM's rate; under
    FlashAttention-2 (`job.attn_kernel == "fa2"`) on a GPU newer than Ampere (one with FP8 tensor
    cores) at most FA2_NEWER_GPU_UTILIZATION of its bf16 peak."""
    rate = gpu.achievable_tflops("bf16") * 1e12 * eff.e_max * eff.attn_rel
    if job.attn_kernel == "fa2" and gpu.fp8_tflops > 0:
        rate = min(rate, FA2_NEWER_GPU_UTILIZATION * gpu.tflops * 1e12)
    return rate


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


def gemm_time(flops: float, m: float, k: float, n: float, peak: float, eff: Efficiency,
              ridge: float) -> float:
    if flops <= 0:      # an empty GEMM: a MoE layer's dense MLP of width 0 (plan/moe.py)
        return 0.0
    ai = m * k * n / (m * k + k * n + m * n)
    x_half = eff.ai_half_ridge * ridge
    return flops / (peak * eff.e_max * ai / (ai + x_half))


def layer_compute(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
                  eff: Efficiency) -> dict[str, float]:
    """Seconds of one layer for one micro-batch: 'gemm' (the weight matmuls of a pass: the
    backward's input- and weight-gradient GEMMs have the forward's shapes), 'gemm_f' (the
    forward's as run: under TE's userbuffers overlap two of them lose SMs), 'attn' (scores and
    values), 'elem' (HBM-bound ops)."""
    gpu = cluster.gpu
    if measured_pass(eff, job, gpu):
        # everything of a pass that grows with the micro-batch, at the rate measured on the
        # model's first layer: forward a third, the two backward GEMM sets a third each
        work = layer_flops_per_token(spec, job.seq_len) * layout.micro_batch_size * job.seq_len
        third = work * eff.work_s / (layout.tp * layout.cp) / 3
        return {"gemm": third, "gemm_f": third, "attn": 0.0, "elem": 0.0, "elem_b": 0.0,
                "copy_f": 0.0, "copy_b": 0.0}
    peak, ridge = gpu.achievable_tflops("bf16") * 1e12, gpu.ridge_flop_per_byte
    t, s = layout.tp, job.seq_len
    nh, qk, v = score_dims(spec)        # grouped-query: qk = v = head_dim (plan/attention.py)
    # torchtitan's eager Llama and commpipe's own on a GPU run one GEMM per matrix;
    # Megatron/TE fuse QKV and gate/up
    own = own_runtime_on_gpu(job, gpu)
    shapes = layer_gemms(spec, layout, job, fused=fused_gemms(job, gpu))
    cast = 0.0
    gemm = gemm_f = gemms_time(shapes, job, gpu, eff)
    if job.tp_overlap and t > 1 and len(shapes) == 4:
        # TE userbuffers: the reduce-scatter's GEMMs run under an SM margin (kernels.py)
        margin = gemms_time(ub_margin_gemms(shapes), job, gpu, eff)
        gemm_f = gemm + margin * (ub_sm_slowdown(gpu.sms) - 1)
    if job.precision == "fp8":
        cast = fp8_cast_time(spec, layout, job, gpu)
    heads = layout.micro_batch_size * nh / t
    q_len = s / layout.cp
    attn_flops = 2 * q_len * s * (qk + v) * heads       # QK^T and AV, full s x s (Megatron count)
    if job.uses_flash(spec):
        attn = 0.5 * attn_flops / attention_rate(job, gpu, eff)
    elif qk == v:
        attn = 2 * heads * gemm_time(2 * q_len * qk * s, q_len, qk, s, peak, eff, ridge)
    else:
        attn = heads * (gemm_time(2 * q_len * qk * s, q_len, qk, s, peak, eff, ridge)
                        + gemm_time(2 * q_len * s * v, q_len, s, v, peak, eff, ridge))
    hbm = hbm_rate(gpu)
    eager = eager_elementwise_bytes(spec, layout, job) if job.eager_ops else None
    if own:     # commpipe's eager kernels, counted op by op (runtime_kernels.py)
        moved = commpipe_elementwise_bytes(spec, layout, job)
        elem, elem_b = moved[0] / hbm, moved[1] / hbm
    elif eager:
        # counted kernel by kernel (kernels.py), no fitted factor
        elem, elem_b = eager[0] / hbm, eager[1] / hbm
    else:
        elem = eff.elementwise * layer_activation_bytes(spec, layout, job, recompute="none") / hbm
        elem_b = 2 * elem
    copy_f, copy_b = fsdp_copies(spec, layout, job, hbm)
    return {"gemm": gemm, "gemm_f": gemm_f, "attn": attn, "elem": elem + cast,
            "elem_b": elem_b + 2 * cast, "copy_f": copy_f, "copy_b": copy_b}


def measured_pass(eff: Efficiency, job: Job, gpu) -> bool:
    """A CPU pass of commpipe's runtime priced at its measured rate (`Efficiency.work_s`)."""
    return eff.work_s > 0 and job.runtime == "commpipe" and gpu.name == "cpu"


def own_runtime_on_gpu(job: Job, gpu) -> bool:
    """commpipe's own eager runtime on a GPU, priced op by op (runtime_kernels.py); on a CPU its
    rates are measured on its own runs."""
    return job.runtime == "commpipe" and gpu.name != "cpu"


def fused_gemms(job: Job, gpu) -> bool:
    """QKV and gate/up as one GEMM each (Megatron/TE), or one per matrix: torchtitan's eager
    Llama, and commpipe's own on a GPU."""
    return not (job.eager_ops or own_runtime_on_gpu(job, gpu))


def gemms_time(shapes: list[tuple], job: Job, gpu, eff: Efficiency, fp8: bool | None = None) -> float:
    """Seconds of a list of (M, K, N) weight GEMMs, in FP8 under --precision fp8 (`fp8` False:
    in bf16 whatever the precision, as a MoE router runs)."""
    if job.precision == "fp8" if fp8 is None else fp8:
        return sum(fp8_gemm_time(m, k, n, gpu, eff) for m, k, n in shapes)
    peak, ridge = gpu.achievable_tflops("bf16") * 1e12, gpu.ridge_flop_per_byte
    return sum(gemm_time(2 * m * k * n, m, k, n, peak, eff, ridge) for m, k, n in shapes)


def head_compute(spec: ModelSpec, layout: Layout, job: Job, cluster: Cluster,
                 eff: Efficiency) -> tuple[float, float, float]:
    """Forward seconds of the vocabulary-head GEMM, then of the cross-entropy forward and
    backward, one micro-batch."""
    gpu = cluster.gpu
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    v = spec.vocab / layout.tp
    if measured_pass(eff, job, gpu):
        g = head_flops_per_token(spec) * tokens / layout.tp * eff.work_s / 3
    else:
        g = gemm_time(2 * tokens * spec.hidden * v, tokens, spec.hidden, v,
                      gpu.achievable_tflops("bf16") * 1e12, eff, gpu.ridge_flop_per_byte)
    # loss: HBM bytes per logit of the job's loss kernels (kernels.CE_BYTES)
    per_f, per_b = CE_BYTES[job.ce_kernel]
    return g, per_f * tokens * v / hbm_rate(gpu), per_b * tokens * v / hbm_rate(gpu)


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
