"""BLIP-style captioning shapes as pure data: presets, parameter counts, FLOPs, stage boundaries.

The model (`commpipe.models.blip`) is one sequence of layers: `enc_layers` ViT blocks, then
`dec_layers` text-decoder blocks (causal self-attention, cross-attention to the image features,
MLP). A pipeline cuts this sequence anywhere; `stage_io` says what then crosses each cut. Like
`ModelSpec`, nothing here imports torch, so the planner can reason about blip-large unbuilt.

    >>> spec = resolve_blip("blip-base")
    >>> spec.layers, spec.image_tokens, round(param_count(spec) / 1e6, 1)
    (24, 197, 247.1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from commpipe.models.boundary import StageIO, TensorDesc, check_counts


@dataclass(frozen=True)
class BlipSpec:
    """ViT encoder (pre-norm, learned positions, [CLS] token) + BERT-style decoder (post-norm,
    as BLIP's med.py) with an untied LM head. `text_len` is the caption length the model is
    trained on (inputs per sample); `max_text_len` sizes the learned text position table."""

    name: str
    image_size: int
    patch: int
    enc_layers: int
    enc_hidden: int
    enc_heads: int
    enc_mlp: int
    dec_layers: int
    dec_hidden: int
    dec_heads: int
    dec_mlp: int
    vocab: int
    text_len: int
    max_text_len: int
    channels: int = 3
    enc_norm_eps: float = 1e-6    # timm ViT
    dec_norm_eps: float = 1e-12   # BERT

    arch = "blip"

    @property
    def layers(self) -> int:
        return self.enc_layers + self.dec_layers

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def image_tokens(self) -> int:
        """Patches plus the [CLS] token: the length of the image features."""
        return self.patches + 1

    def to_dict(self) -> dict:
        return {"arch": self.arch} | {f.name: getattr(self, f.name) for f in fields(self)}

    def is_encoder_layer(self, i: int) -> bool:
        return i < self.enc_layers

    def validate(self) -> BlipSpec:
        for key in ("image_size", "patch", "enc_layers", "enc_hidden", "enc_heads", "enc_mlp",
                    "dec_layers", "dec_hidden", "dec_heads", "dec_mlp", "vocab", "text_len",
                    "max_text_len", "channels"):
            if getattr(self, key) < 1:
                raise ValueError(f"blip {key}={getattr(self, key)} must be a positive integer")
        if self.image_size % self.patch:
            raise ValueError(f"image_size={self.image_size} is not a multiple of patch={self.patch}")
        for tower in ("enc", "dec"):
            hidden, heads = getattr(self, f"{tower}_hidden"), getattr(self, f"{tower}_heads")
            if hidden % heads:
                raise ValueError(f"blip {tower}_hidden={hidden} is not divisible by "
                                 f"{tower}_heads={heads}")
        if self.text_len > self.max_text_len:
            raise ValueError(f"text_len={self.text_len} exceeds the position table "
                             f"(max_text_len={self.max_text_len})")
        return self


# ViT-B/16 and ViT-L/16 (Dosovitskiy et al. 2021, Table 1); the decoder is BERT-base (Devlin et
# al. 2019) with cross-attention in every layer, and a vocabulary of BERT's 30522 word pieces plus
# BLIP's [DEC] and [ENC] tokens (Li et al. 2022, "BLIP", section 3.1 and their med.py); both
# BLIP sizes keep the BERT-base decoder, blip-large swaps only the image encoder. Captions are at
# most 40 tokens (BLIP's BLIP_Decoder pads to max_length=40).
BLIP_PRESETS: dict[str, BlipSpec] = {
    "blip-base": BlipSpec("blip-base", image_size=224, patch=16,
                          enc_layers=12, enc_hidden=768, enc_heads=12, enc_mlp=3072,
                          dec_layers=12, dec_hidden=768, dec_heads=12, dec_mlp=3072,
                          vocab=30524, text_len=40, max_text_len=512),
    "blip-large": BlipSpec("blip-large", image_size=224, patch=16,
                           enc_layers=24, enc_hidden=1024, enc_heads=16, enc_mlp=4096,
                           dec_layers=12, dec_hidden=768, dec_heads=12, dec_mlp=3072,
                           vocab=30524, text_len=40, max_text_len=512),
    # blip-base's proportions at CPU size: its 197 image tokens (14 x 14 patches + [CLS])
    # against 40 caption tokens, as many decoder as encoder layers, MLPs 4x wide; an encoder
    # layer costs 2.70 decoder layers in FLOPs (2.52 in blip-base; narrower, attention's p^2
    # term weighs more). Fewer tokens (64px images, 16-token captions) left per-op overheads
    # as large as the matmuls on CPU: an encoder layer then took ~1.5 decoder layers of time
    # against 2.26 in FLOPs. At these token counts CPU time follows FLOPs more closely (about
    # 2.1-2.5 against 2.70, docs/multimodal.md), and 30 steps of 8 pairs take seconds.
    "blip-tiny": BlipSpec("blip-tiny", image_size=112, patch=8,
                          enc_layers=4, enc_hidden=128, enc_heads=4, enc_mlp=512,
                          dec_layers=4, dec_hidden=128, dec_heads=4, dec_mlp=512,
                          vocab=512, text_len=40, max_text_len=64),
}


def resolve_blip(name: str) -> BlipSpec:
    """A preset name, or every field: `arch=blip,name=..,image_size=..,patch=..,...` (the form
    a converted checkpoint's shape takes, commpipe.models.hf.model_fields)."""
    if "=" in name:
        return parse_blip_fields(name)
    if name not in BLIP_PRESETS:
        raise ValueError(f"unknown BLIP model {name!r}; use one of {', '.join(BLIP_PRESETS)}")
    return BLIP_PRESETS[name]


def parse_blip_fields(text: str) -> BlipSpec:
    types = {f.name: f.type for f in fields(BlipSpec)}
    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = (s.strip() for s in part.partition("="))
        if key == "arch":
            continue
        if key not in types:
            raise ValueError(f"unknown blip field {key!r}; known fields: {', '.join(types)}")
        try:
            values[key] = value if key == "name" else \
                float(value) if types[key] in ("float", float) else int(value)
        except ValueError:
            raise ValueError(f"blip field {key}={value!r} is not a number") from None
    values.setdefault("name", "blip-custom")
    missing = [f.name for f in fields(BlipSpec) if f.name not in values
               and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"blip fields are missing {', '.join(missing)} (got {text!r})")
    return BlipSpec(**values).validate()


def is_blip(name: str) -> bool:
    return name in BLIP_PRESETS or "arch=blip" in name.replace(" ", "").split(",")


# ---------------------------------------------------------------------------------------------
# Parameters. Every linear layer has a bias (ViT and BERT do); LayerNorms have weight and bias.

def _linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def encoder_layer_params(spec: BlipSpec) -> int:
    h, f = spec.enc_hidden, spec.enc_mlp
    return 4 * _linear(h, h) + _linear(h, f) + _linear(f, h) + 2 * 2 * h


def decoder_layer_params(spec: BlipSpec) -> int:
    h, he, f = spec.dec_hidden, spec.enc_hidden, spec.dec_mlp
    self_attn = 4 * _linear(h, h)
    cross_attn = 2 * _linear(h, h) + 2 * _linear(he, h)   # q, o from text; k, v from image
    return self_attn + cross_attn + _linear(h, f) + _linear(f, h) + 3 * 2 * h


def vision_embed_params(spec: BlipSpec) -> int:
    """Patch projection (a conv with kernel = stride = patch), [CLS] token, positions."""
    he = spec.enc_hidden
    return _linear(spec.channels * spec.patch ** 2, he) + he + spec.image_tokens * he


def text_embed_params(spec: BlipSpec) -> int:
    h = spec.dec_hidden
    return spec.vocab * h + spec.max_text_len * h + 2 * h


def head_params(spec: BlipSpec) -> int:
    """BERT's LM head: dense + GELU + LayerNorm, then the (untied) vocabulary projection."""
    h = spec.dec_hidden
    return _linear(h, h) + 2 * h + _linear(h, spec.vocab)


def layer_params(spec: BlipSpec, i: int) -> int:
    """Parameters of layer i together with the pieces a stage holding it also holds: the
    vision embedding with layer 0, the encoder's final norm with its last layer, the text
    embedding with the first decoder layer, the head with the last layer."""
    n = encoder_layer_params(spec) if spec.is_encoder_layer(i) else decoder_layer_params(spec)
    if i == 0:
        n += vision_embed_params(spec)
    if i == spec.enc_layers - 1:
        n += 2 * spec.enc_hidden
    if i == spec.enc_layers:
        n += text_embed_params(spec)
    if i == spec.layers - 1:
        n += head_params(spec)
    return n


def param_count(spec: BlipSpec) -> int:
    return sum(layer_params(spec, i) for i in range(spec.layers))


# ---------------------------------------------------------------------------------------------
# FLOPs: 2 per multiply-add of every matmul, forward; training = 3x forward (backward = 2x), as
# `commpipe.models.spec.flops_per_token`. Causal self-attention is counted as the full s x s
# product (Narayanan et al. 2021, eq. 3); norms, softmax and GELU are ignored.

def encoder_layer_flops(spec: BlipSpec) -> int:
    """Forward FLOPs of one ViT block for one image (P image tokens, width he)."""
    p, he, f = spec.image_tokens, spec.enc_hidden, spec.enc_mlp
    return 2 * p * he * 4 * he + 2 * 2 * p * p * he + 2 * 2 * p * he * f


def decoder_layer_flops(spec: BlipSpec, text_len: int | None = None) -> int:
    """Forward FLOPs of one decoder block for one caption of s tokens. Cross-attention projects
    all P image tokens to K and V in every layer: for BLIP-base that is the largest matmul."""
    s = spec.text_len if text_len is None else text_len
    h, he, p, f = spec.dec_hidden, spec.enc_hidden, spec.image_tokens, spec.dec_mlp
    self_attn = 2 * s * h * 4 * h + 2 * 2 * s * s * h
    cross_attn = 2 * s * h * 2 * h + 2 * p * he * 2 * h + 2 * 2 * s * p * h
    return self_attn + cross_attn + 2 * 2 * s * h * f


def vision_embed_flops(spec: BlipSpec) -> int:
    return 2 * spec.patches * spec.channels * spec.patch ** 2 * spec.enc_hidden


def head_flops(spec: BlipSpec, text_len: int | None = None) -> int:
    s = spec.text_len if text_len is None else text_len
    return 2 * s * spec.dec_hidden * (spec.dec_hidden + spec.vocab)


def layer_flops(spec: BlipSpec, text_len: int | None = None) -> list[int]:
    """Forward FLOPs per sample of each layer, with the embedding and head FLOPs charged to the
    layer whose stage runs them (as `layer_params`): the predicted costs stage balancing uses."""
    out = []
    for i in range(spec.layers):
        n = encoder_layer_flops(spec) if spec.is_encoder_layer(i) \
            else decoder_layer_flops(spec, text_len)
        if i == 0:
            n += vision_embed_flops(spec)
        if i == spec.layers - 1:
            n += head_flops(spec, text_len)
        out.append(n)
    return out


def flops_per_sample(spec: BlipSpec, text_len: int | None = None, recompute: bool = False) -> int:
    """Training FLOPs (forward + backward) per image-caption pair; with recompute the layers'
    forward is counted once more (hardware FLOPs)."""
    fwd = layer_flops(spec, text_len)
    extra = sum(fwd) - vision_embed_flops(spec) - head_flops(spec, text_len)
    return 3 * sum(fwd) + (extra if recompute else 0)


# ---------------------------------------------------------------------------------------------
# Stage boundaries

def boundary(spec: BlipSpec, cut: int, micro_batch: int, text_len: int | None = None,
             dtype: str = "float32") -> tuple[TensorDesc, ...]:
    """What crosses a cut after the first `cut` layers (0 < cut < layers), forward direction;
    the gradients of the same tensors cross back. Inside the encoder that is the image hidden
    states; at the encoder's end its normed output, the image features; past it the text hidden
    states together with the image features, which every decoder stage reads in cross-attention
    and passes on, so their gradient coming back is the sum over all later decoder layers."""
    if not 0 < cut < spec.layers:
        raise ValueError(f"a cut lies after layer 1..{spec.layers - 1}, got {cut}")
    s = spec.text_len if text_len is None else text_len
    image = (micro_batch, spec.image_tokens, spec.enc_hidden)
    if cut < spec.enc_layers:
        return (TensorDesc("image_hidden", image, dtype),)
    image_features = TensorDesc("image_features", image, dtype)
    if cut == spec.enc_layers:
        return (image_features,)
    return (TensorDesc("text_hidden", (micro_batch, s, spec.dec_hidden), dtype), image_features)


def stage_io(spec: BlipSpec, stage_layers: list[int], micro_batch: int,
             text_len: int | None = None, dtype: str = "float32") -> list[StageIO]:
    """Per stage of a split (layer counts, first stage first): the batch fields it reads, what
    it receives from the stage before and sends to the stage after. Text tokens are read from
    the batch by the stage holding the first decoder layer (they are not carried through the
    encoder stages), labels by the last stage, which outputs the loss."""
    check_counts(stage_layers, spec.layers)
    s = spec.text_len if text_len is None else text_len
    out, start = [], 0
    for k, count in enumerate(stage_layers):
        layers = range(start, start + count)
        data = []
        if 0 in layers:
            data.append(TensorDesc("pixels", (micro_batch, spec.channels, spec.image_size,
                                              spec.image_size), dtype))
        if spec.enc_layers in layers:
            data.append(TensorDesc("tokens", (micro_batch, s), "int64"))
        if spec.layers - 1 in layers:
            data.append(TensorDesc("labels", (micro_batch, s), "int64"))
        recv = boundary(spec, start, micro_batch, s, dtype) if start > 0 else ()
        send = boundary(spec, layers.stop, micro_batch, s, dtype) if layers.stop < spec.layers \
            else ()
        out.append(StageIO(k, layers, tuple(data), recv, send))
        start += count
    return out
