"""MoE <-> Hugging Face `MixtralForCausalLM`: names, shapes and the config fields that matter.

The semantics, read against transformers' models/mixtral/modeling_mixtral.py:
- router: `MixtralTopKRouter` takes the softmax over all experts, keeps the top k and divides
  them by their sum; commpipe's gate="softmax", norm_topk=True (the softmax over the k selected
  logits) is the same function (commpipe.models.moe.gate_scores), route_scale 1.
- experts: SwiGLU w2(silu(w1 x) * w3 x), as commpipe's `GroupedExperts`, which stacks them
  ([experts, ffn, hidden] for w1 and w3, [experts, hidden, ffn] for w2). save_pretrained writes
  one tensor per expert, `block_sparse_moe.experts.<e>.w{1,2,3}.weight` (also what Mistral's
  own checkpoints hold); transformers >= 5 holds them fused in memory (`mlp.experts.gate_up_proj`
  = [w1; w3] per expert, `mlp.experts.down_proj`, router `mlp.gate`), and a folder in that
  layout is read too (`per_expert`); folders are written per expert, which transformers loads.
- rotary: Hugging Face's rotate-half layout; the q and k rows are permuted as for LLaMA
  (commpipe.models.hf_llama.halves_to_pairs).
- the balancing loss: Hugging Face adds router_aux_loss_coef times its loss only when
  output_router_logits is set, and pools the router statistics of all layers into one Switch
  loss (`load_balancing_loss_func`), top_k times commpipe's per-layer loss
  (commpipe.models.moe.load_balance_loss). So output_router_logits false (Mixtral's published
  config) is aux_loss_coef 0, one MoE layer is aux_loss_coef = top_k x router_aux_loss_coef,
  and a pooled loss over several layers has no commpipe equivalent and is refused.
What the MoE decoder does not model (sliding-window attention shorter than the context,
router jitter, attention dropout, rope scaling, biases) is refused, naming the key.
"""

from __future__ import annotations

import copy as _copy
import re

import torch

from commpipe.models.hf import (
    Family,
    Rule,
    Tie,
    copy,
    meta_parameters,
    register,
    set_tie_word_embeddings,
)
from commpipe.models.hf_llama import attention_rules, end_rules, norm_rules, rope_theta
from commpipe.models.moe_spec import MoESpec

# MixtralConfig's defaults (transformers' configuration_mixtral.py), for keys a config omits
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "hidden_act": "silu", "tie_word_embeddings": False,
            "max_position_embeddings": 4096 * 32, "sliding_window": None,
            "output_router_logits": False, "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0, "attention_dropout": 0.0}

# commpipe's expert matrices and Mixtral's, same roles: gate (w1), down (w2), up (w3)
EXPERT_NAMES = (("w1", "w1"), ("w2", "w2"), ("w3", "w3"))


def _get(config: dict, key: str):
    value = config.get(key, DEFAULTS[key])
    return DEFAULTS[key] if value is None and key == "num_key_value_heads" else value


def aux_loss_coef(config: dict) -> float:
    """commpipe's aux_loss_coef for the balancing loss Hugging Face's MixtralForCausalLM adds
    to its loss under this config (see the module docstring)."""
    coef = float(_get(config, "router_aux_loss_coef"))
    if not _get(config, "output_router_logits") or coef == 0:
        return 0.0
    layers = _get(config, "num_hidden_layers")
    if layers > 1:
        raise ValueError(
            f"config.json sets output_router_logits with router_aux_loss_coef={coef}: Hugging "
            f"Face's Mixtral pools the router statistics of all {layers} layers into one "
            "balancing loss, commpipe's MoE adds one per layer (Switch Transformer's), so the "
            "training objectives differ; set output_router_logits to false in config.json to "
            "convert without the balancing loss (commpipe's aux_loss_coef 0)")
    return coef * _get(config, "num_experts_per_tok")


