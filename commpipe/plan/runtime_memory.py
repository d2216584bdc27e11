"""Activation memory of commpipe's own runtime (`Job.runtime == "commpipe"`), tensor by tensor.

What autograd saves in one LLaMA layer of commpipe.models.llama, per micro-batch, counted in
elements with T = b*s/cp tokens on the rank, t = tp, S = T/t under sequence parallelism (else
T), h hidden, f ffn_hidden, a heads, kv = K/V width, d = head_dim; e bytes per element (4 fp32):

    attention: norm input and normalised x (2 S h), the gathered QKV input (T h; without SP the
               norm output, T h), Q, repeated K and V, the output (4 T h / t), the attention
               core's log-sum-exp (T a / t, CPU and GPU flash kernels), rotary cos/sin (T d)
    MLP:       norm 2 S h, the gathered MLP input T h, gate, up, SiLU output, product (4 T f / t)
selective:    the core's inputs and output instead: Q, K, V and O ((2 h + 2 kv) T / t), no
              log-sum-exp and no repeated K/V
full:         each layer's input only (S h) plus one layer recomputed during its backward
The last stage adds the final norm (2 S h), the head's gathered input (T h) and the fp32 softmax
of the vocabulary-parallel cross-entropy (T V / t, 4 bytes), freed by the loss backward before
any layer's backward, so under full recomputation its peak is the larger of the two.

This is what `activation_mb` measures (tests/test_plan_runtime.py checks the prediction on
tp2 pp2 CPU runs). The Megatron-style model in memory.py prices the GPU stacks the planner is
validated on.
"""

from __future__ import annotations

from commpipe.models.spec import ModelSpec


def layer_elements(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool,
                   recompute: str) -> float:
    """Elements one layer saves for backward per micro-batch (module docstring)."""
    t, h, f, a = tp, spec.hidden, spec.ffn_hidden, spec.heads
    sp = sequence_parallel and t > 1
    shard = tokens / t if sp else tokens
    if recompute == "full":
        return shard * h
    norms = 2 * (2 * shard * h) + 2 * tokens * h          # both norms, both GEMM inputs
    if recompute == "selective":
        core = (2 * h + 2 * spec.kv_dim) * tokens / t
    else:
        core = (4 * h + a) * tokens / t
    rope = tokens * spec.head_dim
    return norms + core + rope + 4 * tokens * f / t


def head_elements(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool) -> tuple:
    """(final norm and head input, fp32 softmax) elements of the last stage per micro-batch."""
    sp = sequence_parallel and tp > 1
    shard = tokens / tp if sp else tokens
    return 2 * shard * spec.hidden + tokens * spec.hidden, tokens * spec.vocab / tp


def stage_activation_bytes(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool,
                           recompute: str, layers: int, inflight: float, last: bool,
                           last_inflight: float, elem_bytes: int) -> tuple[float, float]:
    """(activations, softmax) bytes at a rank's peak: `inflight` micro-batches of its `layers`
    layers, the head's share on the last stage."""
    per_layer = layer_elements(spec, tp, tokens, sequence_parallel, recompute)
    act = inflight * layers * per_layer * elem_bytes
    recomputed = 0.0
    if recompute == "full":
        recomputed = layer_elements(spec, tp, tokens, sequence_parallel, "none") * elem_bytes
    softmax = 0.0
    if last:
        head, sm = head_elements(spec, tp, tokens, sequence_parallel)
        act += last_inflight * head * elem_bytes
        softmax = last_inflight * sm * 4
        # the loss backward frees the softmax before the recomputed layer exists
        recomputed = max(0.0, recomputed - softmax)
    return act + recomputed, softmax
