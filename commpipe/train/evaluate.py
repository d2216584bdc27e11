"""Validation loss through the pipeline, forward only.

The forward-only program of a schedule keeps each rank's F actions in the schedule's order and
drops B, I and W; lowering then adds the activation sends and receives. A rank's forwards run in
the same relative order as in training, so the program is deadlock-free whenever the schedule
is (removing actions cannot close a cycle of waits), and it works for every stage placement
(plain, interleaved, V). TP, CP and DP run as in training: the vocabulary-parallel loss, the
K/V all-gather, and DP ranks reading disjoint rows of each validation batch.

    trainer = Trainer.build(cfg); val_loss = trainer.evaluate()

The runtime executes it like any program (`PipelineRuntime(..., forward_only=True)`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from commpipe.schedules.actions import Program, lower


def forward_program(program: Program) -> Program:
    """Only the F actions of `program` (a braid's forward included), lowered."""
    base = program.compute_only()
    fwd = tuple(tuple(p for a in acts for p in a.parts if p.op == "F") for acts in base.actions)
    return lower(replace(base, name=f"{base.name}-forward", actions=fwd))


def evaluate(trainer) -> float:
    """Mean token cross-entropy over `cfg.eval_batches` global batches of the valid split,
    identical on every rank."""
    cfg, comm = trainer.cfg, trainer.comm
    dp_rank, dp_size = comm.local_rank("dp"), comm.size("dp")
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    batches = 0
    for batch in trainer.source.validation(cfg.global_batch, dp_rank, dp_size,
                                           max_batches=cfg.eval_batches):
        # each batch's loss is a mean over its (labelled) tokens
        mb_inputs, mb_labels, positions, scale = trainer.prepare_batch(batch)
        total += trainer.forward_runner.run_step(mb_inputs, mb_labels, positions, scale).double()
        batches += 1
    if batches == 0:
        raise ValueError("the validation split yields no batch; lower --global-batch or --seq-len")
    total = total.reshape(1)
    comm.all_reduce(total, "dp_cp")
    comm.all_reduce(total, "pp")  # only last-stage ranks hold a loss: every rank learns it
    return total.item() / batches
