"""What a framework's kernels move and recompute, beyond the GEMM FLOPs (compute.py, timing.py,
memory.py).

Three things that differ between Megatron-LM/Transformer Engine (the planner's defaults) and
torchtitan, each counted from the framework's code, none fitted:

- **Eager non-GEMM ops** (`Job.eager_ops`): without torch.compile every elementwise op is its own
  kernel and a round trip through HBM. Counted op by op for torchtitan's Llama
  (github.com/pytorch/torchtitan@0413364 torchtitan/models/llama/model.py, the commit of its
  published A100 numbers, with `norm_type = "fused_rmsnorm"` and `compile = false` in its
  train_configs), bytes per token of one layer's forward, bf16 activations:
      2 fused RMSNorms (read x, write y)                           2 * 4h
      RoPE on q and k: .float() (r 2, w 4), complex multiply (r 4,
      w 4), .type_as (r 4, w 2)                                     20 (h + kv)
      repeat_kv for K and V when kv < h (expand + reshape copies)   2 * (2 kv + 2 h)
      attention output .transpose().contiguous()                   4h
      SwiGLU: silu(w1 x) (r 2f, w 2f), * w3 x (r 4f, w 2f)          10f
      2 residual adds (r 4h, w 2h)                                  12h
  The backward reads each op's saved inputs and output gradient and writes input gradients, about
  twice the forward's bytes (the rule compute.py uses for fused kernels), plus autograd's gradient
  accumulation where a tensor feeds several ops: the norm outputs feed 3 (wq, wk, wv) and 2 (w1, w3)
  linears, the residual stream x and h feed the add and the norm: 5 adds of [T, h] (r 4h, w 2h).
  Other architectures keep the fused-kernel pricing.
- **FSDP2's copies** (`Job.fsdp_copies`, ZeRO-3 without a pipeline): PyTorch FSDP2
  (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) all-gathers into one flat buffer and
  copies every parameter out of it (`foreach_all_gather_copy_out`, split_with_sizes_copy) on the
  compute stream, before the forward and, with reshard_after_forward, again before the backward;
  after the backward it copies the unsharded gradients into the reduce-scatter buffer in the reduce
  dtype (`foreach_reduce_scatter_copy_in`, chunk_cat) on the compute stream too. Per layer and
  micro-batch: forward 2 x the gathered weight bytes (read + write), backward the same plus the
  gradients read in bf16 and written in the reduce dtype.
- **Per-op selective activation checkpointing** (`Layout.recompute == "op"`, torchtitan's
  `selective_ac_option = 'op'`, torchtitan/parallelisms/parallelize_llama.py at the same commit):
  the policy saves the outputs of flash attention and of every other matmul of a block (the 1st,
  3rd, 5th, ... `aten.mm` in forward order) and recomputes everything else in the backward. For
  Llama the matmuls run wq, wk, wv, wo, w1, w3, w2: wq, wv, w1, w2 are saved, wk, wo, w3 and every
  non-GEMM op are recomputed. The block's input is kept by the checkpoint.
"""

from __future__ import annotations

from commpipe.models.family import layer_form
from commpipe.models.spec import ModelSpec
from commpipe.plan.attention import kv_width, mla, mla_gemms, score_dims
from commpipe.plan.layout import Job, Layout

HBM_EFFICIENCY = 0.8   # STREAM-like kernels reach ~80-90% of datasheet HBM bandwidth (compute.py)


def hbm_rate(gpu) -> float:
    """Bytes/s an HBM-bound kernel reaches on `gpu`: HBM_EFFICIENCY of the datasheet bandwidth."""
    return gpu.hbm_gbps * 1e9 * HBM_EFFICIENCY


def layer_gemms(spec: ModelSpec, layout: Layout, job: Job, fused: bool = True) -> list[tuple]:
    """(M, K, N) of one layer's weight GEMMs after TP/CP sharding, in forward order. `fused`:
    QKV as one GEMM and the SwiGLU gate and up as one (Megatron/TE); else one per matrix, as
    torchtitan's Llama runs them (wq, wk, wv, wo, w1, w3, w2). Multi-head latent attention:
    its own five or six GEMMs (commpipe.plan.attention), then the MLP's."""
    t, h = layout.tp, spec.hidden
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    kv, f = spec.kv_dim, spec.ffn_hidden
    q = spec.q_width                     # h, unless a MoE shape sets head_dim apart from it
    if mla(spec):
        return mla_gemms(spec, tokens, t) + [(tokens, h, 2 * f / t), (tokens, f / t, h)]
    if not layer_form(spec).gated_mlp:
        return [(tokens, h, (q + 2 * kv) / t), (tokens, q / t, h), (tokens, h, f / t), (tokens, f / t, h)]
    if fused:
        return [(tokens, h, (q + 2 * kv) / t), (tokens, q / t, h), (tokens, h, 2 * f / t), (tokens, f / t, h)]
    return [(tokens, h, q / t), (tokens, h, kv / t), (tokens, h, kv / t), (tokens, q / t, h),
            (tokens, h, f / t), (tokens, h, f / t), (tokens, f / t, h)]


