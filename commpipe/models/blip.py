"""A BLIP-style image captioner in plain PyTorch (Li et al. 2022, "BLIP", section 3.1): a ViT
image encoder and a causal text decoder whose layers self-attend, cross-attend to the image
features and run an MLP, under an LM head (the captioning objective, BLIP's L_LM).

The model is one sequence of layers, `layers.<i>` for i < enc_layers ViT blocks, after that
decoder blocks. A `Blip` holds the contiguous range `layer_ids` of it (the whole model or one
pipeline stage) plus the pieces that go with those layers: the vision embedding with layer 0,
the encoder's final norm with the last encoder layer, the text embedding with the first decoder
layer, the LM head with the last layer. Stages take and return dicts of tensors named as in
`commpipe.models.blip_spec.stage_io` (pixels, tokens, image_hidden, image_features,
text_hidden -> logits). No parallel code lives here.

    python -c "from commpipe.models.blip import build_model; print(build_model('blip-tiny'))"
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.blip_spec import BlipSpec, resolve_blip
from commpipe.models.llama import param_seed

IGNORE = -100  # label of padding positions: no loss


class Attention(nn.Module):
    """Multi-head attention with biased projections; K and V are computed from `context`
    (cross-attention) or from x itself. Head count is read off the projection width, so tensor
    parallelism can shard the projections without this module knowing."""

    def __init__(self, hidden: int, heads: int, context_hidden: int | None = None,
                 causal: bool = False):
        super().__init__()
        self.head_dim = hidden // heads
        self.causal = causal
        kv_in = hidden if context_hidden is None else context_hidden
        self.wq = nn.Linear(hidden, hidden)
        self.wk = nn.Linear(kv_in, hidden)
        self.wv = nn.Linear(kv_in, hidden)
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        kv = x if context is None else context
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)               # [b, nh, s, hd]
        k = self.wk(kv).view(b, kv.shape[1], -1, self.head_dim).transpose(1, 2)    # [b, nh, t, hd]
        v = self.wv(kv).view(b, kv.shape[1], -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    """Pre-norm ViT block, bidirectional attention over [CLS] + patches."""

    def __init__(self, spec: BlipSpec):
        super().__init__()
        h, eps = spec.enc_hidden, spec.enc_norm_eps
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.attention = Attention(h, spec.enc_heads)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(h, spec.enc_mlp)

    def forward(self, x):                                   # [b, P, he]
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class DecoderBlock(nn.Module):
    """BERT layer with cross-attention, post-norm as BLIP's med.py: causal self-attention,
    cross-attention from text queries to image keys/values, MLP; LayerNorm after each residual."""

    def __init__(self, spec: BlipSpec):
        super().__init__()
        h, eps = spec.dec_hidden, spec.dec_norm_eps
        self.attention = Attention(h, spec.dec_heads, causal=True)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.cross_attention = Attention(h, spec.dec_heads, context_hidden=spec.enc_hidden)
        self.cross_attention_norm = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(h, spec.dec_mlp)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x, image):                            # x [b, s, h], image [b, P, he]
        x = self.attention_norm(x + self.attention(x))
        x = self.cross_attention_norm(x + self.cross_attention(x, image))
        return self.mlp_norm(x + self.mlp(x))


class VisionEmbedding(nn.Module):
    """Non-overlapping patches projected by a conv (kernel = stride = patch), a learned [CLS]
    token in front, learned positions added (ViT, Dosovitskiy et al. 2021, eq. 1)."""

    def __init__(self, spec: BlipSpec):
        super().__init__()
        self.proj = nn.Conv2d(spec.channels, spec.enc_hidden, spec.patch, stride=spec.patch)
        self.cls_token = nn.Parameter(torch.empty(1, 1, spec.enc_hidden))
        self.positions = nn.Parameter(torch.empty(1, spec.image_tokens, spec.enc_hidden))

    def forward(self, pixels):                              # [b, C, S, S]
        x = self.proj(pixels).flatten(2).transpose(1, 2)    # [b, P-1, he]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.positions


class TextEmbedding(nn.Module):
    """BERT embeddings as BLIP uses them: words + learned positions, then LayerNorm."""

    def __init__(self, spec: BlipSpec):
        super().__init__()
        self.words = nn.Embedding(spec.vocab, spec.dec_hidden)
        self.positions = nn.Embedding(spec.max_text_len, spec.dec_hidden)
        self.norm = nn.LayerNorm(spec.dec_hidden, eps=spec.dec_norm_eps)

    def forward(self, tokens):                              # [b, s]
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.norm(self.words(tokens) + self.positions(pos))


class LMHead(nn.Module):
    """BERT's prediction head: dense + GELU + LayerNorm, then the vocabulary projection
    (untied from the word embedding, which may live on another pipeline stage)."""

    def __init__(self, spec: BlipSpec):
        super().__init__()
        self.dense = nn.Linear(spec.dec_hidden, spec.dec_hidden)
        self.norm = nn.LayerNorm(spec.dec_hidden, eps=spec.dec_norm_eps)
        self.output = nn.Linear(spec.dec_hidden, spec.vocab)

    def forward(self, x):
        return self.output(self.norm(F.gelu(self.dense(x))))


class Blip(nn.Module):
    """The whole captioner, or the contiguous slice of its layers one pipeline stage holds."""

    io_dict = True   # takes and returns dicts named by its StageIO (commpipe.runtime.executor)

    def __init__(self, spec: BlipSpec, layer_ids=None):
        super().__init__()
        spec.validate()
        self.spec = spec
        ids = list(range(spec.layers) if layer_ids is None else layer_ids)
        if not ids or ids != list(range(ids[0], ids[0] + len(ids))) or ids[0] < 0 \
                or ids[-1] >= spec.layers:
            raise ValueError(f"layer_ids must be a non-empty contiguous range inside "
                             f"0..{spec.layers - 1}, got {ids}")
        self.layer_ids = range(ids[0], ids[-1] + 1)
        enc, last = spec.enc_layers, spec.layers - 1
        self.vision_embed = VisionEmbedding(spec) if 0 in ids else None
        self.layers = nn.ModuleDict({str(i): EncoderBlock(spec) if i < enc else DecoderBlock(spec)
                                     for i in ids})
        self.vision_norm = nn.LayerNorm(spec.enc_hidden, eps=spec.enc_norm_eps) \
            if enc - 1 in ids else None
        self.text_embed = TextEmbedding(spec) if enc in ids else None
        self.head = LMHead(spec) if last in ids else None

    def forward(self, pixels=None, tokens=None, image_hidden=None, image_features=None,
                text_hidden=None) -> dict[str, torch.Tensor]:
        """Inputs and outputs named as in `blip_spec.stage_io`: a stage ending inside the
        encoder returns image_hidden, one ending at its last layer image_features, a decoder
        stage text_hidden and image_features (passed on unchanged), the last stage logits."""
        spec, ids = self.spec, self.layer_ids
        if self.vision_embed is not None:
            image_hidden = self.vision_embed(_need(pixels, "pixels", ids))
        for i in ids:
            if i >= spec.enc_layers:
                break
            image_hidden = self.layers[str(i)](_need(image_hidden, "image_hidden", ids))
        if self.vision_norm is not None:
            image_features = self.vision_norm(image_hidden)
        if ids.stop <= spec.enc_layers:
            return {"image_features": image_features} if self.vision_norm is not None \
                else {"image_hidden": image_hidden}
        if self.text_embed is not None:
            text_hidden = self.text_embed(_need(tokens, "tokens", ids))
        _need(image_features, "image_features", ids)
        for i in ids:
            if i >= spec.enc_layers:
                text_hidden = self.layers[str(i)](_need(text_hidden, "text_hidden", ids),
                                                  image_features)
        if self.head is not None:
            return {"logits": self.head(text_hidden)}
        return {"text_hidden": text_hidden, "image_features": image_features}


def _need(t, name: str, ids: range):
    if t is None:
        raise ValueError(f"the stage holding layers {ids.start}..{ids.stop - 1} needs input "
                         f"{name!r} (see blip_spec.stage_io)")
    return t


@torch.no_grad()
def init_weights(model: Blip, seed: int) -> Blip:
    """Normal(0, 0.02) weights, embeddings, [CLS] and positions (BERT, ViT); zero biases; norms
    at one. Each tensor is drawn from (seed, its name), so every stage split builds identical
    parameters (as `commpipe.models.llama.init_weights`)."""
    for name, p in model.named_parameters():
        if "norm." in name:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            g = torch.Generator().manual_seed(param_seed(seed, name))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)
    return model


def build_model(spec: BlipSpec | str, seed: int = 0, layer_ids=None,
                device: torch.device | str = "cpu") -> Blip:
    """Build on the meta device (no memory), then materialise and initialise from names."""
    spec = resolve_blip(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = Blip(spec, layer_ids)
    return init_weights(model.to_empty(device=device), seed)


def build_stages(spec: BlipSpec | str, stage_layers: list[int], seed: int = 0,
                 device: torch.device | str = "cpu") -> list[Blip]:
    """One module per stage of a split given as layer counts (first stage first)."""
    spec = resolve_blip(spec) if isinstance(spec, str) else spec
    out, start = [], 0
    for count in stage_layers:
        out.append(build_model(spec, seed, range(start, start + count), device))
        start += count
    return out


def caption_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over non-padding labels (padding is IGNORE); callers
    divide by the global count of labelled tokens, `(labels != IGNORE).sum()`."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE)
