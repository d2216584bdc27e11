"""A decoder layer's attention as the planner prices it, for the two forms a spec can have.

Grouped-query attention (LLaMA, GPT, Mixtral; `heads`, `kv_heads`, head_dim = hidden / heads, or
a MoE shape's own head_dim, queries `q_width` = heads * head_dim wide):
the layer machinery's own formulas (kernels.layer_gemms, memory.layer_activation_bytes), which
this module leaves as they are.

Multi-head latent attention (MLA: DeepSeek-V2 section 2.1, DeepSeek-V3's shape; a MoESpec with
`attention="mla"`, commpipe.models.moe.MLAttention), per token of h hidden, nh heads:

    queries      wq (h -> nh*qk), or through a latent: wq_a (h -> q_lora), RMSNorm,
                 wq_b (q_lora -> nh*qk)
    keys, values wkv_a (h -> kv_lora + rope), RMSNorm on the kv_lora part,
                 wkv_b (kv_lora -> nh*(nope + v)); the rope part is every head's rotary key half
    output       wo (nh*v -> h)
with qk = nope + rope: scores are dotted over qk, values are v wide. Tensor parallelism splits it
as DeepSeek-V3's reference model does (inference/model.py: wq, wq_b and wkv_b
ColumnParallelLinear, wo RowParallelLinear, wq_a and wkv_a plain Linear): the heads are split;
the down projections and their norms are replicated, every TP rank computing the latents of
every token of its sequence. The layer's saved tensors are flash attention's (Q, K, V, O: split
by TP) and the latents before and after their norms and the rotary key (bf16, replicated).
Not priced: Megatron-Core's variant that projects the sequence-parallel shard down and
all-gathers the (narrower) latents instead of the hidden states.
"""

from __future__ import annotations

from commpipe.models.spec import layer_param_count


def mla(spec) -> bool:
    return getattr(spec, "attention", "gqa") == "mla"


def score_dims(spec) -> tuple[int, int, int]:
    """(heads, width of a query/key head, width of a value head)."""
    if mla(spec):
        return spec.heads, spec.qk_nope_dim + spec.qk_rope_dim, spec.v_head_dim
    return spec.heads, spec.head_dim, spec.head_dim


def kv_width(spec) -> float:
    """Mean width of a token's K and V (K + V = 2 x this), what context parallelism moves."""
    if mla(spec):
        nh, qk, v = score_dims(spec)
        return nh * (qk + v) / 2
    return spec.kv_dim


def mla_gemms(spec, tokens: float, t: int) -> list[tuple]:
    """(M, K, N) of MLA's weight GEMMs on one TP rank, in forward order."""
    h, (nh, qk, v) = spec.hidden, score_dims(spec)
    if spec.q_lora_rank:
        q = [(tokens, h, spec.q_lora_rank), (tokens, spec.q_lora_rank, nh * qk / t)]
    else:
        q = [(tokens, h, nh * qk / t)]
    kv = [(tokens, h, spec.kv_lora_rank + spec.qk_rope_dim),
          (tokens, spec.kv_lora_rank, nh * (spec.qk_nope_dim + v) / t)]
    return q + kv + [(tokens, nh * v / t, h)]


def replicated_attention_params(spec) -> int:
    """Attention parameters every TP rank holds whole: MLA's down projections and latent norms;
    none for grouped-query attention."""
    if not mla(spec):
        return 0
    h, q = spec.hidden, spec.q_lora_rank
    return (h * q + q if q else 0) + h * (spec.kv_lora_rank + spec.qk_rope_dim) + spec.kv_lora_rank


def layer_params(spec) -> int:
    """Parameters of one layer as the layer machinery counts them (attention, norms and the
    dense MLP of `ffn_hidden`, 0 for a MoE spec whose MLPs commpipe.plan.moe adds)."""
    if mla(spec):
        from commpipe.models.moe_spec import attention_param_count

        return attention_param_count(spec) + 2 * spec.hidden
    return layer_param_count(spec)


def mla_activation_bytes(spec, tokens: float, t: int) -> tuple[float, float]:
    """(bytes split by TP, bytes replicated) MLA keeps per layer and micro-batch for the
    backward, in bf16: flash attention's Q, K (nh*qk each), V and O (nh*v each), and the latents
    (the query latent and the K/V latent before and after their norms, the rotary key half)."""
    nh, qk, v = score_dims(spec)
    split = 2 * tokens * nh * (2 * qk + 2 * v) / t
    latents = 2 * (2 * spec.q_lora_rank + 2 * spec.kv_lora_rank + spec.qk_rope_dim)
    return split, tokens * latents
