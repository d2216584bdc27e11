"""Hugging Face checkpoints in and out: one name and shape mapping per model family.

A family registers how a Hugging Face `config.json` becomes a commpipe spec and back, and a
list of `Rule`s: which Hugging Face tensors make which commpipe parameters, and how (a copy, a
row permutation, a split of a fused projection). The same rules run both ways, so a Hugging
Face folder converted to commpipe and back is bit-identical. Reading and writing the folders
(safetensors + config.json) is here too; the commpipe side (a checkpoint any layout loads) is
`commpipe.train.weights`, and the `commpipe convert` verb is `commpipe.convert`.

    >>> from commpipe.models.hf import family_for_config
    >>> family_for_config({"model_type": "llama"}).arch
    'llama'
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Rule:
    """commpipe parameters `commpipe` <-> Hugging Face tensors `hf`. `to_commpipe` takes the hf
    tensors and returns the commpipe ones (in order), `to_hf` the reverse; None: a copy."""

    commpipe: tuple[str, ...]
    hf: tuple[str, ...]
    to_commpipe: Callable | None = None
    to_hf: Callable | None = None


def copy(commpipe: str, hf: str) -> Rule:
    return Rule((commpipe,), (hf,))


@dataclass(frozen=True)
class Tie:
    """Hugging Face tensor `alias` equals `source` and is left out of the file when tied: by
    the config's tie_word_embeddings (`by_config`) or always (one Parameter in the module)."""

    alias: str
    source: str
    by_config: bool = True


@dataclass(frozen=True)
class Family:
    arch: str                                   # commpipe's arch: "llama", "blip"
    model_types: tuple[str, ...]                # config.json's model_type values
    architecture: str                           # the Hugging Face class written on export
    spec_from_config: Callable                  # (config dict, name) -> spec
    config_from_spec: Callable                  # (spec, config dict of origin or None) -> dict
    rules: Callable                             # spec -> [Rule]
    ties: Callable                              # spec -> [Tie]
    tied: Callable                              # config -> bool (tie_word_embeddings)
    set_tied: Callable                          # (config, bool) -> None
    parameters: Callable                        # spec -> {commpipe name: shape}
    derived: tuple[str, ...] = field(default=())  # regexes of buffers recomputed, not stored
    # tensors of another layout a folder may hold -> the names and shapes the rules read
    canonical: Callable | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.arch] = family
    return family


def _load_families() -> None:
    # each module registers itself on import; models/ holds one per family
    from commpipe.models import hf_blip, hf_llama, hf_moe  # noqa: F401


def family_for_arch(arch: str) -> Family:
    _load_families()
    if arch not in FAMILIES:
        raise ValueError(f"no Hugging Face mapping for arch={arch}; commpipe converts "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]


def family_for_config(config: dict) -> Family:
    _load_families()
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
    raise ValueError(f"config.json has model_type={model_type!r}; commpipe converts {known}")


def spec_from_dict(d: dict):
    """The spec a checkpoint's commpipe.json records (`spec.to_dict()`), rebuilt by its family."""
    from commpipe.models.family import spec_from_dict

    return spec_from_dict(d)


def model_fields(spec) -> str:
    """The --model value that resolves to `spec`: its fields, `arch=...,layers=...`."""
    return ",".join(f"{k}={v}" for k, v in spec.to_dict().items())


def spec_name(folder: Path, fallback: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(folder).resolve().name).strip("-")
    return name or fallback