# TE's userbuffers overlap (Megatron --tp-comm-overlap; the defaults of TE's initialize_ub in
# transformer_engine/pytorch/module/base.py, which NVIDIA's H100 configs keep for these GEMMs,
# e.g. NeMo-Framework-Launcher@24.07 launcher_scripts/conf/training/tp_overlap/): the
# reduce-scatter after a row-parallel forward GEMM (attention projection, fc2) is "pipelined",
# its communication kernels holding UB_COMM_SMS of the GPU's SMs while the GEMM runs on the rest
# (set_sm_margin), so those two GEMMs take sms / (sms - 16) of their time. The GEMMs also run in
# chunks (4 for these, tp for the ring-exchanged all-gathers): not priced, since the efficiency
# curve, fitted on whole GEMMs of whole steps, would extrapolate to the chunks' shapes (it made the
# NVIDIA rows 5-10 points more pessimistic). The backward's bulk overlaps (set_sm_margin 0 in
# NVIDIA's configs) keep their GEMMs on every SM.
UB_COMM_SMS = 16


def ub_margin_gemms(shapes: list[tuple]) -> list[tuple]:
    """The GEMMs of a fused layer (QKV, projection, fc1, fc2) that TE's userbuffers run under an
    SM margin: the row-parallel projection and fc2, in the forward."""
    return [shapes[1], shapes[3]]


def ub_sm_slowdown(sms: int) -> float:
    """Time factor of a GEMM launched on `sms` - UB_COMM_SMS SMs; 1 when the SM count is unknown."""
    return sms / (sms - UB_COMM_SMS) if sms > UB_COMM_SMS else 1.0


# NCCL's collectives overlapped with computation (Megatron's --overlap-grad-reduce and
# --overlap-param-gather, FSDP's prefetched all-gathers and reduce-scatters on their own streams)
# run as one CUDA block per channel (github.com/NVIDIA/nccl src/enqueue.cc: the kernel's grid is
# the plan's channel count), each block of up to 512 threads (NCCL_SIMPLE_MAX_NTHREADS,
# src/include/device.h) holding its SM, polling the network, for the collective's whole
# duration; a GEMM's blocks, each needing most of an SM's registers and shared memory, do not fit
# beside it, so the computation it hides behind runs on sms - channels SMs meanwhile. The
# channels of a ring, as NCCL's topology search and connection derive them for nodes with one
# NIC per GPU (src/graph/search.cc, connect.cc; the same since NCCL 2.18.3, 2023):
#   - across nodes: one search channel per NIC the group drives on a node, at the fastest ring
#     speed the NIC carries (sm90SpeedArrayInter: 48 GB/s for a 400 Gb/s NIC, 24 for 200 Gb/s);
#     ncclTopoDupChannels doubles them unless they run below 25 GB/s, or, on GPUs newer than
#     sm_80, more than 4 of them run below 50 GB/s; connectRings doubles them again. A DGX H100
#     DP group with 8 ranks per node: 8 -> 16; with 1 (tp 8): 1 -> 2 -> 4; DGX A100 (200 Gb/s):
#     8 -> 16.
#   - inside one node (NVLink rings): six search channels at 60 (H100) or 40 (A100) GB/s fill
#     the GPU's NVLink, doubled twice: 24.
# NCCL's default on Hopper caps them at 32 CTAs (max_ctas; Megatron-LM
# megatron/core/parallel_state.py). The collective's HBM traffic (a reduce-scatter reads two
# operands and writes one per element) is a few percent of the bandwidth beside compute-bound
# GEMMs: not priced.
NCCL_INTRA_CHANNELS = 24
NCCL_MAX_CTAS = 32
RING_SPEEDS = (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0)


def nccl_channels(cluster, size: int, stride: int) -> int:
    """Channels (CUDA blocks) of NCCL's ring collective over the group {0, stride, ...,
    (size-1)*stride} of `cluster` (comment above); 0 for a group of one."""
    if size <= 1:
        return 0
    inside, per_node = cluster.placement(size, stride)
    if inside:
        return NCCL_INTRA_CHANNELS
    nics = per_node if cluster.nics_per_node is None else min(per_node, cluster.nics_per_node)
    speed = max((v for v in RING_SPEEDS if v <= cluster.gpu.nic_gbps), default=RING_SPEEDS[-1])
    newer_than_sm80 = cluster.gpu.fp8_tflops > 0       # FP8 tensor cores: sm_89 and later
    dup = speed >= 25.0 and not (newer_than_sm80 and speed < 50.0 and nics > 4)
    return min(NCCL_MAX_CTAS, nics * (2 if dup else 1) * 2)


