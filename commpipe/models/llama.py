"""A LLaMA-style decoder in plain PyTorch: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, untied output head. No parallel code lives here; commpipe.parallel applies tensor,
context and pipeline parallelism to these modules from outside.

A `Transformer` may be a whole model or one pipeline stage: it holds the layers named in
`layer_ids` (parameter names stay `layers.<i>.*` whatever stage holds layer i), the embedding
only if `has_embedding`, the final norm and head only if `has_head`.

    python -c "from commpipe.models.llama import build_model; print(build_model('tiny'))"
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.spec import ModelSpec, resolve_model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin tables [s, head_dim/2] for the given (possibly non-contiguous) positions."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                         device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, n_heads, head_dim] by the position angle."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention.

    Head counts are read off the projection shapes, so tensor parallelism can shard the
    projections without this module knowing. `kv_exchange` (None here) is the context-parallel
    hook: it receives local K, V and positions and returns the K, V and positions to attend to.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.rope_theta = spec.rope_theta
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=False)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)
        self.kv_exchange: nn.Module | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)             # [b, s, nh, hd]
        k = self.wk(x).view(b, s, -1, self.head_dim)             # [b, s, nkv, hd]
        v = self.wv(x).view(b, s, -1, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_positions = positions
        if self.kv_exchange is not None:
            k, v, k_positions = self.kv_exchange(k, v, positions)
        out = self.core(q, k, v, positions, k_positions)           # [b, s, nh * hd]
        return self.wo(out)

    def core(self, q, k, v, positions, k_positions):
        """softmax(q k^T / sqrt(d)) v, causal by absolute position: the unit selective
        recomputation recomputes (commpipe.runtime.recompute)."""
        b, s = q.shape[:2]
        groups = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))          # [b, nh, s, hd]
        if k_positions is positions:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # keys come from other sequence chunks: mask by absolute position
            mask = k_positions[None, :] <= positions[:, None]    # [s_q, s_k]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, -1)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (Shazeer, 2020)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.w1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.w3 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=False)
        self.w2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class PreNormUnits:
    """The units of a pre-norm block with `attention_norm`, `attention` and `ffn_norm` (STP, Qi
    et al. 2025): the layer cut where tensor parallelism communicates, so a unit-by-unit runtime
    (commpipe.runtime.units) can keep one unit's collective in flight while another pass
    computes. A block's forward() is exactly their composition. Each residual add runs where
    the sum's second operand is first complete: the attention's in pre_mlp, the MLP's in
    `residual` (the next layer's first unit, or the stage's end). LLaMA's Block and the MoE
    block (commpipe.models.moe) share them; each adds its own MLP unit(s)."""

    def unit_pre_attn(self, x):
        return self.attention_norm(x)

    def unit_attn(self, n, positions):
        return self.attention(n, positions)

    def unit_pre_mlp(self, x, a):
        h = x + a
        return h, self.ffn_norm(h)

    @staticmethod
    def residual(h, m):
        return h + m


class Block(PreNormUnits, nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.feed_forward = FeedForward(spec)

    def forward(self, x, positions):
        a = self.unit_attn(self.unit_pre_attn(x), positions)
        h, n = self.unit_pre_mlp(x, a)
        return self.residual(h, self.unit_mlp(n))

    def unit_mlp(self, n):
        return self.feed_forward(n)


class Transformer(nn.Module):
    """The whole decoder, or the slice of it one pipeline stage holds."""

    def __init__(self, spec: ModelSpec, layer_ids=None, has_embedding: bool = True,
                 has_head: bool = True):
        super().__init__()
        if spec.arch != "llama":
            raise ValueError(f"training builds arch=llama models; {spec.name} is arch={spec.arch} "
                             "(gpt shapes are for plan/estimate)")
        self.spec = spec
        layer_ids = range(spec.layers) if layer_ids is None else layer_ids
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in layer_ids})
        self.norm = RMSNorm(spec.hidden, spec.norm_eps) if has_head else None
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False) if has_head else None
        # the stage's tensor parallelism (commpipe.parallel.tensor.TPStage) once apply_tp has
        # sharded it; None: whole on this rank
        self.tp = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: tokens [b, s] (with embedding) or hidden states [b, s, h]; returns logits
        [b, s, vocab] (with head) or hidden states."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h, positions)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def param_seed(seed: int, name: str) -> int:
    """Each parameter's initial values depend only on (seed, its name), so every layout and
    stage split builds bit-identical weights without materialising the whole model."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> Transformer:
    """Normal(0, 0.02) weights; output projections (wo, w2) scaled by 1/sqrt(2 L) as in
    GPT-2 / Megatron; norms start at one."""
    std = 0.02
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        scale = std / math.sqrt(2 * model.spec.layers) if name.endswith(("wo.weight", "w2.weight")) \
            else std
        g = torch.Generator().manual_seed(param_seed(seed, name))
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * scale)
    return model


def build_model(spec: ModelSpec | str, seed: int = 0, layer_ids=None, has_embedding: bool = True,
                has_head: bool = True, device: torch.device | str = "cpu") -> Transformer:
    """Build on the meta device (no memory), then materialise and initialise from names."""
    spec = resolve_model(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = Transformer(spec, layer_ids, has_embedding, has_head)
    return init_weights(model.to_empty(device=device), seed)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy; callers divide by the global token count."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
