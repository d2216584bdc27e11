"""A Mixture-of-Experts decoder in plain PyTorch: LLaMA blocks (commpipe.models.llama) whose MLP
is a routed layer of SwiGLU experts (Mixtral, DeepSeek-V3), attention grouped-query or
multi-head latent (MLA). No parallel code lives here.

The routed layer runs in phases with a seam at each point where expert parallelism exchanges
tokens: `route` (router scores, top-k, load-balancing loss) -> `dispatch` (each token copied once
per chosen expert, grouped by expert) -> `GroupedExperts` (one SwiGLU per expert over its
group) -> `combine` (back to token order, weighted sum over the k copies). Routing is dropless,
every step is a gather, a matmul per expert or a fixed-order sum, so the result is deterministic
and equals a per-token loop (tests/test_moe_model.py).

The load-balancing loss travels with the activations: a stage takes the sum so far (`aux`, a
scalar; None at the first) and returns it with its own layers' terms added, so it can cross
pipeline boundaries like any tensor and the last stage adds it to the token loss
(`moe_loss_sum`).

    python -c "from commpipe.models.moe import build_moe; print(build_moe('moe-tiny'))"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.llama import (
    PreNormUnits,
    RMSNorm,
    apply_rope,
    cross_entropy_sum,
    param_seed,
    rope_cos_sin,
)
from commpipe.models.moe_spec import MoESpec, resolve_moe


class GQAttention(nn.Module):
    """Grouped-query causal self-attention (as commpipe.models.llama.Attention, no CP hook)."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.head_dim, self.rope_theta = spec.head_dim, spec.rope_theta
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=False)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)              # [b, s, nh, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)              # [b, s, nkv, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        return self.wo(_causal_attention(q, k, v))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 section 2.1, as DeepSeek-V3 uses it): queries
    through an optional low-rank latent, keys and values up-projected from one compressed latent
    of kv_lora_rank, plus a rotary part of qk_rope_dim shared by every head."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        h, nh = spec.hidden, spec.heads
        self.nope, self.rope, self.v_dim = spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim
        self.kv_rank, self.rope_theta = spec.kv_lora_rank, spec.rope_theta
        self.q_lora = spec.q_lora_rank > 0
        if self.q_lora:
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, nh * spec.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(h, nh * spec.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(h, spec.kv_lora_rank + spec.qk_rope_dim, bias=False)
        self.kv_norm = RMSNorm(spec.kv_lora_rank, spec.norm_eps)
        self.wkv_b = nn.Linear(spec.kv_lora_rank, nh * (spec.qk_nope_dim + spec.v_head_dim), bias=False)
        self.wo = nn.Linear(nh * spec.v_head_dim, h, bias=False)

    def forward(self, x, positions):
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora else self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope)                # [b, s, nh, nope + rope]
        nh = q.shape[2]
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, nh, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cos, sin = rope_cos_sin(positions, self.rope, self.rope_theta)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        k_rope = apply_rope(k_rope.view(b, s, 1, self.rope), cos, sin).expand(b, s, nh, self.rope)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return self.wo(_causal_attention(q, k, v))


def _causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d_qk)) v, causal; [b, s, nh, d] in, [b, s, nh * d_v] out."""
    b, s = q.shape[:2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))              # [b, nh, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, -1)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a dense MLP, or the shared experts (n shared experts of width f
    are one SwiGLU of width n f: the sum of their outputs is the same function)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts stored stacked ([E, ...], the dimension expert parallelism shards),
    each applied to its own contiguous group of rows."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [sum(counts), h], rows grouped by expert (counts[e] rows for expert e) -> same shape."""
        outs = []
        for e, rows in enumerate(x.split(counts)):
            outs.append(F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]),
                                 self.w2[e]))
        return torch.cat(outs)


@dataclass
class Routing:
    """Where each of T tokens goes: its k experts and weights, the permutation that groups the
    T k copies by expert (stable, so each group keeps token order), and rows per expert."""

    experts: torch.Tensor      # [T, k] int64
    weights: torch.Tensor      # [T, k] gate weights (differentiable)
    order: torch.Tensor        # [T k] copy index (token * k + slot) of each grouped row
    counts: list[int]          # [E] rows per expert
    aux: torch.Tensor          # scalar load-balancing loss of this layer (unscaled)


