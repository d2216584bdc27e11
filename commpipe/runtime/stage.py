"""One virtual stage as this rank's runtime sees it, and the rank's program as text.

`RuntimeStage` holds what the executor asks of a stage on every action (torch pipelining keeps the
same on its `_PipelineStageBase`): its module and how to call it, what crosses its two
boundaries (in packing order), whether each neighbour is on this rank (a local hand-over) or
which pp peer it is, and the message tags. All of it is fixed by the program and the stage
descriptions, so it is worked out once, not per action.

`format_program` prints a rank's actions in issue order with one of them marked, for the message
of an action that failed (torch pipelining prints its `_format_pipeline_order` the same way).
"""

from __future__ import annotations

import torch

from commpipe.models.boundary import StageIO, TensorDesc
from commpipe.runtime.messages import numel
from commpipe.schedules.actions import Action, Program


class RuntimeStage:
    """Stage `index` of `program`, held by this rank (`module` None: a runtime built to check a
    program only)."""

    def __init__(self, index: int, module, stage_io: list[StageIO], program: Program, comm):
        self.index, self.module, self.io = index, module, stage_io[index]
        self.is_first, self.is_last = index == 0, index == program.num_stages - 1
        rank = program.rank_of(index)
        # F message into this stage (its inputs), B message back into it (the gradients of
        # what it sent), each in packing order; and the same for its neighbours' messages
        self.recv_descs: tuple[TensorDesc, ...] = self.io.recv
        self.grad_descs = _grads(self.io) if not self.is_last else ()
        self.next_descs = () if self.is_last else stage_io[index + 1].recv
        self.prev_grad_descs = () if self.is_first else _grads(stage_io[index - 1])
        self.local_next = not self.is_last and program.rank_of(index + 1) == rank
        self.local_prev = not self.is_first and program.rank_of(index - 1) == rank
        self.next_peer = None if self.is_last else comm.pp_peer(program.rank_of(index + 1))
        self.prev_peer = None if self.is_first else comm.pp_peer(program.rank_of(index - 1))
        m = program.microbatches
        # one tag per (direction, stage boundary, micro-batch) within a step; + micro-batch
        self.tag_recv_f = ((index - 1) * 2) * m      # boundary index-1, forward
        self.tag_send_f = (index * 2) * m             # boundary index, forward
        self.tag_recv_b = (index * 2 + 1) * m         # boundary index, backward
        self.tag_send_b = ((index - 1) * 2 + 1) * m   # boundary index-1, backward
        self.recv_f_shape = _buffer_shape(self.recv_descs)
        self.recv_b_shape = _buffer_shape(self.grad_descs)
        self.io_dict = getattr(module, "io_dict", False)
        self.data_fields = tuple(d.name for d in self.io.data if d.name != "labels")
        self.output_key = "logits" if self.is_last else "hidden"

    def forward(self, received: dict, batch: dict, positions) -> dict:
        """The stage on its received tensors and the batch fields its description lists; a
        module with `io_dict = True` takes and returns dicts named as in the descriptions, a
        plain LLaMA stage is `stage(x, positions) -> tensor` (x: tokens on the first stage)."""
        if self.io_dict:
            return self.module(**received, **{name: batch[name] for name in self.data_fields})
        x = batch["tokens"] if self.is_first else received["hidden"]
        return {self.output_key: self.module(x, positions)}

    def backward(self, out, grad: dict | None) -> None:
        """The whole stage's backward: from the scaled loss on the last stage, else from the
        gradients of every sent tensor that carries one, e.g. text hidden states and the image
        features a decoder stage passes on (autograd adds that gradient to the one of its own
        cross-attention)."""
        if self.is_last:
            out.backward()
            return
        sent = [(out[d.name], grad[d.name]) for d in self.io.send
                if d.has_grad and out[d.name].requires_grad]
        torch.autograd.backward([t for t, _ in sent], [g.to(t.dtype) for t, g in sent])


def _grads(io: StageIO) -> tuple[TensorDesc, ...]:
    return tuple(d for d in io.send if d.has_grad)


def _buffer_shape(descs: tuple[TensorDesc, ...]) -> tuple[int, ...]:
    """A lone tensor travels in its own shape, several flattened and concatenated."""
    if not descs:
        return ()
    return tuple(descs[0].shape) if len(descs) == 1 else (sum(numel(d) for d in descs),)


def grad_of(t: torch.Tensor) -> torch.Tensor:
    """The gradient of a received tensor; zeros when the stage did not use it."""
    return t.grad if t.grad is not None else torch.zeros_like(t)


def format_program(actions: list[Action], order: list[int], failed: int, context: int = 5,
                   header: str = "") -> str:
    """`actions` in issue order (`order`: indices into it), `context` either side of position
    `failed` in that order, the failed one marked `>>`:

            4  0F2
        >>  5  0B1
            6  0SEND_B1
    """
    lo, hi = max(0, failed - context), min(len(order), failed + context + 1)
    lines = [header] if header else []
    if lo > 0:
        lines.append(f"        ... {lo} earlier")
    for pos in range(lo, hi):
        mark = ">>" if pos == failed else "  "
        lines.append(f"    {mark} {pos:3d}  {actions[order[pos]]}")
    if hi < len(order):
        lines.append(f"        ... {len(order) - hi} later")
    return "\n".join(lines)
