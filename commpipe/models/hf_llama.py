"""LLaMA <-> Hugging Face `LlamaForCausalLM` (Llama 2 and Llama 3 configs): names and shapes.

Rotary layouts differ. commpipe rotates adjacent pairs (x[2i], x[2i+1]) of each head, as
Meta's reference code does (`commpipe.models.llama.apply_rope`); Hugging Face rotates
(x[i], x[i + head_dim/2]) (`rotate_half` in transformers' modeling_llama.py), and its
conversion script permutes the q and k rows to match (`permute` in convert_llama_weights_to_hf.py).
The rules here undo that permutation on the way in and redo it on the way out.
"""

from __future__ import annotations

import copy as _copy

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
from commpipe.models.spec import ModelSpec

# LlamaConfig's defaults (transformers' configuration_llama.py), for keys a config.json omits
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False}


def halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows of Hugging Face's rotary layout -> commpipe's: in each head, row i + half *
    head_dim/2 (half 0 or 1) moves to row 2i + half. [heads * head_dim, in]"""
    out, n_in = w.shape[0], w.shape[1:]
    return w.reshape(heads, 2, out // heads // 2, *n_in).transpose(1, 2).reshape(out, *n_in)


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `halves_to_pairs`."""
    out, n_in = w.shape[0], w.shape[1:]
    return w.reshape(heads, out // heads // 2, 2, *n_in).transpose(1, 2).reshape(out, *n_in)


def _get(config: dict, key: str):
    return config.get(key, DEFAULTS[key])


def rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}          # transformers >= 5 writes it here
    return float(params.get("rope_theta", config.get("rope_theta", DEFAULTS["rope_theta"])))


def spec_from_config(config: dict, name: str) -> ModelSpec:
    """A ModelSpec from a LlamaForCausalLM config.json; what commpipe's LLaMA does not
    implement is refused, naming the key."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json has rope type {kind!r} (rope_scaling); commpipe's rotary "
                         "embedding is the unscaled one of Llama 2 and Llama 3 (rope_type "
                         "default): convert a checkpoint without rope scaling")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"config.json sets {key}: commpipe's LLaMA has no biases")
    if _get(config, "hidden_act") != "silu":
        raise ValueError(f"config.json has hidden_act={config['hidden_act']!r}; commpipe's "
                         "LLaMA MLP is SwiGLU (silu)")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    if config.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"config.json has head_dim={config['head_dim']}, commpipe's LLaMA uses "
                         f"hidden_size / num_attention_heads = {hidden // heads}")
    return ModelSpec(name=name, arch="llama", layers=_get(config, "num_hidden_layers"),
                     hidden=hidden, heads=heads,
                     kv_heads=_get(config, "num_key_value_heads") or heads,
                     ffn_hidden=_get(config, "intermediate_size"), vocab=_get(config, "vocab_size"),
                     norm_eps=float(_get(config, "rms_norm_eps")),
                     rope_theta=rope_theta(config)).validate()


def config_from_spec(spec: ModelSpec, origin: dict | None) -> dict:
    """config.json for `spec`: the imported one with the shape fields set, or a new one."""
    config = _copy.deepcopy(origin) if origin else {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "max_position_embeddings": 2048, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": "float32", "rope_scaling": None}
    config.update(vocab_size=spec.vocab, hidden_size=spec.hidden,
                  intermediate_size=spec.ffn_hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  rms_norm_eps=spec.norm_eps)
    if "head_dim" in config:
        config["head_dim"] = spec.head_dim
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"]["rope_theta"] = spec.rope_theta
    else:
        config["rope_theta"] = spec.rope_theta
    return config


def end_rules() -> list[Rule]:
    """The embedding, final norm and head of a LLaMA-style decoder (LLaMA, Mixtral)."""
    return [copy("tok_embeddings.weight", "model.embed_tokens.weight"),
            copy("norm.weight", "model.norm.weight"), copy("output.weight", "lm_head.weight")]


def attention_rules(c: str, h: str, heads: int, kv_heads: int) -> list[Rule]:
    """Layer `c` (commpipe) / `h` (Hugging Face)'s attention: q and k rows permuted between the
    rotary layouts, v and o copied."""
    out = [Rule((f"{c}attention.{ours}.weight",), (f"{h}self_attn.{theirs}.weight",),
                lambda w, n=n: (halves_to_pairs(w, n),), lambda w, n=n: (pairs_to_halves(w, n),))
           for ours, theirs, n in (("wq", "q_proj", heads), ("wk", "k_proj", kv_heads))]
    return out + [copy(f"{c}attention.wv.weight", f"{h}self_attn.v_proj.weight"),
                  copy(f"{c}attention.wo.weight", f"{h}self_attn.o_proj.weight")]


def norm_rules(c: str, h: str) -> list[Rule]:
    return [copy(f"{c}attention_norm.weight", f"{h}input_layernorm.weight"),
            copy(f"{c}ffn_norm.weight", f"{h}post_attention_layernorm.weight")]


def rules(spec: ModelSpec) -> list[Rule]:
    out = end_rules()
    for i in range(spec.layers):
        c, h = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(c, h, spec.heads, spec.kv_heads)
        out += [copy(f"{c}feed_forward.w1.weight", f"{h}mlp.gate_proj.weight"),
                copy(f"{c}feed_forward.w3.weight", f"{h}mlp.up_proj.weight"),
                copy(f"{c}feed_forward.w2.weight", f"{h}mlp.down_proj.weight")]
        out += norm_rules(c, h)
    return out


def parameters(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    from commpipe.models.llama import Transformer

    return meta_parameters(lambda: Transformer(spec))


FAMILY = register(Family(
    arch="llama", model_types=("llama",), architecture="LlamaForCausalLM",
    spec_from_config=spec_from_config, config_from_spec=config_from_spec, rules=rules,
    ties=lambda spec: [Tie("lm_head.weight", "model.embed_tokens.weight")],
    tied=lambda config: bool(_get(config, "tie_word_embeddings")), set_tied=set_tie_word_embeddings,
    parameters=parameters, derived=(r"\.rotary_emb\.inv_freq$",)))