def nccl_sm_share(cluster, size: int, stride: int) -> float:
    """Share of each GPU's SMs an overlapped NCCL collective over the group holds while it runs
    (comment above): the computation it hides behind loses that share of its rate for the
    collective's hidden duration. 0 when the SM count is unknown (a CPU, whose collectives run
    on host threads)."""
    sms = cluster.gpu.sms
    ch = nccl_channels(cluster, size, stride)
    return ch / sms if sms > ch else 0.0


# Ring attention as Transformer Engine runs it (AttnFuncWithCPAndKVP2P; load-balanced causal
# split, every rank holding two of 2*cp sequence chunks): step i runs flash attention of the rank's
# queries against the K/V received i steps earlier, and the forward then merges each step's partial
# output into the result with its log-sum-exp correction (flash_attn_fwd_out_correction: read the
# step's output and the running output, write it back, 6 bytes per bf16 element); the backward
# adds each step's query gradient and K/V gradient into their accumulators the same way. The rank
# holding the last chunks merges whole outputs on all cp steps (the others on fewer), and the
# ring's exchanges keep the ranks in step: cp full merges per layer and pass. The all-gather form
# (Llama 3's, commpipe's runtime) runs one attention call over the gathered K/V: no merges.
def cp_ring_merge_bytes(spec: ModelSpec, layout: Layout, job: Job) -> tuple[float, float]:
    """(forward, backward) HBM bytes per layer and micro-batch of ring attention's per-step merges
    (comment above); 0 without CP or with the all-gather form."""
    cp = layout.cp
    if cp == 1 or job.cp_comm != "ring":
        return 0.0, 0.0
    tokens = layout.micro_batch_size * job.seq_len / cp
    heads, qk, v = score_dims(spec)
    out_elems = tokens * heads * v / layout.tp          # the attention output (and its gradient)
    q_elems = tokens * heads * qk / layout.tp
    kv_elems = 2 * tokens * kv_width(spec) / layout.tp
    return 6 * cp * out_elems, 6 * cp * (q_elems + kv_elems)


# The vocabulary head's cross-entropy, HBM bytes per logit (forward, backward) of the kernels that
# run it. "fused": one pass that reads the bf16 logits and writes, then re-reads, an fp32 softmax
# (about 10 bytes per logit each way; the planner's rule for fused loss kernels). "megatron-unfused":
# Megatron-LM's vocab_parallel_cross_entropy (megatron/core/tensor_parallel/cross_entropy.py at
# github.com/NVIDIA/Megatron-LM@f2e5db4, the commit of its README's scaling table), what runs
# without --cross-entropy-loss-fusion (an opt-in flag; Megatron-Core's cross_entropy_loss_fusion
# defaults to False), op by op on the [tokens, V/tp] logits:
#     forward:  .float() (r 2, w 4), max over V (r 4), -= max in place (r 4, w 4),
#               exp in place (r 4, w 4), sum over V (r 4), softmax div_ in place (r 4, w 4)   38
#     backward: grad_input.mul_(grad_output) (r 4, w 4), the .float()'s backward to bf16 (r 4, w 2) 14
# (the target gathers and per-token scalars are one value per token, not per logit).
CE_BYTES = {"fused": (10.0, 10.0), "megatron-unfused": (38.0, 14.0)}     # keys: layout.CE_KERNELS


def op_sac_recomputed(spec: ModelSpec, layout: Layout, job: Job) -> list[tuple]:
    """The GEMMs per-op SAC recomputes in the backward: every other matmul (2nd, 4th, ...), of
    the matmuls as torchtitan runs them (unfused; a GELU layer's are fused either way)."""
    return layer_gemms(spec, layout, job, fused=False)[1::2]


def op_sac_activation_bytes(spec: ModelSpec, layout: Layout, job: Job) -> float:
    """Bytes one layer keeps per micro-batch under per-op SAC: the block input, the saved matmul
    outputs (Llama: wq 2h, wv 2kv, w1 2f, w2 2h; GPT: QKV, fc1), flash attention's output and
    its fp32 log-sum-exp. With sequence parallelism everything is split by tp."""
    t = layout.tp
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn_hidden
    if layer_form(spec).gated_mlp:
        split = 2 * h + 2 * kv + 2 * f + 2 * h + 2 * h     # wq, wv, w1, w2 outputs, attention out
    else:
        split = 2 * (h + 2 * kv) + 2 * f + 2 * h           # QKV, fc1 outputs, attention out
    x = 2 * h                                              # the checkpointed block input
    sp = job.sequence_parallel or t == 1
    lse = 4 * spec.heads * tokens / t
    return tokens * (split / t + (x / t if sp else x)) + lse


