"""Validation loss through the pipeline, forward only.

The forward-only program of a schedule keeps each rank's F actions in the schedule's order and
drops B, I and W; lowering then adds the activation sends and receives. A rank's forwards run in
the same relative order as in training, so the program is deadlock-free whenever the schedule
is (removing actions cannot close a cycle of waits), and it works for every stage placement
(plain, interleaved, V). TP, CP and DP run as in training: the vocabulary-parallel loss, the
K/V all-gather, and DP ranks reading disjoint rows of each validation batch.

    trainer = Trainer.build(cfg); val_loss = trainer.evaluate()
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from commpipe.parallel.comm import Comm
from commpipe.schedules.actions import Program, lower


def forward_program(program: Program) -> Program:
    """Only the F actions of `program`, lowered."""
    base = program.compute_only()
    fwd = tuple(tuple(a for a in acts if a.op == "F") for acts in base.actions)
    return lower(replace(base, name=f"{base.name}-forward", actions=fwd))


class ForwardRunner:
    """Runs a forward-only program on this rank's stages; returns the summed scaled loss of the
    micro-batches whose last stage is here (0 elsewhere)."""

    def __init__(self, program: Program, stages: dict, comm: Comm, loss_fn,
                 act_shape: tuple[int, ...], device: torch.device, act_dtype=torch.float32,
                 autocast_dtype=None):
        self.program = forward_program(program)
        self.stages, self.comm, self.loss_fn = stages, comm, loss_fn
        self.act_shape, self.act_dtype, self.device = act_shape, act_dtype, device
        self.autocast_dtype = autocast_dtype
        self.actions = self.program.actions[comm.local_rank("pp")]
        self.last_stage = self.program.num_stages - 1

    def _peer(self, stage: int) -> int:
        return self.comm.pp_peer(self.program.rank_of(stage))

    def _tag(self, boundary: int, mb: int) -> int:
        return boundary * self.program.microbatches + mb

    @torch.no_grad()
    def run(self, tokens: list[torch.Tensor], labels: list[torch.Tensor],
            positions: torch.Tensor, loss_scale: float) -> torch.Tensor:
        recvs, local, sends = {}, {}, []
        loss_total = torch.zeros((), device=self.device, dtype=torch.float64)
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else nullcontext())
        for a in self.actions:
            s, m = a.stage, a.microbatch
            if a.op == "RECV_F":
                buf = torch.empty(self.act_shape, dtype=self.act_dtype, device=self.device)
                recvs[(s, m)] = self.comm.irecv(buf, self._peer(s - 1), tag=self._tag(s - 1, m))
            elif a.op == "SEND_F":
                sends.append(self.comm.isend(local.pop((s + 1, m)), self._peer(s + 1),
                                             tag=self._tag(s, m)))
            elif a.op == "F":
                if s == 0:
                    x = tokens[m]
                else:
                    x = recvs.pop((s, m)).wait() if (s, m) in recvs else local.pop((s, m))
                with autocast:
                    out = self.stages[s](x, positions)
                    if s == self.last_stage:
                        loss_total += self.loss_fn(out, labels[m]).double() * loss_scale
                    else:
                        # to the next stage: the SEND_F that follows, or a local hand-over
                        local[(s + 1, m)] = out.to(self.act_dtype)
        for h in sends:
            h.wait()
        return loss_total


def evaluate(trainer) -> float:
    """Mean token cross-entropy over `cfg.eval_batches` global batches of the valid split,
    identical on every rank."""
    cfg, comm = trainer.cfg, trainer.comm
    dp_rank, dp_size = comm.local_rank("dp"), comm.size("dp")
    scale = 1.0 / (cfg.global_batch * cfg.seq_len)   # each batch's loss is a token mean
    total = torch.zeros((), dtype=torch.float64, device=trainer.device)
    batches = 0
    for inputs, labels in trainer.source.validation(cfg.global_batch, dp_rank, dp_size,
                                                    max_batches=cfg.eval_batches):
        mb_inputs, mb_labels, positions = trainer.shard_batch(inputs, labels)
        total += trainer.forward_runner.run(mb_inputs, mb_labels, positions, scale)
        batches += 1
    if batches == 0:
        raise ValueError("the validation split yields no batch; lower --global-batch or --seq-len")
    total = total.reshape(1)
    comm.all_reduce(total, "dp_cp")
    comm.all_reduce(total, "pp")  # only last-stage ranks hold a loss: every rank learns it
    return total.item() / batches