def spec_from_config(config: dict, name: str) -> MoESpec:
    """A MoESpec from a MixtralForCausalLM config.json; what commpipe's MoE decoder does not
    implement is refused, naming the key."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json has rope type {kind!r} (rope_scaling); commpipe's rotary "
                         "embedding is the unscaled one (rope_type default): convert a "
                         "checkpoint without rope scaling")
    if _get(config, "hidden_act") != "silu":
        raise ValueError(f"config.json has hidden_act={config['hidden_act']!r}; commpipe's "
                         "experts are SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"config.json sets {key}: commpipe's MoE decoder has no biases")
    for key, what in (("router_jitter_noise", "multiplies the router's input by noise"),
                      ("attention_dropout", "drops attention weights")):
        if _get(config, key):
            raise ValueError(f"config.json has {key}={config[key]}: Hugging Face's Mixtral "
                             f"{what} in training, commpipe's MoE decoder does not; set it "
                             "to 0.0 in config.json to convert")
    window, context = _get(config, "sliding_window"), _get(config, "max_position_embeddings")
    if window is not None and window < context:
        raise ValueError(
            f"config.json has sliding_window={window} (max_position_embeddings={context}): "
            f"Hugging Face's Mixtral attends to the last {window} tokens only, commpipe's "
            f"attention is full causal; the two agree on sequences of at most {window} tokens: "
            "if you train on those, set sliding_window to null in config.json")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    return MoESpec(name=name, layers=_get(config, "num_hidden_layers"), hidden=hidden,
                   head_dim=config.get("head_dim") or 0,
                   heads=heads, kv_heads=_get(config, "num_key_value_heads"),
                   vocab=_get(config, "vocab_size"), experts=_get(config, "num_local_experts"),
                   top_k=_get(config, "num_experts_per_tok"),
                   expert_ffn=_get(config, "intermediate_size"), gate="softmax", norm_topk=True,
                   route_scale=1.0, aux_loss_coef=aux_loss_coef(config), attention="gqa",
                   norm_eps=float(_get(config, "rms_norm_eps")),
                   rope_theta=rope_theta(config)).validate()


def check_mixtral(spec: MoESpec) -> None:
    """Refuse a commpipe MoE shape that MixtralForCausalLM cannot compute, naming the field."""
    for key, want in (("attention", "gqa"), ("shared_experts", 0), ("dense_layers", 0),
                      ("gate", "softmax"), ("norm_topk", True), ("route_scale", 1.0)):
        if getattr(spec, key) != want:
            raise ValueError(f"{spec.name} has {key}={getattr(spec, key)}; Hugging Face's "
                             f"MixtralForCausalLM has {key}={want}, so it cannot hold this model")


def config_from_spec(spec: MoESpec, origin: dict | None) -> dict:
    """config.json for `spec`: the imported one with the shape fields set, or a new one."""
    check_mixtral(spec)
    config = _copy.deepcopy(origin) if origin else {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "attention_dropout": 0.0, "tie_word_embeddings": False, "sliding_window": None,
        "max_position_embeddings": DEFAULTS["max_position_embeddings"], "head_dim": None,
        "initializer_range": 0.02, "use_cache": True, "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "router_jitter_noise": 0.0,
        "output_router_logits": False, "router_aux_loss_coef": DEFAULTS["router_aux_loss_coef"]}
    config.update(vocab_size=spec.vocab, hidden_size=spec.hidden,
                  intermediate_size=spec.expert_ffn, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  num_local_experts=spec.experts, num_experts_per_tok=spec.top_k,
                  rms_norm_eps=spec.norm_eps)
    if config.get("head_dim") is not None or spec.q_width != spec.hidden:
        config["head_dim"] = spec.head_dim
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = spec.rope_theta
    else:
        config["rope_theta"] = spec.rope_theta
    _set_aux(config, spec)
    return config


def _set_aux(config: dict, spec: MoESpec) -> None:
    """router_aux_loss_coef and output_router_logits for spec.aux_loss_coef; the imported
    values stay when they mean it. Over several layers Hugging Face's pooled loss is another
    objective: output_router_logits stays off and the coefficient is the per-layer one / top_k."""
    try:
        if aux_loss_coef(config) == spec.aux_loss_coef:
            return
    except ValueError:
        pass
    if spec.aux_loss_coef == 0:
        config["output_router_logits"] = False
        return
    config["router_aux_loss_coef"] = spec.aux_loss_coef / spec.top_k
    config["output_router_logits"] = spec.layers == 1


def rules(spec: MoESpec) -> list[Rule]:
    out = end_rules()
    for i in range(spec.layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(c, h, spec.heads, spec.kv_heads) + norm_rules(c, h)
        out.append(copy(f"{c}feed_forward.router.weight", f"{h}block_sparse_moe.gate.weight"))
        for ours, theirs in EXPERT_NAMES:   # [experts, ...] <-> one tensor per expert
            out.append(Rule((f"{c}feed_forward.experts.{ours}",),
                            tuple(f"{h}block_sparse_moe.experts.{e}.{theirs}.weight"
                                  for e in range(spec.experts)),
                            lambda *ws: (torch.stack(ws),),
                            lambda w: tuple(t.clone() for t in w.unbind(0))))
    return out


_FUSED = re.compile(r"^(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|"
                    r"experts\.down_proj)$")


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers >= 5's in-memory layout (`mlp.gate`, `mlp.experts.gate_up_proj` [E, 2 ffn,
    h] with gate rows then up rows, `mlp.experts.down_proj` [E, h, ffn]; the MixtralExperts
    module) renamed and split into the per-expert layout the rules read; others pass through."""
    out = {}
    for name, t in tensors.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        base, kind = f"{m.group(1)}block_sparse_moe.", m.group(2)
        if kind == "gate.weight":
            out[base + "gate.weight"] = t
            continue
        for e, w in enumerate(t.unbind(0)):
            parts = w.chunk(2, dim=0) if kind == "experts.gate_up_proj" else (w,)
            names = ("w1", "w3") if kind == "experts.gate_up_proj" else ("w2",)
            for n, part in zip(names, parts, strict=True):
                out[f"{base}experts.{e}.{n}.weight"] = part
    return out


def parameters(spec: MoESpec) -> dict[str, tuple[int, ...]]:
    from commpipe.models.moe import MoETransformer

    return meta_parameters(lambda: MoETransformer(spec))


FAMILY = register(Family(
    arch="moe", model_types=("mixtral",), architecture="MixtralForCausalLM",
    spec_from_config=spec_from_config, config_from_spec=config_from_spec, rules=rules,
    ties=lambda spec: [Tie("lm_head.weight", "model.embed_tokens.weight")],
    tied=lambda config: bool(_get(config, "tie_word_embeddings")), set_tied=set_tie_word_embeddings,
    parameters=parameters, derived=(r"\.rotary_emb\.inv_freq$",), canonical=per_expert))
