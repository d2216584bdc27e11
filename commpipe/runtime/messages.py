"""What crosses a stage boundary: stage descriptions checked to chain, and the packing of a
boundary's tensors into one message (flattened and concatenated in description order) and back.
"""

from __future__ import annotations

import torch

from commpipe.models.boundary import StageIO, TensorDesc


def pack(tensors: dict, descs: tuple[TensorDesc, ...], act_dtype) -> torch.Tensor:
    """One buffer per message: a lone tensor as it is, several flattened and concatenated."""
    missing = [d.name for d in descs if d.name not in tensors]
    if missing:
        raise RuntimeError(f"a stage boundary expects {[d.name for d in descs]} but the "
                           f"stage produced {sorted(tensors)}; its StageIO does not match "
                           "the stage module")
    parts = [tensors[d.name].detach().to(act_dtype) for d in descs]
    for d, t in zip(descs, parts):
        if tuple(t.shape) != tuple(d.shape):
            raise RuntimeError(f"boundary tensor {d.name!r} has shape {tuple(t.shape)}, its "
                               f"description says {d.shape}")
    if len(parts) == 1:
        return parts[0]
    return torch.cat([t.reshape(-1) for t in parts])


def unpack(buf: torch.Tensor, descs: tuple[TensorDesc, ...]) -> dict:
    """The named tensors of one message (views into `buf`)."""
    if len(descs) == 1:
        return {descs[0].name: buf.view(descs[0].shape)}
    out, start = {}, 0
    for d in descs:
        n = numel(d)
        out[d.name] = buf[start:start + n].view(d.shape)
        start += n
    return out


def numel(d: TensorDesc) -> int:
    n = 1
    for k in d.shape:
        n *= k
    return n


def as_stage_io(stage_io, num_stages: int) -> list[StageIO]:
    """Stage descriptions, checked to chain (each stage receives what the one before sends);
    a bare activation shape stands for one hidden-state tensor at every boundary."""
    if stage_io and isinstance(stage_io[0], int):
        hidden = (TensorDesc("hidden", tuple(stage_io), "float32"),)
        tokens = (TensorDesc("tokens", tuple(stage_io[:2]), "int64"),)
        labels = (TensorDesc("labels", tuple(stage_io[:2]), "int64"),)
        last = num_stages - 1
        stage_io = [StageIO(s, range(0), (tokens if s == 0 else ()) + (labels if s == last else ()),
                            hidden if s > 0 else (), hidden if s < last else ())
                    for s in range(num_stages)]
    stage_io = list(stage_io)
    if len(stage_io) != num_stages:
        raise ValueError(f"{len(stage_io)} stage descriptions for a program of {num_stages} "
                         "stages; give one StageIO per virtual stage")
    for s in range(num_stages - 1):
        sent = [d.name for d in stage_io[s].send]
        got = [d.name for d in stage_io[s + 1].recv]
        if sent != got or [d.shape for d in stage_io[s].send] != [d.shape for d in stage_io[s + 1].recv]:
            raise ValueError(f"stage {s} sends {stage_io[s].send} but stage {s + 1} expects "
                             f"{stage_io[s + 1].recv}")
    return stage_io
