"""What the trainer needs of a model family beyond its description (commpipe.models.family):
how a `commpipe train` configuration resolves, how this rank's stages are built with the
parallel dimensions applied, and where its batches come from. One registration per family,
keyed by the family's arch; nothing else in the trainer asks which family it trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Training:
    resolve_config: Callable   # (cfg, world_size) -> None: TrainConfig.resolve for the family
    build: Callable            # (cfg, comm, program, device, act_dtype, features)
                               #   -> (stages {stage: module}, loss_fn, [StageIO])
    open_data: Callable        # (cfg, world_size) -> source: --data, opened before resolve
    make_source: Callable      # (cfg) -> source: --data, else synthetic
    synthetic_source: Callable  # (cfg) -> source: synthetic batches (a resumed run, no --data)
    expert_parallel: bool = False  # its build shards experts over --ep (commpipe.parallel.expert)


TRAINING: dict[str, Training] = {}


def stage_counts(cfg) -> list[int]:
    """Layers per virtual stage of the run's split (what `stage_io` describes)."""
    from commpipe.parallel.dims import split_layers

    return [len(r) for r in split_layers(cfg.spec.layers, cfg.program().num_stages,
                                         cfg.stage_layers)]


def register_training(arch: str, training: Training) -> Training:
    TRAINING[arch] = training
    return training


def training_for(family) -> Training:
    """The training glue of a commpipe.models.family.ModelFamily."""
    # each module registers its family's glue on import
    from commpipe.train import decoder, moe, multimodal  # noqa: F401

    if family.arch not in TRAINING:
        raise ValueError(f"commpipe train builds {', '.join(sorted(TRAINING))} models, not "
                         f"{family.arch}")
    return TRAINING[family.arch]
