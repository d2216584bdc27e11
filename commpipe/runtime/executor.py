"""Execute a lowered schedule Program on this rank's stage modules with real tensors.

Every action of the rank's list runs in order:
    RECV_F / RECV_B  post an asynchronous receive (waited for by the compute that needs it)
    F                forward of one micro-batch through one stage (the last stage adds the loss)
    B                full backward; I input-gradient only; W the deferred weight gradients
    SEND_F / SEND_B  asynchronous send (waited for when the step ends)
Receives are posted in the order commpipe.schedules.order gives (on NCCL and in strict-order mode
one sequence per rank pair that both sides agree on). Stage boundaries carry `act_dtype` (bf16
under bf16 autocast); a received input widens to fp32 and the loss runs in fp32.
What crosses each boundary comes from the stages' descriptions (`commpipe.models.boundary.
StageIO`, one per virtual stage): the tensors a stage sends travel packed in one message per
(boundary, micro-batch), in description order, and their gradients come back packed the same
way, so a decoder stage can receive text hidden states and image features together. Stages
take and return dicts named as in the descriptions (a module with `io_dict = True`); a plain
LLaMA stage `stage(x, positions) -> tensor` is called through a thin adapter.
Stages on the same rank (the turn of a V schedule) hand tensors over locally. Under a braided
program (STP, DualPipeV) LLaMA and MoE stages run unit by unit (commpipe.runtime.units,
units_moe) and a braid alternates its two passes' units, each unit's TP collective or EP
all-to-all in flight while the other computes.
Communication goes through the chokepoint (`Comm`); nothing here calls torch.distributed.

A step's state lives in a `StepRun` (runtime/step_run.py), with one method per action kind
dispatched from a table (as torch pipelining's `_perform_action`); what each stage's actions
need (its module and how to call it, its messages, peers and tags) is worked out once, in
`RuntimeStage` (runtime/stage.py).
An action that fails raises with the rank's program attached, the failed action marked `>>`.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from commpipe.models.boundary import StageIO
from commpipe.parallel.comm import Comm
from commpipe.runtime.messages import as_stage_io
from commpipe.runtime.stage import RuntimeStage
from commpipe.runtime.step_run import StepRun
from commpipe.runtime.units import stage_tp, supports_units, use_unit_collectives
from commpipe.runtime.weight_grad import WeightGradStore, enable_weight_grad_split
from commpipe.schedules.actions import Program, lower
from commpipe.schedules.order import posting_order
from commpipe.schedules.validate import channel_order_conflicts
from commpipe.timeline import Event


class PipelineRuntime:
    def __init__(self, program: Program, stages: dict, comm: Comm, loss_fn,
                 stage_io: list[StageIO] | tuple[int, ...], device: torch.device,
                 act_dtype=torch.float32,
                 autocast_dtype=None, on_compute=None, forward_only: bool = False,
                 posting: list[list[int]] | None = None, prefetch: bool = True,
                 units: bool | None = None):
        self.program = program if program.is_lowered else lower(program)
        # forward_only: a program of F actions (validation): no autograd graph, nothing kept
        self.forward_only = forward_only
        self.stages = stages
        self.comm = comm
        self.loss_fn = loss_fn
        self.act_dtype, self.device = act_dtype, device
        # a bare shape (one hidden-state tensor at every boundary) is still accepted
        self.stage_io = as_stage_io(stage_io, self.program.num_stages)
        self.autocast_dtype = autocast_dtype
        self.pp_rank = comm.local_rank("pp")
        self.actions = self.program.actions[self.pp_rank]
        self.last_stage = self.program.num_stages - 1
        self.on_compute = on_compute          # monitor hook: on_compute(name, t0, t1)
        self.slowdown = None    # fault drill (--slow-rank): slowdown(t0) stretches a compute action
        self.events: list[Event] | None = None  # set to [] to record a timeline
        self.annotate = False   # compute actions as torch.profiler annotations (GPU traces)
        # Posting order (commpipe.schedules.order): receives are posted before the compute
        # action ahead of their consumer (prefetch), so transfers overlap it; each is still
        # waited for only by its consumer. Gloo with a tag per message matches any order. NCCL,
        # and gloo in strict-order mode, match a rank pair's messages in issue order: there
        # both sides post each pair's operations in one common sequence, and prefetch never
        # moves a receive past another operation of the same pair.
        self.strict_order = comm.strict_order
        # prefetch=False (--no-overlap): each receive is posted right before its consumer
        posting = posting if posting is not None else posting_order(
            self.program, prefetch=prefetch, agree=self.strict_order)
        if self.strict_order:
            conflicts = channel_order_conflicts(self.program, posting)
            if conflicts:
                raise ValueError(f"schedule {self.program.name} would post messages between a rank "
                                 f"pair in different orders on the two sides ({conflicts[0]}); "
                                 "NCCL matches them in issue order. Check it with "
                                 "commpipe.schedules.dry_run: a program that deadlocks has no "
                                 "common order")
        self.order = posting[self.pp_rank]
        # Unit by unit (runtime/units.py): LLaMA and MoE stages under a braided program (STP,
        # DualPipeV), so a braid alternates its passes' units with the TP collectives (and
        # expert parallelism's all-to-alls, runtime/units_moe.py) in flight
        # between them; `units` forces it on or off (a validation runner sharing the stages
        # follows the training runner). Other stages run a braid's passes one after the other.
        braided = any(a.is_braid for acts in self.program.actions for a in acts)
        if units is None:
            tps = [stage_tp(m) for m in stages.values() if supports_units(m)]
            units = braided or any(tp is not None and tp.by_units for tp in tps)
        self.units = units and all(supports_units(m) for m in stages.values())
        for module in stages.values():
            if supports_units(module):
                use_unit_collectives(module, self.units)
        self.wstore = WeightGradStore()
        if any(p.op in ("I", "W") for a in self.actions for p in a.parts):
            for module in stages.values():
                enable_weight_grad_split(module, self.wstore)
        self.runtime_stages = {s: RuntimeStage(s, stages.get(s), self.stage_io, self.program, comm)
                               for s in self.program.stages_of(self.pp_rank)}

    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step_cast_cache(self):
        """Around a whole step: autocast disabled, but open, so the bf16 casts of the weights
        that each forward region makes are cached until the step ends (torch clears autocast's
        cache only when the outermost autocast context exits). Every micro-batch then shares one
        bf16 copy of each weight, as a bf16-parameter trainer holds one, instead of casting
        again and keeping a copy per micro-batch in flight; the values are the same casts."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=False)

    def run_step(self, tokens: list, labels: list | None, positions: torch.Tensor | None,
                 loss_scale: float, step: int = 0) -> torch.Tensor:
        """Run one step's program; returns the summed scaled loss of the micro-batches whose
        last stage is on this rank (0 elsewhere). Gradients accumulate in the stage params.
        `tokens[m]`: micro-batch m's token ids with `labels[m]` its labels, or a dict of its
        batch fields (pixels, tokens, labels, ...; `labels` unused then)."""
        batches = [t if isinstance(t, dict) else {"tokens": t, "labels": labels[m]}
                   for m, t in enumerate(tokens)]
        with torch.set_grad_enabled(not self.forward_only), self.step_cast_cache():
            return StepRun(self, batches, positions, loss_scale, step).run()
