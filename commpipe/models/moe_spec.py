"""Mixture-of-Experts decoder shapes as pure data: presets, parameter counts (total and active per
token), FLOPs. The module is commpipe.models.moe; like `ModelSpec`, nothing here imports torch,
so the planner can reason about deepseek-v3 unbuilt.

A MoE decoder is a LLaMA decoder whose MLP, in every layer after the first `dense_layers`, is a
routed layer: a linear router scores `experts` SwiGLU experts of width `expert_ffn`, each token
goes to its `top_k` best (dropless: no capacity factor, no token dropped), and
`shared_experts` SwiGLU experts see every token. Attention is grouped-query (`attention="gqa"`)
or DeepSeek's multi-head latent attention (`attention="mla"`, DeepSeek-V2 section 2.1).

    >>> spec = resolve_moe("mixtral-8x7b")
    >>> round(param_count(spec) / 1e9, 2), round(active_param_count(spec) / 1e9, 2)
    (46.7, 12.88)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from commpipe.models.boundary import StageIO, TensorDesc, check_counts

GATES = ("softmax", "sigmoid")
ATTENTIONS = ("gqa", "mla")


@dataclass(frozen=True)
class MoESpec:
    """Shape of a MoE decoder (RMSNorm, rotary positions, SwiGLU experts, untied head).

    Routing (commpipe.models.moe.route):
      gate="softmax", norm_topk=True   Mixtral: softmax over the k selected logits (equal to the
                                       softmax over all experts renormalised over the top k)
      gate="softmax", norm_topk=False  Switch / DeepSeek-V2: the top-k softmax probabilities
      gate="sigmoid", norm_topk=True   DeepSeek-V3: sigmoid scores, the top k normalised to sum 1
    then times `route_scale` (DeepSeek-V3's routed_scaling_factor, 2.5). DeepSeek-V3's
    group-limited selection and bias-based (auxiliary-loss-free) balancing are not modelled:
    they change which experts a token picks, not the counts or FLOPs here.
    `aux_loss_coef` weighs the load-balancing loss (commpipe.models.moe.load_balance_loss).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int = 0
    dense_layers: int = 0          # the first layers have a dense SwiGLU MLP ...
    dense_ffn: int = 0             # ... of this width
    gate: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.01
    attention: str = "gqa"
    q_lora_rank: int = 0           # MLA: 0 projects queries directly from the hidden state
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    head_dim: int = 0              # grouped-query head width; 0: hidden / heads (Qwen3-MoE: 128),
    #                                filled in at construction (dataclasses.replace keeps it)

    arch = "moe"

    def __post_init__(self):
        if not self.head_dim and self.heads and self.hidden % self.heads == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def q_width(self) -> int:
        """Width of the grouped-query attention's queries: heads * head_dim (the hidden size
        unless head_dim is set apart from it). MLA's queries are its own (plan.attention)."""
        return self.heads * self.head_dim

    @property
    def o_width(self) -> int:
        """Width of the attention's output, the output projection's input: heads times the
        value head width (MLA: v_head_dim; grouped-query: head_dim)."""
        return self.heads * self.value_head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: what attention scores are dotted over."""
        return self.qk_nope_dim + self.qk_rope_dim if self.attention == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def ffn_hidden(self) -> int:
        """Width of a dense MLP in every layer, as the planner's layer machinery reads a
        `ModelSpec`: none. commpipe.plan.moe prices the dense (`dense_ffn`) and routed MLPs
        from `layer_form(spec).routed`, beside the attention the layer machinery prices."""
        return 0

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def to_dict(self) -> dict:
        return {"arch": self.arch} | {f.name: getattr(self, f.name) for f in fields(self)}

    def validate(self) -> MoESpec:
        for key in ("layers", "hidden", "heads", "kv_heads", "vocab", "experts", "top_k",
                    "expert_ffn"):
            if getattr(self, key) < 1:
                raise ValueError(f"moe model {key}={getattr(self, key)} must be a positive integer")
        if self.top_k > self.experts:
            raise ValueError(f"moe top_k={self.top_k} exceeds experts={self.experts}; "
                             f"use top_k <= {self.experts}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"moe dense_layers={self.dense_layers} must be in 0..{self.layers}")
        if self.dense_layers and self.dense_ffn < 1:
            raise ValueError(f"moe dense_layers={self.dense_layers} needs dense_ffn > 0")
        if self.gate not in GATES:
            raise ValueError(f"moe gate={self.gate!r} is unknown; use one of {', '.join(GATES)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"moe attention={self.attention!r} is unknown; "
                             f"use one of {', '.join(ATTENTIONS)}")
        if self.attention == "gqa":
            if self.heads % self.kv_heads:
                raise ValueError(f"moe heads={self.heads}, kv_heads={self.kv_heads}: kv_heads must "
                                 "divide heads")
            if self.head_dim < 1 or self.head_dim % 2:
                given = (f"head_dim={self.head_dim}" if self.head_dim
                         else f"hidden / heads = {self.hidden}/{self.heads}")
                raise ValueError(f"moe {given}: the head dim must be a positive even number "
                                 "(rotary embeddings rotate pairs); give head_dim= or make heads "
                                 "divide hidden into one")
        else:
            if self.heads and self.head_dim not in (0, self.hidden // self.heads):
                raise ValueError(f"moe head_dim={self.head_dim} is for grouped-query attention; "
                                 "attention=mla sizes its heads with qk_nope_dim, qk_rope_dim and "
                                 "v_head_dim: drop head_dim")
            for key in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
                if getattr(self, key) < 1:
                    raise ValueError(f"attention=mla needs {key} > 0")
            if self.qk_rope_dim % 2:
                raise ValueError(f"rotary embeddings need an even qk_rope_dim, got {self.qk_rope_dim}")
        return self


def tp_problem(spec: MoESpec, tp: int) -> str | None:
    """Why tensor parallelism of `tp` ranks cannot split this model's MLPs (every routed and
    shared expert and dense MLP is split by its width: commpipe.parallel.tensor_moe), or None."""
    widths = {"expert_ffn": spec.expert_ffn}
    if spec.shared_experts:
        widths["shared_experts*expert_ffn"] = spec.shared_experts * spec.expert_ffn
    if spec.dense_layers:
        widths["dense_ffn"] = spec.dense_ffn
    for name, width in widths.items():
        if width % tp:
            ok = [t for t in range(1, tp + 1) if all(w % t == 0 for w in widths.values())]
            return (f"--tp {tp} does not divide {name} = {width} (tensor parallelism splits "
                    f"every expert's width); use --tp in {ok}")
    return None


# Published shapes: Mixtral 8x7B (Jiang et al. 2024, and its config.json); DeepSeek-V3
# (DeepSeek-AI 2024, section 4.2, and its config.json). Their counts are tested against the
# published totals in tests/test_moe_model.py.
PRESETS: dict[str, MoESpec] = {
    "moe-tiny": MoESpec("moe-tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                        experts=4, top_k=2, expert_ffn=32, shared_experts=1, rope_theta=10000.0),
    "mixtral-8x7b": MoESpec("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                            vocab=32000, experts=8, top_k=2, expert_ffn=14336,
                            aux_loss_coef=0.02, rope_theta=1e6),
    "deepseek-v3": MoESpec("deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128,
                           vocab=129280, experts=256, top_k=8, expert_ffn=2048, shared_experts=1,
                           dense_layers=3, dense_ffn=18432, gate="sigmoid", norm_topk=True,
                           route_scale=2.5, aux_loss_coef=0.0001, attention="mla",
                           q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                           v_head_dim=128, norm_eps=1e-6, rope_theta=10000.0),
}


def is_moe(model: str) -> bool:
    """Is `--model` a MoE shape (a preset name here, or fields with arch=moe)?"""
    if "=" in model:
        return any(p.replace(" ", "") == "arch=moe" for p in model.split(","))
    return model in PRESETS


_INT_FIELDS = {f.name for f in fields(MoESpec) if f.type in ("int", int)}
_FLOAT_FIELDS = {f.name for f in fields(MoESpec) if f.type in ("float", float)}


def resolve_moe(model: str) -> MoESpec:
    """A preset name (`moe-tiny`, `mixtral-8x7b`, `deepseek-v3`) or fields
    `arch=moe,layers=..,hidden=..,heads=..,vocab=..,experts=..,top_k=..,expert_ffn=..[,...]`."""
    if "=" not in model:
        if model not in PRESETS:
            raise ValueError(f"unknown moe model {model!r}; use one of {', '.join(PRESETS)}")
        return PRESETS[model]
    values: dict = {}
    for part in model.split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"malformed model field {part!r}: write key=value, e.g. experts=8")
        key, value = (s.strip() for s in part.split("=", 1))
        if key == "arch":
            continue
        try:
            if key in _INT_FIELDS:
                values[key] = int(value)
            elif key in _FLOAT_FIELDS:
                values[key] = float(value)
            elif key == "norm_topk":
                values[key] = value.lower() in ("1", "true", "yes")
            elif key in ("gate", "attention", "name"):
                values[key] = value
            else:
                known = sorted(_INT_FIELDS | _FLOAT_FIELDS | {"gate", "attention", "norm_topk"})
                raise ValueError(f"unknown moe model field {key!r}; known fields: {', '.join(known)}")
        except ValueError as e:
            if "unknown" in str(e):
                raise
            raise ValueError(f"moe model field {key}={value!r} is not a number") from None
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "experts", "top_k", "expert_ffn")
               if k not in values]
    if missing:
        raise ValueError(f"moe model fields are missing {', '.join(missing)} (got {model!r})")
    values.setdefault("kv_heads", values["heads"])
    values.setdefault("name", f"moe-L{values['layers']}-H{values['hidden']}-E{values['experts']}")
    return MoESpec(**values).validate()


def stage_io(spec: MoESpec, stage_layers: list[int], micro_batch: int, seq_len: int,
             dtype: str = "float32") -> list:
    """What crosses each stage boundary (commpipe.models.boundary): the hidden states and the
    load-balancing term summed so far (one value), so the last stage can add it to the loss."""
    check_counts(stage_layers, spec.layers)
    carried = (TensorDesc("hidden", (micro_batch, seq_len, spec.hidden), dtype),
               TensorDesc("aux", (1,), dtype))
    tokens = TensorDesc("tokens", (micro_batch, seq_len), "int64")
    labels = TensorDesc("labels", (micro_batch, seq_len), "int64")
    out, start, last = [], 0, len(stage_layers) - 1
    for k, count in enumerate(stage_layers):
        data = ((tokens,) if k == 0 else ()) + ((labels,) if k == last else ())
        out.append(StageIO(k, range(start, start + count), data, carried if k > 0 else (),
                           carried if k < last else ()))
        start += count
    return out


def spec_from_dict(d: dict) -> MoESpec:
    return MoESpec(**{k: v for k, v in d.items() if k != "arch"}).validate()


# ---- parameters ------------------------------------------------------------------------------

def attention_param_count(spec: MoESpec) -> int:
    h = spec.hidden
    if spec.attention == "gqa":
        return h * (spec.q_width + 2 * spec.kv_dim) + spec.q_width * h
    nh, qk = spec.heads, spec.qk_head_dim
    q = h * spec.q_lora_rank + spec.q_lora_rank + spec.q_lora_rank * nh * qk if spec.q_lora_rank \
        else h * nh * qk
    kv = h * (spec.kv_lora_rank + spec.qk_rope_dim) + spec.kv_lora_rank \
        + spec.kv_lora_rank * nh * (spec.qk_nope_dim + spec.v_head_dim)
    return q + kv + nh * spec.v_head_dim * h


def swiglu_params(hidden: int, ffn: int) -> int:
    return 3 * hidden * ffn


def router_param_count(spec: MoESpec) -> int:
    """The router of one MoE layer: a hidden x experts linear, no bias."""
    return spec.hidden * spec.experts


def layer_param_count(spec: MoESpec, i: int, active: bool = False) -> int:
    """Parameters of block i; active=True counts only what one token uses (its top_k routed
    experts, every shared expert, the router)."""
    h = spec.hidden
    base = attention_param_count(spec) + 2 * h
    if not spec.is_moe_layer(i):
        return base + swiglu_params(h, spec.dense_ffn)
    routed = spec.top_k if active else spec.experts
    experts = (routed + spec.shared_experts) * swiglu_params(h, spec.expert_ffn)
    return base + router_param_count(spec) + experts


def param_count(spec: MoESpec, seq_len: int = 0) -> int:
    """Total parameters: every block, untied embedding and head, final norm."""
    return sum(layer_param_count(spec, i) for i in range(spec.layers)) + 2 * spec.vocab * spec.hidden \
        + spec.hidden


def active_param_count(spec: MoESpec) -> int:
    """Parameters one token passes through (embedding row counted as the whole table, as
    Mistral's and DeepSeek's published active counts do)."""
    return sum(layer_param_count(spec, i, active=True) for i in range(spec.layers)) \
        + 2 * spec.vocab * spec.hidden + spec.hidden


# ---- FLOPs -----------------------------------------------------------------------------------

def attention_flops_per_token(spec: MoESpec, seq_len: int) -> float:
    """Forward FLOPs per token of the attention projections (2 per multiply-add; MLA's latent
    norms are not matmuls) plus scores and values over the full s x s product."""
    proj = 2 * (attention_param_count(spec) - (spec.q_lora_rank + spec.kv_lora_rank
                                               if spec.attention == "mla" else 0))
    core = 2 * seq_len * spec.heads * (spec.qk_head_dim + spec.value_head_dim)
    return float(proj + core)


def layer_flops_per_token(spec: MoESpec, seq_len: int, i: int) -> float:
    """Forward FLOPs per token of block i: attention, then the dense MLP or the router plus the
    top_k routed and every shared expert. Dropless routing sends each token to exactly top_k
    experts, so this is exact, whatever the routing."""
    h = spec.hidden
    if not spec.is_moe_layer(i):
        mlp = 2 * swiglu_params(h, spec.dense_ffn)
    else:
        mlp = 2 * h * spec.experts \
            + 2 * (spec.top_k + spec.shared_experts) * swiglu_params(h, spec.expert_ffn)
    return attention_flops_per_token(spec, seq_len) + float(mlp)


def head_flops_per_token(spec: MoESpec) -> float:
    return float(2 * spec.hidden * spec.vocab)


def flops_per_token(spec: MoESpec, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), active experts only; the same
    Megatron-style matmul accounting as commpipe.models.spec.flops_per_token (norms, softmax,
    rotary, the gate's softmax/sigmoid and the combine's weighted sum are not counted)."""
    passes = 4 if recompute else 3
    body = sum(layer_flops_per_token(spec, seq_len, i) for i in range(spec.layers))
    return body * passes + head_flops_per_token(spec) * 3
