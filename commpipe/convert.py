"""`commpipe convert`: Hugging Face checkpoints in and out.

    commpipe convert --from-hf models/Llama-2-7b-hf --out ckpt/llama2-7b
    torchrun --nproc-per-node 4 -m commpipe train --init-from ckpt/llama2-7b --tp 2 --pp 2 ...
    commpipe convert --from runs/t --to-hf models/llama2-7b-tuned

A Hugging Face folder is config.json plus model.safetensors (or the shards an index names), as
save_pretrained writes it: LlamaForCausalLM (Llama 2 and 3 configs), BlipForConditionalGeneration
and MixtralForCausalLM. The commpipe side is a checkpoint folder that any layout loads
(commpipe.train.weights); --from also takes a run folder (its latest checkpoint). The name
mapping lives in commpipe.models.hf_llama, hf_blip and hf_moe.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p) -> None:
    p.add_argument("--from-hf", metavar="HF_DIR", help="a Hugging Face model folder to read")
    p.add_argument("--out", metavar="CKPT", help="the commpipe checkpoint folder to write")
    p.add_argument("--from", dest="source", metavar="CKPT",
                   help="a commpipe checkpoint (or a run folder: its latest checkpoint) to read")
    p.add_argument("--to-hf", metavar="HF_DIR", help="the Hugging Face model folder to write")
    p.add_argument("--hf-config", metavar="HF_DIR", default=None,
                   help="with --to-hf: start config.json from this folder's (token ids, context "
                        "length, dtype) when the checkpoint was not converted from one")


def run(args) -> int:
    if bool(args.from_hf) == bool(args.source):
        raise ValueError("give --from-hf HF_DIR --out CKPT, or --from CKPT --to-hf HF_DIR")
    if args.from_hf:
        if not args.out or args.to_hf:
            raise ValueError("--from-hf HF_DIR writes a commpipe checkpoint: give --out CKPT")
        path, spec = from_hf(args.from_hf, args.out)
    else:
        if not args.to_hf or args.out:
            raise ValueError("--from CKPT writes a Hugging Face folder: give --to-hf HF_DIR")
        path, spec = to_hf(args.source, args.to_hf, args.hf_config)
    print(f"wrote {path} ({spec.name}: arch={spec.arch}, {spec.layers} layers)")
    return 0


def from_hf(hf_dir, out):
    """Hugging Face folder `hf_dir` -> commpipe checkpoint `out`; returns (out, spec)."""
    from commpipe.models import hf
    from commpipe.train.weights import save_weights

    if Path(out).exists():
        raise ValueError(f"--out {out} exists; give a new folder")
    config, tensors = hf.read_folder(hf_dir)
    family = hf.family_for_config(config)
    spec = family.spec_from_config(config, hf.spec_name(hf_dir, f"hf-{family.arch}"))
    state, origin = hf.to_commpipe(family, spec, config, tensors, where=str(hf_dir))
    return save_weights(out, spec, state, hf=origin), spec


def to_hf(ckpt, hf_dir, hf_config=None):
    """commpipe checkpoint (or run folder) `ckpt` -> Hugging Face folder `hf_dir`."""
    from commpipe.models import hf
    from commpipe.train.weights import read_weights

    out = Path(hf_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--to-hf {hf_dir} exists and is not empty; give a new folder")
    meta, spec, state = read_weights(ckpt)
    family = hf.family_for_arch(spec.arch)
    origin = meta.get("hf")
    if hf_config is not None:
        config = _read_config(hf_config)
        if hf.family_for_config(config) is not family:
            raise ValueError(f"--hf-config {hf_config} is a {config.get('model_type')} config; "
                             f"the checkpoint is arch={spec.arch}")
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        origin = {"config": config, "dtypes": {} if dtype not in DTYPES[1:] else
                  {n: dtype for n in _hf_names(family, spec)}}
    config, tensors = hf.to_hf(family, spec, state, origin)
    return hf.write_folder(out, config, tensors), spec


def _read_config(folder) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--hf-config {folder} has no config.json")
    return json.loads(path.read_text())


def _hf_names(family, spec) -> list[str]:
    names = [n for rule in family.rules(spec) for n in rule.hf]
    return names + [t.alias for t in family.ties(spec)]