def eager_elementwise_bytes(spec: ModelSpec, layout: Layout, job: Job) -> tuple[float, float] | None:
    """(forward, backward) HBM bytes of one layer's eager non-GEMM ops, one micro-batch
    (module docstring); None for layers other than torchtitan's Llama."""
    if not layer_form(spec).eager_ops:
        return None
    t = layout.tp
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    h, kv, f = spec.hidden, spec.kv_dim, spec.ffn_hidden
    sp = job.sequence_parallel or t == 1
    repl_f = 2 * 4 * h + 12 * h                 # norms and residual adds: split by SP only
    repeat = 2 * (2 * kv + 2 * h) if kv < h else 0.0
    split_f = 20 * (h + kv) + repeat + 4 * h + 10 * f
    accum = 5 * 6 * h                           # gradient accumulation adds in the backward
    per_token_f = (repl_f / t if sp else repl_f) + split_f / t
    per_token_b = 2 * per_token_f + (accum / t if sp else accum)
    return tokens * per_token_f, tokens * per_token_b


def fsdp_copy_bytes(layer_params: float, weight_bytes: float, grad_bytes: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per layer and micro-batch of FSDP2's copy-out of the
    gathered weights and copy-in of the gradients (module docstring)."""
    copy_out = 2 * layer_params * weight_bytes
    return copy_out, copy_out + layer_params * (2 + grad_bytes)


# FP8 as Transformer Engine runs it (Micikevicius et al. 2022, "FP8 Formats for Deep Learning";
# TE's Linear/LayerNormLinear): the four linear maps of every layer run their forward (E4M3),
# input-gradient and weight-gradient GEMMs in FP8 at the GPU's FP8 peak; attention (flash, bf16),
# the vocabulary head and the embedding stay in bf16, as Megatron-LM keeps them. Every GEMM input
# is cast (scaled, with its amax taken) to FP8 and, for the GEMM that needs the other layout on
# Hopper, transposed: read 2 bytes, write 1 + 1 per element (`FP8_CAST_BYTES`), HBM-bound; the
# backward casts its output gradients, charged like the rest of the elementwise work (twice the
# forward). An FP8 GEMM reaches the same share of its (twice higher) peak as a bf16 one of the
# same shape relative to its own measured ceiling (`fp8_rel` = 1; the ceiling is the GPU's FP8
# MAMF: 1402.6 of 1979 TFLOP/s on H100 SXM, against 794.5 of 989 for bf16, `gpus.py`).
FP8_CAST_BYTES = 4.0


def fp8_gemm_time(m: float, k: float, n: float, gpu, eff) -> float:
    """An FP8 GEMM: 1-byte operands double the arithmetic intensity, and the ridge point moves
    with the FP8 ceiling (the FP8 MAMF), so the curve's shape carries over; `fp8_rel` scales it."""
    if m * k * n <= 0:      # an empty GEMM: a MoE layer's dense MLP of width 0 (plan/moe.py)
        return 0.0
    peak = gpu.achievable_tflops("fp8") * 1e12
    ridge = peak / (gpu.hbm_gbps * 1e9)
    ai = 2 * m * k * n / (m * k + k * n + m * n)
    x_half = eff.ai_half_ridge * ridge
    return 2 * m * k * n / (peak * eff.e_max * eff.fp8_rel * ai / (ai + x_half))


def fp8_cast_bytes(shapes: list[tuple], job: Job) -> float:
    """HBM bytes of casting the inputs of (M, K, N) GEMMs to FP8 (M*K elements each), as
    `fp8_cast_time` counts a dense layer's; 0 unless --precision fp8 (a MoE layer's MLPs:
    plan.moe_costs)."""
    return FP8_CAST_BYTES * sum(m * k for m, k, _ in shapes) if job.precision == "fp8" else 0.0


def fp8_cast_time(spec: ModelSpec, layout: Layout, job: Job, gpu) -> float:
    """Forward seconds of one layer's FP8 casts (the backward casts its output gradients, about
    as many elements; `stage_costs` charges it again there)."""
    t = layout.tp
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    h, f = spec.hidden, spec.ffn_hidden
    # inputs of QKV and fc1 (gathered [T, h] under SP), of the output projection [T, h/t] and of
    # fc2 [T, f/t] (a gated MLP's fc1 is 2f wide, its fc2 input f wide, as a plain MLP's); a MoE
    # layer (f = 0 here) casts its MLP inputs in plan.moe_costs
    elements = tokens * (h + spec.o_width / t + (h + f / t if f else 0.0))
    return FP8_CAST_BYTES * elements / hbm_rate(gpu)
