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
program (STP, DualPipeV) LLaMA stages run unit by unit (commpipe.runtime.units) and a braid
alternates its two passes' units, each unit's TP collective in flight while the other computes.
Communication goes through the chokepoint (`Comm`); nothing here calls torch.distributed.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from commpipe.models.boundary import StageIO, TensorDesc
from commpipe.parallel.comm import Comm
from commpipe.runtime.messages import as_stage_io, numel, pack, unpack
from commpipe.runtime.units import UnitPass, supports_units, use_unit_collectives
from commpipe.runtime.weight_grad import WeightGradStore, enable_weight_grad_split
from commpipe.schedules.actions import Action, Program, lower
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
        # Unit by unit (runtime/units.py): LLaMA stages under a braided program (STP,
        # DualPipeV), so a braid alternates its passes' units with the TP collectives in flight
        # between them; `units` forces it on or off (a validation runner sharing the stages
        # follows the training runner). Other stages run a braid's passes one after the other.
        braided = any(a.is_braid for acts in self.program.actions for a in acts)
        if units is None:
            units = braided or any(getattr(b.attention, "_tp_by_units", False)
                                   for m in stages.values() if supports_units(m)
                                   for b in m.layers.values())
        self.units = units and all(supports_units(m) for m in stages.values())
        for module in stages.values():
            if supports_units(module):
                use_unit_collectives(module, self.units)
        self.wstore = WeightGradStore()
        if any(p.op in ("I", "W") for a in self.actions for p in a.parts):
            for module in stages.values():
                enable_weight_grad_split(module, self.wstore)

    def _peer(self, stage: int) -> int:
        return self.comm.pp_peer(self.program.rank_of(stage))

    def _tag(self, kind: str, boundary: int, mb: int) -> int:
        """One tag per (direction, stage boundary, micro-batch) within a step."""
        return (boundary * 2 + (kind == "B")) * self.program.microbatches + mb

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _message(self, kind: str, stage: int) -> tuple[TensorDesc, ...]:
        """What travels to `stage` (kind F: its inputs) or back from `stage` (kind B: the
        gradients of the tensors it sent), in packing order."""
        if kind == "F":
            return self.stage_io[stage].recv
        return tuple(d for d in self.stage_io[stage].send if d.has_grad)

    def _pack(self, tensors: dict, descs: tuple[TensorDesc, ...]) -> torch.Tensor:
        return pack(tensors, descs, self.act_dtype)

    _unpack = staticmethod(unpack)

    def _forward(self, s: int, received: dict, batch: dict, positions) -> dict:
        """Stage s on its received tensors and the batch fields its description lists."""
        module = self.stages[s]
        if getattr(module, "io_dict", False):
            fields = {d.name: batch[d.name] for d in self.stage_io[s].data if d.name != "labels"}
            return module(**received, **fields)
        x = batch["tokens"] if s == 0 else received["hidden"]   # a LLaMA stage
        return {"logits" if s == self.last_stage else "hidden": module(x, positions)}

    def run_step(self, tokens: list, labels: list | None, positions: torch.Tensor | None,
                 loss_scale: float, step: int = 0) -> torch.Tensor:
        """Run one step's program; returns the summed scaled loss of the micro-batches whose
        last stage is on this rank (0 elsewhere). Gradients accumulate in the stage params.
        `tokens[m]`: micro-batch m's token ids with `labels[m]` its labels, or a dict of its
        batch fields (pixels, tokens, labels, ...; `labels` unused then)."""
        batches = [t if isinstance(t, dict) else {"tokens": t, "labels": labels[m]}
                   for m, t in enumerate(tokens)]
        with torch.set_grad_enabled(not self.forward_only):
            return self._run_actions(batches, positions, loss_scale, step)

    def _run_actions(self, batches, positions, loss_scale, step):
        recvs, sends = {}, []
        inputs, outputs, grads_to_send = {}, {}, {}
        local_fwd, local_bwd, deferred = {}, {}, {}
        unit_passes = {}     # (stage, micro-batch) -> UnitPass awaiting its backward
        loss_total = torch.zeros((), device=self.device)
        # a recorded timeline on CUDA is read from events on the compute stream (when the
        # kernels ran, the profiler's clock), not from perf_counter around asynchronous launches
        gpu_clock = self.events is not None and self.device.type == "cuda"
        stamps = []   # (stream, name, start, end), converted to ms once the step is done

        def now():
            if not gpu_clock:
                return time.perf_counter()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        t_origin = now()

        def record(stream, a, t0, t1):
            if self.events is not None:
                stamps.append((stream, str(a), t0, t1))

        def wait(key, a):
            t0 = now()
            value = recvs.pop(key).wait()
            record("pp", Action("RECV_" + key[0], a.stage, a.microbatch), t0, now())
            return value

        def post(a):
            descs = self._message(a.op[-1], a.stage)
            shape = descs[0].shape if len(descs) == 1 else (sum(numel(d) for d in descs),)
            buf = torch.empty(shape, dtype=self.act_dtype, device=self.device)
            src = a.stage - 1 if a.op == "RECV_F" else a.stage + 1
            tag = self._tag(a.op[-1], min(a.stage, src), a.microbatch)
            recvs[(a.op[-1], a.stage, a.microbatch)] = self.comm.irecv(buf, self._peer(src), tag=tag)

        def prepare(a):
            """One plain compute action: its inputs gathered (waited for), its work a _Pass."""
            s, m = a.stage, a.microbatch
            if a.op == "F":
                x = {}
                if s > 0:
                    x = self._unpack(wait(("F", s, m), a), self._message("F", s)) \
                        if ("F", s, m) in recvs else local_fwd.pop((s, m))
                    x = {k: v.detach() for k, v in x.items()}
                    if not self.forward_only:
                        for d in self.stage_io[s].recv:
                            x[d.name].requires_grad_(d.has_grad)
                        inputs[(s, m)] = x
                return forward(a, x)
            if a.op in ("B", "I"):
                grad = None
                if s != self.last_stage:
                    grad = self._unpack(wait(("B", s, m), a), self._message("B", s)) \
                        if ("B", s, m) in recvs else local_bwd.pop((s, m))
                return backward(a, grad)
            return run_w(a)

        def forward(a, x):
            s, m = a.stage, a.microbatch
            # a received input widens to fp32, the dtype of the embedding's output, so the
            # residual stream is fp32 on every stage, as on one device
            x = {k: v.float() for k, v in x.items()}

            def tail(out, loss=None):
                nonlocal loss_total
                if s == self.last_stage:            # the loss in fp32, outside autocast
                    if loss is None:
                        loss = self.loss_fn(out["logits"], batches[m]["labels"])
                    out = loss * loss_scale
                    loss_total = loss_total + out.detach()
                local_next = (s != self.last_stage
                              and self.program.rank_of(s + 1) == self.program.rank_of(s))
                if local_next:
                    local_fwd[(s + 1, m)] = {d.name: out[d.name].detach().to(self.act_dtype)
                                             for d in self.stage_io[s].send}
                if not self.forward_only or not (local_next or s == self.last_stage):
                    outputs[(s, m)] = out  # kept for its backward, or until its SEND_F
                return out

            def tail_steps(out):
                """tail(), with a vocabulary-parallel loss's collectives yielded to the braid's
                other pass while they travel (`steps` of the loss function)."""
                steps = getattr(self.loss_fn, "steps", None)
                if s == self.last_stage and steps is not None:
                    return tail(out, (yield from steps(out["logits"], batches[m]["labels"])))
                return tail(out)

            if self.units:
                key = "logits" if s == self.last_stage else "hidden"
                unit = UnitPass(self.stages[s], batches[m]["tokens"] if s == 0 else x["hidden"],
                                positions, lambda out: tail_steps({key: out}), self._autocast,
                                grad=not self.forward_only)
                if not self.forward_only:
                    unit_passes[(s, m)] = unit
                return _Pass(unit.forward_steps(), len(unit.steps))

            def whole():
                with self._autocast():
                    out = self._forward(s, x, batches[m], positions)
                tail(out)
                yield "F"
            return _Pass(whole())

        def backward(a, grad):
            s, m = a.stage, a.microbatch
            out = outputs.pop((s, m))
            if self.units:
                g = None if s == self.last_stage else grad["hidden"]
                steps = unit_passes.pop((s, m)).backward_steps(g)
            else:
                steps = iter([lambda: whole_backward(s, out, grad)])
            return _Pass(backward_steps(a, steps), 0)

        def whole_backward(s, out, grad):
            if s == self.last_stage:
                out.backward()
            else:
                # every sent tensor that carries a gradient, e.g. text hidden states and the
                # image features a decoder stage passes on (autograd adds that gradient to the
                # one of its own cross-attention)
                sent = [(out[d.name], grad[d.name]) for d in self.stage_io[s].send
                        if d.has_grad and out[d.name].requires_grad]
                torch.autograd.backward([t for t, _ in sent], [g.to(t.dtype) for t, g in sent])

        def backward_steps(a, steps):
            s, m = a.stage, a.microbatch
            while True:
                # weight gradients are deferred during this pass's steps only (a braid's
                # forward steps run in between)
                self.wstore.deferring = a.op == "I"
                try:
                    step = next(steps)
                    if callable(step):
                        step()
                except StopIteration:
                    break
                finally:
                    self.wstore.deferring = False
                yield a.op
            if a.op == "I":
                deferred[(s, m)] = self.wstore.take()
            if s > 0:
                received = inputs.pop((s, m))
                g = {d.name: _grad_of(received[d.name]) for d in self.stage_io[s].recv
                     if d.has_grad}
                if self.program.rank_of(s - 1) == self.program.rank_of(s):
                    local_bwd[(s - 1, m)] = g
                else:
                    grads_to_send[(s, m)] = g

        def run_w(a, chunks: int = 1):
            """The deferred weight gradients, in `chunks` slices (a braid's forward steps run
            in between)."""
            items = deferred.pop((a.stage, a.microbatch))
            size = max(1, -(-len(items) // max(1, chunks)))

            def steps():
                for k in range(0, len(items), size):
                    WeightGradStore.flush(items[k:k + size])
                    yield "W"
            return _Pass(steps())

        for idx in self.order:
            a = self.actions[idx]
            s, m = a.stage, a.microbatch
            if a.op in ("RECV_F", "RECV_B"):
                post(a)
                continue
            if a.op == "SEND_F":
                out = outputs.pop((s, m)) if self.forward_only else outputs[(s, m)]
                # stage boundaries carry the activation dtype (bf16 under autocast)
                sends.append(self.comm.isend(self._pack(out, self._message("F", s + 1)),
                                             self._peer(s + 1), tag=self._tag("F", s, m)))
                continue
            if a.op == "SEND_B":
                sends.append(self.comm.isend(self._pack(grads_to_send.pop((s, m)),
                                                        self._message("B", s - 1)),
                                             self._peer(s - 1), tag=self._tag("B", s - 1, m)))
                continue

            # compute actions (a braid runs its two passes step by step, alternating): inputs
            # are gathered first so the timed interval excludes waits
            passes = []
            for part in a.parts:      # a braid's W is sliced to interleave with its forward
                passes.append(run_w(part, passes[0].steps) if part.op == "W" and passes
                              else prepare(part))
            mark = torch.profiler.record_function(str(a)) if self.annotate else None
            if mark is not None:
                mark.__enter__()
            t0 = now()
            _alternate([p.run for p in passes])
            if self.slowdown is not None:
                self.slowdown(t0)
            t1 = now()
            if mark is not None:
                mark.__exit__(None, None, None)
            record("compute", a, t0, t1)
            if self.on_compute is not None and not gpu_clock:   # host seconds only
                self.on_compute(str(a), t0, t1)

        for h in sends:
            h.wait()
        if stamps:
            if gpu_clock:
                torch.cuda.current_stream(self.device).synchronize()   # tracing only
                ms = t_origin.elapsed_time
            else:
                ms = lambda t: (t - t_origin) * 1e3
            self.events.extend(Event(self.comm.rank, stream, name, ms(t0), ms(t1), step)
                               for stream, name, t0, t1 in stamps)
        if recvs or outputs or deferred:
            raise RuntimeError(f"schedule left work undone on pp rank {self.pp_rank}: "
                               f"receives {list(recvs)}, outputs {list(outputs)}, "
                               f"deferred W {list(deferred)}")
        return loss_total


class _Pass:
    """One plain action's work as a generator of steps (`steps`: how many, where known)."""

    def __init__(self, run, steps: int = 1):
        self.run, self.steps = run, steps


def _alternate(runs: list) -> None:
    """Run generators to the end, one step of each in turn."""
    while runs:
        for r in list(runs):
            try:
                next(r)
            except StopIteration:
                runs.remove(r)


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    """The gradient of a received tensor; zeros when the stage did not use it."""
    return t.grad if t.grad is not None else torch.zeros_like(t)
