"""Weights-only checkpoints: written by one process, loaded under any layout by --init-from.

`commpipe convert --from-hf` writes one (`save_weights`): a checkpoint folder of the same form
as a training run's (commpipe.train.checkpoint), holding the full tensors `model.<name>` only,
its commpipe.json with step 0, the model shape and no data position (`data: null`), plus the
`hf` record that lets `convert --to-hf` write the Hugging Face folder back unchanged.

`commpipe train --init-from CKPT` reads the model shape from any checkpoint, a converted one
or a run's, and loads its weights through the same path `--resume` uses (each rank reads the
full tensors of its stages and keeps its TP slice), with a fresh optimizer at step 0.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from commpipe.models.hf import model_fields, spec_from_dict
from commpipe.train.checkpoint import (
    FORMAT,
    META,
    _quiet_single_process,
    _write_json,
    copy_params,
    find_checkpoint,
    model_wants,
    read_meta,
    read_tensors,
)
from commpipe.train.checkpoint_io import read_metadata


def save_weights(path, spec, state: dict[str, torch.Tensor], **extra) -> Path:
    """Write full tensors `state` ({parameter name: tensor}) of a `spec` model as a checkpoint
    folder at `path` (one process; atomic: written to path.tmp, then renamed)."""
    path = Path(path)
    if path.exists():
        raise ValueError(f"{path} exists; give a new folder for the checkpoint")
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet_single_process():
        dcp.save({f"model.{n}": t.contiguous() for n, t in state.items()},
                 storage_writer=FileSystemWriter(tmp), no_dist=True)
    _write_json(tmp / META, {"format": FORMAT, "step": 0, "model": spec.to_dict(), "data": None,
                             "world_size": 1, **extra})
    os.rename(tmp, path)
    return path


def find(path) -> Path:
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint there (a folder with {META} and "
                                ".metadata, or a run folder holding checkpoints/)")
    return found


def read_weights(path) -> tuple[dict, object, dict[str, torch.Tensor]]:
    """(commpipe.json, spec, {parameter name: full tensor}) of any checkpoint (one process)."""
    path = find(path)
    meta = read_meta(path)
    spec = spec_from_dict(meta["model"])
    stored = read_metadata(path).state_dict_metadata
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in stored.items() if k.startswith("model.")}
    read_tensors(want, path, single_process=True)
    return meta, spec, {k.removeprefix("model."): v for k, v in want.items()}


def init_model(init_from: str, model: str | None) -> str:
    """The --model of a run started from checkpoint `init_from`: its shape, or `model` when it
    is the same shape (a preset's name reads better in logs); another shape is refused."""
    path = find(init_from)
    saved = spec_from_dict(read_meta(path)["model"])
    if model is None:
        return model_fields(saved)
    from commpipe.models.family import resolve

    given = resolve(model)
    diffs = _diffs(saved, given)
    if diffs:
        raise ValueError(f"--model {given.name} is not the model of --init-from {path} "
                         f"({saved.name}): {'; '.join(diffs)}. Leave --model out to take the "
                         f"checkpoint's shape")
    return model


def _diffs(saved, spec, skip=("name",)) -> list[str]:
    a, b = saved.to_dict(), spec.to_dict()
    return [f"{k}={a.get(k)} (checkpoint) vs {b.get(k)} (this run)"
            for k in sorted(set(a) | set(b)) if k not in skip and a.get(k) != b.get(k)]


def check_init_from(cfg) -> Path:
    """After cfg.resolve(): the checkpoint --init-from names, checked against the run's final
    model (with --data its vocabulary is the tokenizer's), before any process group starts."""
    path = find(cfg.init_from)
    diffs = _diffs(spec_from_dict(read_meta(path)["model"]), cfg.spec)
    if diffs:
        hint = " (with --data the vocabulary is the tokenizer's, padded to 64)" \
            if any(d.startswith("vocab=") for d in diffs) else ""
        raise ValueError(f"cannot start from {path}: the model differs: {'; '.join(diffs)}{hint}")
    read_metadata(path)   # refused or damaged: said now
    return path


def load_weights(trainer, path) -> dict:
    """Load only the model weights of checkpoint `path` into `trainer`, under its layout
    (collective: every rank); the optimizer, step and data position stay fresh."""
    path = find(path)
    meta = read_meta(path)
    diffs = _diffs(spec_from_dict(meta["model"]), trainer.cfg.spec)
    if diffs:
        raise ValueError(f"cannot start from {path}: the model differs: {'; '.join(diffs)}")
    want = model_wants(trainer, path, read_metadata(path).state_dict_metadata)
    read_tensors(want, path, trainer.comm.dims.world_size == 1)
    copy_params(trainer, want)
    return meta