def gate_scores(logits: torch.Tensor, spec: MoESpec):
    """(selection scores, weights of the chosen experts, chosen experts, per-expert
    probabilities for the balancing loss) from router logits [T, E]; see MoESpec for the gates."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # bf16 -> fp32
    if spec.gate == "softmax":
        probs = logits.softmax(-1)
        top_logits, top = logits.topk(spec.top_k, dim=-1)
        # Mixtral: softmax over the k selected logits; otherwise the top-k probabilities
        weights = top_logits.softmax(-1) if spec.norm_topk else probs.gather(-1, top)
    else:
        scores = logits.sigmoid()
        probs = scores / scores.sum(-1, keepdim=True)              # DeepSeek-V3 eq. 19
        top_scores, top = scores.topk(spec.top_k, dim=-1)
        weights = top_scores / top_scores.sum(-1, keepdim=True) if spec.norm_topk else top_scores
    return weights * spec.route_scale, top, probs


def load_balance_loss(probs: torch.Tensor, top: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), for top-k:
    E * sum_i f_i P_i with f_i the share of the T k assignments that went to expert i (no
    gradient) and P_i the mean router probability of expert i. Perfect balance gives 1
    (Hugging Face's Mixtral loss is top_k times this)."""
    counts = torch.bincount(top.flatten(), minlength=experts).to(probs.dtype)
    f = counts / top.numel()
    return experts * (f * probs.mean(0)).sum()


class MoELayer(nn.Module):
    """Router, routed experts, optional shared experts; dropless top-k routing."""

    def __init__(self, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = GroupedExperts(spec.experts, spec.hidden, spec.expert_ffn)
        self.shared = SwiGLU(spec.hidden, spec.shared_experts * spec.expert_ffn) \
            if spec.shared_experts else None

    def route(self, x: torch.Tensor) -> Routing:
        """x [T, h] -> Routing."""
        weights, top, probs = gate_scores(self.router(x), self.spec)
        order = torch.argsort(top.flatten(), stable=True)          # copies grouped by expert
        counts = torch.bincount(top.flatten(), minlength=self.spec.experts).tolist()
        return Routing(top, weights, order, counts, load_balance_loss(probs, top, self.spec.experts))

    def dispatch(self, x: torch.Tensor, r: Routing) -> torch.Tensor:
        """[T, h] -> [T k, h]: copy c = token * k + slot lands at its place in the expert groups."""
        return x[r.order // self.spec.top_k]

    def combine(self, y: torch.Tensor, r: Routing) -> torch.Tensor:
        """[T k, h] grouped by expert -> [T, h]: back to (token, slot) order, then the weighted
        sum over slots in slot order (no scatter-add, so no order depends on the device)."""
        k = self.spec.top_k
        copies = torch.empty_like(y).index_copy(0, r.order, y)     # [T k, h], row = token * k + slot
        copies = copies.view(-1, k, y.shape[-1]) * r.weights.unsqueeze(-1).to(y.dtype)
        return copies.sum(1)

    def forward(self, x: torch.Tensor):
        """x [b, s, h] -> (out [b, s, h], this layer's load-balancing loss)."""
        flat = x.reshape(-1, x.shape[-1])                          # [T, h]
        r = self.route(flat)
        rows, shared = self.unit_dispatch(flat, r)
        return self.unit_combine(self.experts(rows, r.counts), r, shared).view_as(x), r.aux

    # Units (DualPipe, DeepSeek-V3 section 3.2.1): the layer cut at its token exchanges, so a
    # unit-by-unit runtime (commpipe.runtime.units_moe) can keep expert parallelism's
    # all-to-alls in flight while another pass computes: route, then unit_dispatch (dispatch
    # and the shared experts), the routed experts, then unit_combine; forward() above is their
    # composition.
    def unit_dispatch(self, flat: torch.Tensor, r: Routing):
        """The tokens [T, h] -> (their copies grouped by expert [T k, h], the shared experts'
        output [T, h] or None)."""
        return self.dispatch(flat, r), self.unit_shared(flat)

    def unit_shared(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The shared experts on the tokens [T, h] (None without shared experts)."""
        return self.shared(flat) if self.shared is not None else None

    def unit_combine(self, y: torch.Tensor, r: Routing, shared: torch.Tensor | None):
        """The experts' outputs y [T k, h] (grouped by expert) weighted and summed per token,
        plus the shared experts' output [T, h] -> [T, h]."""
        out = self.combine(y, r)
        return out + shared if shared is not None else out


class MoEBlock(PreNormUnits, nn.Module):
    """Pre-norm block: attention, then a dense SwiGLU (the first dense_layers) or a MoE layer.
    Its units are LLaMA's (PreNormUnits); a MoE layer's MLP splits further at its all-to-alls
    (MoELayer: route, dispatch, unit_shared, experts, unit_combine)."""

    def __init__(self, spec: MoESpec, i: int):
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attention = MLAttention(spec) if spec.attention == "mla" else GQAttention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.is_moe = spec.is_moe_layer(i)
        self.feed_forward = MoELayer(spec) if self.is_moe else SwiGLU(spec.hidden, spec.dense_ffn)

    def forward(self, x, positions):
        """-> (x out, load-balancing loss of this block; None for a dense block)."""
        h, n = self.unit_pre_mlp(x, self.unit_attn(self.unit_pre_attn(x), positions))
        if not self.is_moe:
            return self.residual(h, self.feed_forward(n)), None
        m, aux = self.feed_forward(n)
        return self.residual(h, m), aux


class MoETransformer(nn.Module):
    """The whole MoE decoder, or the layers `layer_ids` one pipeline stage holds (parameter
    names stay `layers.<i>.*`), with the embedding and head only where asked."""

    def __init__(self, spec: MoESpec, layer_ids=None, has_embedding: bool = True,
                 has_head: bool = True):
        super().__init__()
        self.spec = spec
        layer_ids = range(spec.layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): MoEBlock(spec, i) for i in layer_ids})
        self.norm = RMSNorm(spec.hidden, spec.norm_eps) if has_head else None
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False) if has_head else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                aux: torch.Tensor | None = None):
        """x: tokens [b, s] or hidden states [b, s, h]; aux: the load-balancing term of earlier
        stages (None at the first). Returns (logits [b, s, vocab] or hidden states, aux): aux
        adds aux_loss_coef * (b s) * each MoE layer's loss, in the summed-over-tokens units of
        cross_entropy_sum, so dividing the total by the global token count weighs each
        micro-batch's balancing loss by its tokens."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        tokens = h.shape[0] * h.shape[1]
        total = torch.zeros((), device=h.device) if aux is None else aux
        for layer in self.layers.values():
            h, layer_aux = layer(h, positions)
            if layer_aux is not None:
                total = total + self.aux_term(layer_aux, tokens)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h, total


    def aux_term(self, layer_aux: torch.Tensor, tokens: int) -> torch.Tensor:
        """One MoE layer's load-balancing loss in the summed-over-tokens units of the loss."""
        return self.spec.aux_loss_coef * tokens * layer_aux