# -- tensors: Hugging Face -> commpipe -> Hugging Face -------------------------------------------
def to_commpipe(family: Family, spec, config: dict, tensors: dict[str, torch.Tensor],
                where: str = "the checkpoint") -> tuple[dict[str, torch.Tensor], dict]:
    """commpipe's full parameters (float32, its master weights) from Hugging Face tensors, and
    the origin record that lets `to_hf` write the same folder back (config, keys, dtypes)."""
    tensors = family.canonical(tensors) if family.canonical else dict(tensors)
    given = set(tensors)
    for tie in family.ties(spec):
        if tie.source not in tensors and tie.alias in tensors and not tie.by_config:
            tensors[tie.source] = tensors[tie.alias]     # one Parameter, saved under either name
        if tie.alias not in tensors and tie.source in tensors:
            if tie.by_config and not family.tied(config):
                raise ValueError(f"{where} has no tensor {tie.alias} and its config does not tie "
                                 f"it to {tie.source} (tie_word_embeddings is false)")
            tensors[tie.alias] = tensors[tie.source]
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for rule in family.rules(spec):
        missing = [n for n in rule.hf if n not in tensors]
        if missing:
            raise ValueError(f"{where} has no tensor {missing[0]} (a {family.arch} model of "
                             f"{spec.layers} layers needs it)")
        inputs = [tensors[n] for n in rule.hf]
        outs = rule.to_commpipe(*inputs) if rule.to_commpipe else inputs
        state.update(zip(rule.commpipe, (t.float().contiguous() for t in outs), strict=True))
        used.update(rule.hf)
    derived = [re.compile(p) for p in family.derived]
    extra = sorted(n for n in given - used - {t.alias for t in family.ties(spec)}
                   if not any(p.search(n) for p in derived))
    if extra:
        raise ValueError(f"{where} holds {len(extra)} tensor(s) commpipe's {family.arch} model has "
                         f"no place for, e.g. {extra[0]}; its config may not describe it")
    check_shapes(family, spec, state, where)
    dtypes = {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()
              if n in given and t.dtype != torch.float32}
    origin = {"config": config, "keys": sorted(given - {n for n in given
                                                       if any(p.search(n) for p in derived)}),
              "dtypes": dtypes}
    return state, origin


def to_hf(family: Family, spec, state: dict[str, torch.Tensor],
          origin: dict | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors) of a Hugging Face folder from commpipe's full parameters; with
    the origin record of an imported checkpoint, its config, tied keys and dtypes are kept."""
    origin = origin or {}
    check_shapes(family, spec, state, "the commpipe checkpoint")
    config = family.config_from_spec(spec, origin.get("config"))
    tensors: dict[str, torch.Tensor] = {}
    for rule in family.rules(spec):
        inputs = [state[n] for n in rule.commpipe]
        outs = rule.to_hf(*inputs) if rule.to_hf else inputs
        tensors.update(zip(rule.hf, (t.contiguous() for t in outs), strict=True))
    keys = set(origin.get("keys") or ())
    for tie in family.ties(spec):
        if tie.alias not in tensors:                    # one Parameter in the module
            tensors[tie.alias] = tensors[tie.source].clone()
        equal = torch.equal(tensors[tie.alias], tensors[tie.source])
        if tie.by_config and family.tied(config) and not equal:
            family.set_tied(config, False)      # trained apart: the head is its own tensor now
        tied = family.tied(config) if tie.by_config else True
        if tied and tie.alias not in keys:
            del tensors[tie.alias]
    for name, dtype in (origin.get("dtypes") or {}).items():
        if name in tensors:
            tensors[name] = tensors[name].to(getattr(torch, dtype))
    return config, tensors


def check_shapes(family: Family, spec, state: dict, where: str) -> None:
    want = family.parameters(spec)
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"{where} has no parameter {missing[0]} for {spec.name}")
    for name, shape in want.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"{where}: {name} is {tuple(state[name].shape)}, {spec.name} needs "
                             f"{tuple(shape)}; the config and the tensors disagree")


def set_tie_word_embeddings(config: dict, tied: bool) -> None:
    """`Family.set_tied` of decoders whose config.json says it at the top level."""
    config["tie_word_embeddings"] = tied


def meta_parameters(module_factory) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a module built on the meta device (no memory)."""
    with torch.device("meta"):
        module = module_factory()
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


# -- folders --------------------------------------------------------------------------------------
def read_folder(folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every tensor of a Hugging Face model folder (one model.safetensors or
    the shards its model.safetensors.index.json names)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG}; give the folder save_pretrained wrote")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / CONFIG} cannot be read: {e}") from None
    if (folder / INDEX).is_file():
        files = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (it has {bins[0]}: re-save it with save_pretrained(safe_serialization=True))" \
            if bins else ""
        raise FileNotFoundError(f"{folder} has no {WEIGHTS} or {INDEX}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(folder / name))
    return config, tensors


def write_folder(folder, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json and model.safetensors, as save_pretrained writes them (one file)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, folder / WEIGHTS,
              metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
