"""BLIP <-> Hugging Face `BlipForConditionalGeneration`: names and shapes.

commpipe's layers `layers.<i>` run the ViT blocks first (Hugging Face's
`vision_model.encoder.layers.<i>`), then the decoder blocks (`text_decoder.bert.encoder.layer.<j>`
as layer enc_layers + j). Hugging Face fuses the ViT's q, k and v into one `qkv` projection
(rows q, then k, then v: `BlipAttention` in transformers' modeling_blip.py); commpipe keeps three.
The LM head's weight is tied to the word embedding by tie_word_embeddings, its bias always to
`cls.predictions.bias`; commpipe's head is untied (the embedding may sit on another stage).
"""

from __future__ import annotations

import copy as _copy

import torch

from commpipe.models.blip_spec import BlipSpec
from commpipe.models.hf import Family, Rule, Tie, copy, meta_parameters, register

# BlipVisionConfig's and BlipTextConfig's defaults (transformers' configuration_blip.py)
VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "image_size": 384, "patch_size": 16, "hidden_act": "gelu",
          "layer_norm_eps": 1e-5}
TEXT = {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072,
        "num_hidden_layers": 12, "num_attention_heads": 8, "max_position_embeddings": 512,
        "hidden_act": "gelu", "layer_norm_eps": 1e-12}
TEXT_LEN = 40   # BLIP's captions are at most 40 tokens (commpipe.models.blip_spec)


def spec_from_config(config: dict, name: str) -> BlipSpec:
    vision = VISION | (config.get("vision_config") or {})
    text = TEXT | (config.get("text_config") or {})
    for tower, c in (("vision_config", vision), ("text_config", text)):
        if c["hidden_act"] != "gelu":
            raise ValueError(f"config.json {tower}.hidden_act={c['hidden_act']!r}; commpipe's "
                             "BLIP uses gelu")
    if text.get("encoder_hidden_size", vision["hidden_size"]) != vision["hidden_size"]:
        raise ValueError("config.json text_config.encoder_hidden_size differs from "
                         "vision_config.hidden_size: the decoder cross-attends to the ViT output")
    for key in ("image_size", "patch_size"):
        if not isinstance(vision[key], int):
            raise ValueError(f"config.json vision_config.{key}={vision[key]}: commpipe's BLIP "
                             "takes square images (one integer)")
    return BlipSpec(name=name, image_size=vision["image_size"], patch=vision["patch_size"],
                    enc_layers=vision["num_hidden_layers"], enc_hidden=vision["hidden_size"],
                    enc_heads=vision["num_attention_heads"], enc_mlp=vision["intermediate_size"],
                    dec_layers=text["num_hidden_layers"], dec_hidden=text["hidden_size"],
                    dec_heads=text["num_attention_heads"], dec_mlp=text["intermediate_size"],
                    vocab=text["vocab_size"], text_len=min(TEXT_LEN, text["max_position_embeddings"]),
                    max_text_len=text["max_position_embeddings"],
                    enc_norm_eps=float(vision["layer_norm_eps"]),
                    dec_norm_eps=float(text["layer_norm_eps"])).validate()


def config_from_spec(spec: BlipSpec, origin: dict | None) -> dict:
    config = _copy.deepcopy(origin) if origin else {
        "architectures": ["BlipForConditionalGeneration"], "model_type": "blip",
        "tie_word_embeddings": False, "label_smoothing": 0.0,
        "text_config": {"model_type": "blip_text_model", "hidden_act": "gelu", "is_decoder": True,
                        "tie_word_embeddings": False},
        "vision_config": {"model_type": "blip_vision_model", "hidden_act": "gelu"}}
    config.setdefault("vision_config", {}).update(
        hidden_size=spec.enc_hidden, intermediate_size=spec.enc_mlp,
        num_hidden_layers=spec.enc_layers, num_attention_heads=spec.enc_heads,
        image_size=spec.image_size, patch_size=spec.patch, layer_norm_eps=spec.enc_norm_eps)
    config.setdefault("text_config", {}).update(
        vocab_size=spec.vocab, hidden_size=spec.dec_hidden, encoder_hidden_size=spec.enc_hidden,
        intermediate_size=spec.dec_mlp, num_hidden_layers=spec.dec_layers,
        num_attention_heads=spec.dec_heads, max_position_embeddings=spec.max_text_len,
        layer_norm_eps=spec.dec_norm_eps)
    return config


