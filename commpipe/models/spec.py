"""Model shapes: named presets, shapes given by fields, FLOPs and parameter counts.

A `ModelSpec` is pure data (no torch), so the planner and the simulator can reason about
llama3-405b without building it. `commpipe.models.llama` builds a trainable module from one.

    >>> spec = resolve_model("llama3-8b")
    >>> round(param_count(spec) / 1e9, 2)
    8.03
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

ARCHES = ("llama", "gpt")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    arch="llama": RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, untied head.
    arch="gpt": LayerNorm, learned positions, multi-head attention, GELU MLP (4h), tied head;
    gpt shapes are for FLOPs, memory and planning (training builds llama only).
    """

    name: str
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        """Width of the queries: the hidden size here (a MoE shape may set its head_dim apart
        from it: moe_spec.MoESpec)."""
        return self.heads * self.head_dim

    @property
    def o_width(self) -> int:
        """Width of the attention's output, the output projection's input: the hidden size here."""
        return self.heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> ModelSpec:
        if self.arch not in ARCHES:
            raise ValueError(f"model arch={self.arch!r} is unknown; use one of {', '.join(ARCHES)}")
        for key in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, key) < 1:
                raise ValueError(f"model {key}={getattr(self, key)} must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(
                f"model hidden={self.hidden} is not divisible by heads={self.heads}; "
                f"use heads in {divisors(self.hidden, limit=256)}"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                f"use kv_heads in {divisors(self.heads)}"
            )
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dim, got {self.head_dim}")
        return self


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Every d that divides n (at most `limit`), ascending: the valid degrees error messages list."""
    out = [d for d in range(1, n + 1) if n % d == 0]
    return [d for d in out if limit is None or d <= limit]


# Presets are plain functions of nothing; published shapes from the Llama 3 paper (Table 3).
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", "llama", layers=4, hidden=64, heads=4, kv_heads=2,
                      ffn_hidden=128, vocab=256, rope_theta=10000.0),
    "small": ModelSpec("small", "llama", layers=8, hidden=256, heads=8, kv_heads=4,
                       ffn_hidden=688, vocab=4096, rope_theta=10000.0),
    "llama3-8b": ModelSpec("llama3-8b", "llama", layers=32, hidden=4096, heads=32, kv_heads=8,
                           ffn_hidden=14336, vocab=128256),
    "llama-8b-32k": ModelSpec("llama-8b-32k", "llama", layers=32, hidden=4096, heads=32,
                              kv_heads=8, ffn_hidden=14336, vocab=32000),
    "llama3-70b": ModelSpec("llama3-70b", "llama", layers=80, hidden=8192, heads=64, kv_heads=8,
                            ffn_hidden=28672, vocab=128256),
    "llama3-405b": ModelSpec("llama3-405b", "llama", layers=126, hidden=16384, heads=128,
                             kv_heads=8, ffn_hidden=53248, vocab=128256),
}

_FIELD_ALIASES = {"layers": "layers", "num_layers": "layers", "hidden": "hidden",
                  "hidden_size": "hidden", "heads": "heads", "kv_heads": "kv_heads",
                  "ffn_hidden": "ffn_hidden", "ffn": "ffn_hidden", "vocab": "vocab",
                  "arch": "arch", "name": "name", "norm_eps": "norm_eps",
                  "rope_theta": "rope_theta"}


def parse_model_fields(text: str) -> ModelSpec:
    """Parse `arch=gpt,layers=96,hidden=12288,heads=96,vocab=51200[,kv_heads=..,ffn_hidden=..]`."""
    values: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"malformed model field {part!r}: write key=value, e.g. layers=32")
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in _FIELD_ALIASES:
            raise ValueError(
                f"unknown model field {key!r}; known fields: {', '.join(sorted(set(_FIELD_ALIASES)))}"
            )
        values[_FIELD_ALIASES[key]] = value
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in values]
    if missing:
        raise ValueError(f"model fields are missing {', '.join(missing)} (got {text!r})")
    arch = values.get("arch", "llama")
    types = {f.name: f.type for f in fields(ModelSpec)}
    parsed: dict = {}
    for key, value in values.items():
        if key in ("arch", "name"):
            parsed[key] = value
            continue
        try:
            parsed[key] = float(value) if types[key] in ("float", float) else int(value)
        except ValueError:
            raise ValueError(f"model field {key}={value!r} is not a number") from None
    hidden = parsed["hidden"]
    parsed.setdefault("kv_heads", parsed["heads"])
    parsed.setdefault("ffn_hidden", 4 * hidden if arch == "gpt" else _llama_ffn(hidden))
    parsed.setdefault("name", f"{arch}-L{parsed['layers']}-H{hidden}")
    parsed["arch"] = arch
    return ModelSpec(**parsed).validate()


def _llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256."""
    ffn = int(2 * 4 * hidden / 3)
    return multiple_of * ((ffn + multiple_of - 1) // multiple_of)


def resolve_model(name_or_fields: str) -> ModelSpec:
    """A preset name (`tiny`, `llama3-8b`, ...) or a field list (`arch=gpt,layers=...`)."""
    if "=" in name_or_fields:
        return parse_model_fields(name_or_fields)
    if name_or_fields not in PRESETS:
        raise ValueError(
            f"unknown model {name_or_fields!r}; use one of {', '.join(PRESETS)} "
            "or give fields like arch=llama,layers=32,hidden=4096,heads=32,vocab=32000"
        )
    return PRESETS[name_or_fields]


def with_vocab(spec: ModelSpec, vocab: int) -> ModelSpec:
    return replace(spec, vocab=vocab)


def layer_param_count(spec: ModelSpec) -> int:
    """Parameters of one transformer block."""
    h, q = spec.hidden, spec.q_width
    attn = h * (q + 2 * spec.kv_dim) + q * h
    if spec.arch == "gpt":
        # biases on QKV, out, both MLP matrices; two LayerNorms with weight and bias
        return attn + 3 * h + h + 2 * h * spec.ffn_hidden + spec.ffn_hidden + h + 4 * h
    return attn + 3 * h * spec.ffn_hidden + 2 * h


def param_count(spec: ModelSpec, seq_len: int = 2048) -> int:
    """Total parameters. llama: untied embedding and head; gpt: tied head, learned positions."""
    h, v = spec.hidden, spec.vocab
    body = spec.layers * layer_param_count(spec)
    if spec.arch == "gpt":
        return body + v * h + seq_len * h + 2 * h
    return body + 2 * v * h + h


def layer_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs per token of one transformer block: 2 per multiply-add of the Q/K/V
    projections (GQA-aware: K and V are kv_heads * head_dim wide), the attention scores and
    values (the full s x s product, causal or not), the output projection and the MLP (SwiGLU
    has three matrices, GPT two). The one definition every consumer prices work with: the
    planner, stage balancing (commpipe.parallel.balance) and the adaptive controller."""
    h, q = spec.hidden, spec.q_width
    qkv = 2 * h * (q + 2 * spec.kv_dim)
    attn = 2 * 2 * seq_len * q
    out = 2 * q * h
    mlp = 2 * (3 if spec.arch == "llama" else 2) * h * spec.ffn_hidden
    return float(qkv + attn + out + mlp)


def head_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of the vocabulary head."""
    return float(2 * spec.hidden * spec.vocab)


def flops_per_token(spec: ModelSpec, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward), Megatron-style matmul accounting.

    Every block's `layer_flops_per_token` plus the vocabulary head; backward is twice the
    forward (input- and weight-gradient GEMMs). Causal attention is counted as the full s x s
    product, as in Narayanan et al. (2021) eq. 3, so numbers compare with Megatron-LM's reported
    model TFLOP/s; norms, softmax and rotary embeddings are ignored. With recompute=True the
    forward of the layers is counted again (hardware FLOPs, as Megatron-LM's papers report them).
    `torch.utils.flop_counter.FlopCounterMode` counts exactly this on a training step
    (tests/test_plan_flops.py).

    For GPT shapes this is exactly 72 L h^2 (1 + s/(6h) + V/(12 L h)) per token.
    """
    passes = 4 if recompute else 3
    return spec.layers * layer_flops_per_token(spec, seq_len) * passes + head_flops_per_token(spec) * 3