class MoEOutput(NamedTuple):
    """What the last stage outputs: logits [b, s, vocab] and the carried load-balancing term."""

    logits: torch.Tensor
    aux: torch.Tensor


class MoEStage(MoETransformer):
    """A pipeline stage of the MoE decoder, inputs and outputs named as in its StageIO
    (moe_spec.stage_io): tokens (first stage) or hidden and aux in; hidden and aux out, or on the
    last stage logits as a MoEOutput, which `stage_loss_sum` turns into the loss."""

    io_dict = True   # takes and returns dicts named by its StageIO (commpipe.runtime.executor)

    def forward(self, tokens=None, hidden=None, aux=None) -> dict:
        x = tokens if self.tok_embeddings is not None else hidden
        h, total = super().forward(x, None, None if aux is None else aux.reshape(()))
        return self.outputs(h, total)

    def outputs(self, h: torch.Tensor, total: torch.Tensor) -> dict:
        """The stage's output dict from its last hidden states (logits on the last stage) and
        the balancing term summed so far."""
        if self.output is not None:
            return {"logits": MoEOutput(h, total)}
        return {"hidden": h, "aux": total.reshape(1)}


def stage_loss_sum(out: MoEOutput, labels: torch.Tensor, token_loss=cross_entropy_sum):
    """The last stage's loss: `token_loss` (summed cross-entropy, or its vocabulary-parallel
    form) of the logits plus the carried load-balancing term."""
    return token_loss(out.logits, labels) + out.aux


def moe_loss_sum(logits: torch.Tensor, labels: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy plus the carried load-balancing term; callers divide by the
    global token count."""
    return cross_entropy_sum(logits, labels) + aux


@torch.no_grad()
def init_moe(model: MoETransformer, seed: int) -> MoETransformer:
    """As commpipe.models.llama.init_weights: Normal(0, 0.02) from (seed, name), output
    projections (wo, w2, each expert's w2) scaled by 1/sqrt(2 L), norms at one. Expert e of a
    stacked weight draws from (seed, `<name>.<e>`), so a holder of some experts can build
    exactly their slice."""
    std = 0.02
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        scale = std / math.sqrt(2 * model.spec.layers) if name.endswith(("wo.weight", "w2.weight",
                                                                         "experts.w2")) else std
        stacked = ".experts." in name
        for e, part in enumerate(p if stacked else [p]):
            g = torch.Generator().manual_seed(param_seed(seed, f"{name}.{e}" if stacked else name))
            part.copy_(torch.randn(part.shape, generator=g, dtype=torch.float32) * scale)
    return model


def build_moe(spec: MoESpec | str, seed: int = 0, layer_ids=None, has_embedding: bool = True,
              has_head: bool = True, device: torch.device | str = "cpu",
              stage: bool = False) -> MoETransformer:
    """Build on the meta device (no memory), then materialise and initialise from names;
    `stage`: a MoEStage (pipeline stage with named inputs and outputs)."""
    spec = resolve_moe(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = (MoEStage if stage else MoETransformer)(spec.validate(), layer_ids,
                                                        has_embedding, has_head)
    return init_moe(model.to_empty(device=device), seed)
