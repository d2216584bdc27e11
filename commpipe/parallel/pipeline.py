"""Pipeline parallelism: which layers each stage holds, and building this rank's stages.

Stages are contiguous layer ranges; the first stage owns the embedding, the last the final
norm, the head and the loss. With v chunks per rank (interleaved, V schedules) there are
pp*v virtual stages and the schedule's Program says which rank holds which. Parameter names
are those of the whole model (`layers.<i>.*`), whatever stage holds layer i.
"""

from __future__ import annotations

import torch

from commpipe.models.llama import Transformer, build_model
from commpipe.models.spec import ModelSpec
from commpipe.parallel.dims import split_layers
from commpipe.schedules.actions import Program


def build_stages(spec: ModelSpec, program: Program, pp_rank: int, seed: int,
                 stage_layers: list[int] | None = None,
                 device: torch.device | str = "cpu") -> dict[int, Transformer]:
    """The stage modules `pp_rank` holds under `program`, keyed by virtual stage index."""
    ranges = split_layers(spec.layers, program.num_stages, stage_layers)
    last = program.num_stages - 1
    return {s: build_model(spec, seed, layer_ids=ranges[s], has_embedding=s == 0,
                           has_head=s == last, device=device)
            for s in program.stages_of(pp_rank)}
