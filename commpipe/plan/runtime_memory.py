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
any layer's backward, so under full recomputation its peak is the larger of the two. While the
loss backward runs, the gradient of the log-softmax output and the logits' fp32 gradient (8 bytes
a logit of one micro-batch) exist beside it: the last stage's peak.

Under bf16 autocast (`mixed`) the parameters and the residual stream stay fp32, so the norms'
tensors, the log-sum-exp and cos/sin keep 4 bytes; every linear map saves its own bf16 cast of
its input (three casts of the attention input, two of the MLP input: 5 T h x 2 bytes instead of
2 T h x 4), and Q, K, V, O and the MLP tensors are bf16. The runtime keeps autocast's cache
open for the whole step (commpipe.runtime.executor, `step_cast_cache`), so the stage holds one
bf16 copy of its linear weights (2 bytes a parameter), shared by every micro-batch in flight and
by recomputation.

This is what `activation_mb` measures (tests/test_plan_runtime.py checks the prediction on
tp2 pp2 CPU runs in fp32 and on one rank in bf16). The Megatron-style model in memory.py prices
the GPU stacks the planner is validated on.
"""

from __future__ import annotations

from commpipe.models.spec import ModelSpec, layer_param_count


def layer_bytes(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool,
                recompute: str, mixed: bool) -> float:
    """Bytes one layer saves for backward per micro-batch (module docstring), without the
    weight copies of `weight_copy_bytes`."""
    t, h, f, a = tp, spec.hidden, spec.ffn_hidden, spec.heads
    sp = sequence_parallel and t > 1
    shard = tokens / t if sp else tokens
    if recompute == "full":
        return 4 * shard * h                               # the fp32 residual entering the layer
    low = 2 if mixed else 4                                # bf16 under autocast
    if mixed:   # fp32 norm input and normalised x; one bf16 input cast per linear map
        norms = 2 * (2 * shard * h) * 4 + 5 * tokens * h * 2
    else:       # both norms, both GEMM inputs
        norms = (2 * (2 * shard * h) + 2 * tokens * h) * 4
    if recompute == "selective":
        core = (2 * h + 2 * spec.kv_dim) * tokens / t * low
    else:
        core = 4 * h * tokens / t * low + a * tokens / t * 4
    rope = tokens * spec.head_dim * 4
    return norms + core + rope + 4 * tokens * f / t * low


def weight_copy_bytes(spec: ModelSpec, tp: int, layers: int, head: bool) -> float:
    """bf16 copies autocast makes of one micro-batch's linear weights on a stage: its layers'
    (norm weights excluded) and, on the last stage, the vocabulary head's, split by TP."""
    linear = layer_param_count(spec) - 2 * spec.hidden
    return 2 * (layers * linear + (spec.vocab * spec.hidden if head else 0)) / tp


def head_bytes(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool,
               mixed: bool) -> tuple[float, float]:
    """(final norm and head input, fp32 softmax) bytes of the last stage per micro-batch."""
    sp = sequence_parallel and tp > 1
    shard = tokens / tp if sp else tokens
    head_input = tokens * spec.hidden * (2 if mixed else 4)
    return 2 * shard * spec.hidden * 4 + head_input, tokens * spec.vocab / tp * 4


def stage_activation_bytes(spec: ModelSpec, tp: int, tokens: float, sequence_parallel: bool,
                           recompute: str, layers: int, inflight: float, last: bool,
                           last_inflight: float, mixed: bool) -> tuple[float, float, float]:
    """(activations, softmax, loss-backward transient) bytes at a rank's peak: `inflight`
    micro-batches of its `layers` layers, the head's share on the last stage, and under bf16
    autocast the step's one bf16 copy of the stage's weights."""
    per_layer = layer_bytes(spec, tp, tokens, sequence_parallel, recompute, mixed)
    act = inflight * layers * per_layer
    recomputed = 0.0
    if recompute == "full":
        recomputed = layer_bytes(spec, tp, tokens, sequence_parallel, "none", mixed)
    if mixed:   # one bf16 copy of the stage's weights for the whole step
        act += weight_copy_bytes(spec, tp, layers, head=last)
    softmax = transient = 0.0
    if last:
        head, sm = head_bytes(spec, tp, tokens, sequence_parallel, mixed)
        act += last_inflight * head
        softmax = last_inflight * sm
        # the loss backward frees the softmax before the recomputed layer exists
        recomputed = max(0.0, recomputed - softmax)
        # while the loss backward runs, the dense gradient of the log-softmax output and the
        # logits' fp32 gradient live beside the saved softmax (8 bytes a logit, one micro-batch)
        transient = 2 * sm
    return act + recomputed, softmax, transient