def _wb(ours: str, theirs: str) -> list[Rule]:
    return [copy(f"{ours}.weight", f"{theirs}.weight"), copy(f"{ours}.bias", f"{theirs}.bias")]


def _split_qkv(*qkv):
    return tuple(t for pair in zip(*(x.chunk(3) for x in qkv)) for t in pair)


def _fuse_qkv(qw, qb, kw, kb, vw, vb):
    return torch.cat([qw, kw, vw]), torch.cat([qb, kb, vb])


def rules(spec: BlipSpec) -> list[Rule]:
    v, t = "vision_model.", "text_decoder."
    out = [copy("vision_embed.cls_token", f"{v}embeddings.class_embedding"),
           copy("vision_embed.positions", f"{v}embeddings.position_embedding"),
           *_wb("vision_embed.proj", f"{v}embeddings.patch_embedding"),
           *_wb("vision_norm", f"{v}post_layernorm"),
           copy("text_embed.words.weight", f"{t}bert.embeddings.word_embeddings.weight"),
           copy("text_embed.positions.weight", f"{t}bert.embeddings.position_embeddings.weight"),
           *_wb("text_embed.norm", f"{t}bert.embeddings.LayerNorm"),
           *_wb("head.dense", f"{t}cls.predictions.transform.dense"),
           *_wb("head.norm", f"{t}cls.predictions.transform.LayerNorm"),
           copy("head.output.weight", f"{t}cls.predictions.decoder.weight"),
           copy("head.output.bias", f"{t}cls.predictions.bias")]
    for i in range(spec.enc_layers):
        c, h = f"layers.{i}.", f"{v}encoder.layers.{i}."
        qkv = tuple(f"{c}attention.{w}.{k}" for w in ("wq", "wk", "wv") for k in ("weight", "bias"))
        out += [Rule(qkv, (f"{h}self_attn.qkv.weight", f"{h}self_attn.qkv.bias"),
                     _split_qkv, _fuse_qkv),
                *_wb(f"{c}attention.wo", f"{h}self_attn.projection"),
                *_wb(f"{c}attention_norm", f"{h}layer_norm1"),
                *_wb(f"{c}mlp_norm", f"{h}layer_norm2"),
                *_wb(f"{c}mlp.fc1", f"{h}mlp.fc1"), *_wb(f"{c}mlp.fc2", f"{h}mlp.fc2")]
    for j in range(spec.dec_layers):
        c, h = f"layers.{spec.enc_layers + j}.", f"{t}bert.encoder.layer.{j}."
        for ours, theirs in (("attention", "attention"), ("cross_attention", "crossattention")):
            out += [*_wb(f"{c}{ours}.wq", f"{h}{theirs}.self.query"),
                    *_wb(f"{c}{ours}.wk", f"{h}{theirs}.self.key"),
                    *_wb(f"{c}{ours}.wv", f"{h}{theirs}.self.value"),
                    *_wb(f"{c}{ours}.wo", f"{h}{theirs}.output.dense"),
                    *_wb(f"{c}{ours}_norm", f"{h}{theirs}.output.LayerNorm")]
        out += [*_wb(f"{c}mlp.fc1", f"{h}intermediate.dense"), *_wb(f"{c}mlp.fc2", f"{h}output.dense"),
                *_wb(f"{c}mlp_norm", f"{h}output.LayerNorm")]
    return out


def parameters(spec: BlipSpec) -> dict[str, tuple[int, ...]]:
    from commpipe.models.blip import Blip

    return meta_parameters(lambda: Blip(spec))


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", True))


def _set_tied(config: dict, tied: bool) -> None:
    config["tie_word_embeddings"] = tied
    config.setdefault("text_config", {})["tie_word_embeddings"] = tied


FAMILY = register(Family(
    arch="blip", model_types=("blip",), architecture="BlipForConditionalGeneration",
    spec_from_config=spec_from_config, config_from_spec=config_from_spec, rules=rules,
    ties=lambda spec: [Tie("text_decoder.cls.predictions.decoder.weight",
                           "text_decoder.bert.embeddings.word_embeddings.weight"),
                       Tie("text_decoder.cls.predictions.decoder.bias",
                           "text_decoder.cls.predictions.bias", by_config=False)],
    tied=_tied, set_tied=_set_tied, parameters=parameters,
    derived=(r"\.position_ids$",)))
