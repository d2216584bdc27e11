"""Compute time of a layer and of the head: FLOPs on a GEMM-shape efficiency curve.

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
"""

from __future__ import annotations

from commpipe.models.spec import ModelSpec, head_flops_per_token, layer_flops_per_token
from commpipe.plan.attention import score_dims
from commpipe.plan.cluster import Cluster
from commpipe.plan.efficiency import Efficiency
from commpipe.plan.kernels import (
    CE_BYTES,
    eager_elementwise_bytes,
    fp8_cast_time,
    fp8_gemm_time,
    hbm_rate,
    layer_gemms,
    ub_margin_gemms,
    ub_sm_slowdown,
)
from commpipe.plan.layout import Job, Layout
from commpipe.plan.memory import layer_activation_bytes
from commpipe.plan.runtime_kernels import commpipe_elementwise_bytes
from commpipe.plan.zero_costs import fsdp_copies

FLASH_BWD_RATIO = 2.5  # flash attention backward / forward matmul work


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
