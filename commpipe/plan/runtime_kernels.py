"""What commpipe's own runtime moves through GPU memory beside its GEMMs and attention
(`Job.runtime == "commpipe"` on a GPU; runtime_memory.py holds what it keeps).

commpipe.models.llama is plain eager PyTorch: every non-GEMM op is its own kernel and a round
trip through HBM, the parameters and the residual stream stay fp32 under bf16 autocast, and one
GEMM runs per matrix (wq, wk, wv, wo, w1, w3, w2). Counted op by op from the aten calls one
layer dispatches (tests/test_plan_runtime_kernels.py recounts them with a TorchDispatchMode and
checks these coefficients; each op's bytes are its inputs read plus its outputs written, views
free). Per token of one layer, h hidden, kv K/V width, f ffn_hidden, d head_dim:

    bf16 autocast  forward   168 h + 54 kv + 10 f +  48 d + 72
                   backward  350 h + 72 kv + 18 f + 144 d + 72
    fp32           forward   129 h + 36 kv + 20 f +  72 d + 72
                   backward  316 h + 64 kv + 36 f +  16 d + 72

Of the forward's h terms, the two fp32 RMSNorms (pow, mean, two multiplies: 28 h each) and the
two residual adds (fp32 stream plus a bf16 branch: 10 h each) are 76 h, sharded by sequence
parallelism only; the five bf16 input casts of the linear maps (6 h each, 30 h) read the gathered
input and are not split; the rest (rotary embedding in fp32, the repeated K/V, SwiGLU) is split
by TP. The backward's h terms split in the same proportions.

Per layer, beside the per-token bytes: under autocast the step casts the layer's linear weights
to bf16 once (read 4, write 2 bytes a parameter: autocast's cache stays open for the whole step,
commpipe.runtime.executor `step_cast_cache`), each micro-batch's backward casts their bf16
gradients to fp32 (read 2, write 4), and every micro-batch after the first of a step adds its
gradient into `.grad` (read 4 + 4, write 4), in fp32 too.
"""

from __future__ import annotations

from commpipe.models.spec import ModelSpec, layer_param_count
from commpipe.plan.layout import Job, Layout

# (h, kv, f, d, constant) bytes per token of one layer (module docstring)
PER_TOKEN = {
    ("bf16", "forward"): (168, 54, 10, 48, 72),
    ("bf16", "backward"): (350, 72, 18, 144, 72),
    ("fp32", "forward"): (129, 36, 20, 72, 72),
    ("fp32", "backward"): (316, 64, 36, 16, 72),
}
NORMS_AND_ADDS_H = 76       # forward h coefficient sharded by sequence parallelism only
CASTS_H = 30                # forward h coefficient of the input casts: never split (bf16 only)
WEIGHT_CAST_BYTES = 6       # per parameter: forward 4 -> 2, backward 2 -> 4
GRAD_ACCUMULATE_BYTES = 12  # per parameter: .grad += g in fp32


def per_token_bytes(spec: ModelSpec, precision: str, direction: str, tp: int = 1,
                    sequence_parallel: bool = True) -> float:
    """Bytes one layer's non-GEMM ops move per token in one direction, on one of tp ranks."""
    key = "fp32" if precision == "fp32" else "bf16"
    ch, ckv, cf, cd, c0 = PER_TOKEN[key, direction]
    forward_h = PER_TOKEN[key, "forward"][0]
    scale = ch / forward_h                               # the backward splits like the forward
    norms = NORMS_AND_ADDS_H * scale
    casts = (CASTS_H if key == "bf16" else 0) * scale
    rest_h = ch - norms - casts
    sp = sequence_parallel or tp == 1
    h, kv, f, d = spec.hidden, spec.kv_dim, spec.ffn_hidden, spec.head_dim
    split = (rest_h * h + ckv * kv + cf * f + cd * d) / tp
    return (norms * h / tp if sp else norms * h) + casts * h + split + c0


def commpipe_elementwise_bytes(spec: ModelSpec, layout: Layout, job: Job) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one layer's non-GEMM work for one micro-batch: the
    per-token ops plus its share of the weight casts and gradient accumulation."""
    tokens = layout.micro_batch_size * job.seq_len / layout.cp
    t = layout.tp
    fwd = tokens * per_token_bytes(spec, job.precision, "forward", t, job.sequence_parallel)
    bwd = tokens * per_token_bytes(spec, job.precision, "backward", t, job.sequence_parallel)
    params = (layer_param_count(spec) - 2 * spec.hidden) / t      # the linear maps' weights
    m = max(layout.microbatches_for(job), 1)
    accumulate = GRAD_ACCUMULATE_BYTES * params * (m - 1) / m
    if job.precision != "fp32":
        fwd += WEIGHT_CAST_BYTES * params / m       # once a step, shared by its micro-batches
        bwd += WEIGHT_CAST_BYTES * params
    return fwd, bwd + accumulate
