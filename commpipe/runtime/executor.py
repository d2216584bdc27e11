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

A step's state lives in a `_StepRun`, with one method per action kind dispatched from a table
(as torch pipelining's `_perform_action`); what each stage's actions need (its module and how to
call it, its messages, peers and tags) is worked out once, in `RuntimeStage` (runtime/stage.py).
An action that fails raises with the rank's program attached, the failed action marked `>>`.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from commpipe.models.boundary import StageIO
from commpipe.parallel.comm import Comm
from commpipe.runtime.messages import as_stage_io, pack, unpack
from commpipe.runtime.stage import RuntimeStage, format_program, grad_of
from commpipe.runtime.units import UnitPass, stage_tp, supports_units, use_unit_collectives
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
            return _StepRun(self, batches, positions, loss_scale, step).run()


class _StepRun:
    """One step of the rank's program: its state, and one method per action kind, dispatched by
    `_ACTIONS` (torch pipelining's `_perform_action`). The state, keyed by (stage, micro-batch):
        recvs          posted receives, by (kind, stage, micro-batch), until their consumer
        inputs         a stage's received inputs (leaves whose .grad its backward produces)
        outputs        a stage's outputs, kept for its backward or until its SEND_F
        local_fwd/bwd  tensors handed to the next/previous stage on this rank
        grads_to_send  input gradients until their SEND_B
        deferred       weight gradients an I left for its W
        unit_passes    unit-by-unit forwards awaiting their backward
    """

    def __init__(self, rt: PipelineRuntime, batches: list, positions, loss_scale: float,
                 step: int):
        self.rt, self.batches, self.positions = rt, batches, positions
        self.loss_scale, self.step = loss_scale, step
        self.stages = rt.runtime_stages
        self.recvs, self.sends = {}, []
        self.inputs, self.outputs, self.grads_to_send = {}, {}, {}
        self.local_fwd, self.local_bwd, self.deferred, self.unit_passes = {}, {}, {}, {}
        self.loss_total = torch.zeros((), device=rt.device)
        # a recorded timeline on CUDA is read from events on the compute stream (when the
        # kernels ran, the profiler's clock), not from perf_counter around asynchronous launches
        self.recording = rt.events is not None
        self.gpu_clock = self.recording and rt.device.type == "cuda"
        self.timed = self.recording or rt.on_compute is not None or rt.slowdown is not None
        self.stamps = []   # (stream, name, start, end), converted to ms once the step is done
        self.t_origin = self.now()

    def now(self):
        if not self.gpu_clock:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def run(self) -> torch.Tensor:
        rt, actions = self.rt, self.rt.actions
        for pos, idx in enumerate(rt.order):
            a = actions[idx]
            try:
                _ACTIONS.get(a.op, _StepRun.compute)(self, a)
            except Exception as e:
                e.add_note(format_program(
                    actions, rt.order, pos,
                    header=f"pp rank {rt.pp_rank}, step {self.step}: action {a} failed "
                           f"({pos} of {len(rt.order)} in schedule {rt.program.name}'s issue order):"))
                raise
        for h in self.sends:
            h.wait()
        self._flush_timeline()
        if self.recvs or self.outputs or self.deferred:
            raise RuntimeError(f"schedule left work undone on pp rank {rt.pp_rank}: "
                               f"receives {list(self.recvs)}, outputs {list(self.outputs)}, "
                               f"deferred W {list(self.deferred)}")
        return self.loss_total

    # -- communication actions ----------------------------------------------------------------
    def recv_f(self, a: Action) -> None:
        st = self.stages[a.stage]
        buf = torch.empty(st.recv_f_shape, dtype=self.rt.act_dtype, device=self.rt.device)
        self.recvs[("F", a.stage, a.microbatch)] = self.rt.comm.irecv(
            buf, st.prev_peer, tag=st.tag_recv_f + a.microbatch)

    def recv_b(self, a: Action) -> None:
        st = self.stages[a.stage]
        buf = torch.empty(st.recv_b_shape, dtype=self.rt.act_dtype, device=self.rt.device)
        self.recvs[("B", a.stage, a.microbatch)] = self.rt.comm.irecv(
            buf, st.next_peer, tag=st.tag_recv_b + a.microbatch)

    def send_f(self, a: Action) -> None:
        st, key = self.stages[a.stage], (a.stage, a.microbatch)
        out = self.outputs.pop(key) if self.rt.forward_only else self.outputs[key]
        # stage boundaries carry the activation dtype (bf16 under autocast)
        self.sends.append(self.rt.comm.isend(pack(out, st.next_descs, self.rt.act_dtype),
                                             st.next_peer, tag=st.tag_send_f + a.microbatch))

    def send_b(self, a: Action) -> None:
        st = self.stages[a.stage]
        grads = self.grads_to_send.pop((a.stage, a.microbatch))
        self.sends.append(self.rt.comm.isend(pack(grads, st.prev_grad_descs, self.rt.act_dtype),
                                             st.prev_peer,
                                             tag=st.tag_send_b + a.microbatch))

    def wait(self, kind: str, a: Action):
        """A posted receive's buffer, the wait recorded on the timeline."""
        if not self.recording:
            return self.recvs.pop((kind, a.stage, a.microbatch)).wait()
        t0 = self.now()
        value = self.recvs.pop((kind, a.stage, a.microbatch)).wait()
        self.stamps.append(("pp", str(Action("RECV_" + kind, a.stage, a.microbatch)), t0,
                            self.now()))
        return value

    # -- compute actions: F, B, I, W, and a braid of two (F&B, F&I, F&W) -----------------------
    def compute(self, a: Action) -> None:
        """A compute action; a braid runs its two passes step by step, alternating. Inputs are
        gathered first, so the timed interval excludes waits."""
        if a.pair is None:
            passes = [_PREPARE[a.op](self, a)]
        else:
            first = self.forward(a.parts[0])
            # a braid's W is sliced to interleave with its forward's steps
            other = (self.weight(a.pair, first.steps) if a.pair.op == "W"
                     else _PREPARE[a.pair.op](self, a.pair))
            passes = [first, other]
        rt = self.rt
        if not (self.timed or rt.annotate):
            _alternate([p.run for p in passes])
            return
        mark = torch.profiler.record_function(str(a)) if rt.annotate else None
        if mark is not None:
            mark.__enter__()
        t0 = self.now()
        _alternate([p.run for p in passes])
        if rt.slowdown is not None:
            rt.slowdown(t0)
        t1 = self.now()
        if mark is not None:
            mark.__exit__(None, None, None)
        if self.recording:
            self.stamps.append(("compute", str(a), t0, t1))
        if rt.on_compute is not None and not self.gpu_clock:   # host seconds only
            rt.on_compute(str(a), t0, t1)

    def forward(self, a: Action) -> _Pass:
        """F: the stage's inputs gathered (a receive waited for, or a local hand-over), its
        forward a pass of one step, or of one step per unit."""
        s, m, rt = a.stage, a.microbatch, self.rt
        st = self.stages[s]
        x = {}
        if not st.is_first:
            x = unpack(self.wait("F", a), st.recv_descs) if ("F", s, m) in self.recvs \
                else self.local_fwd.pop((s, m))
            x = {k: v.detach() for k, v in x.items()}
            if not rt.forward_only:
                for d in st.recv_descs:
                    x[d.name].requires_grad_(d.has_grad)
                self.inputs[(s, m)] = x
        # a received input widens to fp32, the dtype of the embedding's output, so the
        # residual stream is fp32 on every stage, as on one device
        x = {k: v.float() for k, v in x.items()}
        if rt.units:
            return self._forward_units(st, m, x)

        def whole():
            with rt.autocast():
                out = st.forward(x, self.batches[m], self.positions)
            self._forward_tail(st, m, out)
            yield "F"
        return _Pass(whole())

    def _forward_units(self, st: RuntimeStage, m: int, x: dict) -> _Pass:
        """F unit by unit (runtime/units.py), the loss's collectives (a vocabulary-parallel
        loss's `steps`) yielded to a braid's other pass while they travel."""
        rt, key = self.rt, st.output_key
        steps = getattr(rt.loss_fn, "steps", None) if st.is_last else None

        def tail(out):
            out = out if isinstance(out, dict) else {key: out}   # a MoE stage's is a dict
            if steps is not None:
                return self._forward_tail(
                    st, m, out, (yield from steps(out["logits"], self.batches[m]["labels"])))
            return self._forward_tail(st, m, out)

        unit = UnitPass(st.module, self.batches[m]["tokens"] if st.is_first else x["hidden"],
                        self.positions, tail, rt.autocast, grad=not rt.forward_only,
                        extra={k: v for k, v in x.items() if k != "hidden"})
        if not rt.forward_only:
            self.unit_passes[(st.index, m)] = unit
        return _Pass(unit.forward_steps(), unit.turns)

    def _forward_tail(self, st: RuntimeStage, m: int, out: dict, loss=None):
        """What a stage's output becomes: the scaled loss on the last stage (in fp32, outside
        autocast), a local hand-over to the next stage on this rank, and kept for the backward
        or until its SEND_F."""
        if st.is_last:
            if loss is None:
                loss = self.rt.loss_fn(out["logits"], self.batches[m]["labels"])
            out = loss * self.loss_scale
            self.loss_total = self.loss_total + out.detach()
        if st.local_next:
            act_dtype = self.rt.act_dtype
            self.local_fwd[(st.index + 1, m)] = {d.name: out[d.name].detach().to(act_dtype)
                                                 for d in st.io.send}
        if not self.rt.forward_only or not (st.local_next or st.is_last):
            self.outputs[(st.index, m)] = out
        return out

    def backward(self, a: Action) -> _Pass:
        """B (full backward) or I (input gradient only, the weight gradients deferred to W)."""
        s, m = a.stage, a.microbatch
        st = self.stages[s]
        grad = None
        if not st.is_last:
            grad = unpack(self.wait("B", a), st.grad_descs) if ("B", s, m) in self.recvs \
                else self.local_bwd.pop((s, m))
        out = self.outputs.pop((s, m))
        if self.rt.units:
            steps = self.unit_passes.pop((s, m)).backward_steps(
                None if st.is_last else grad if st.io_dict else grad["hidden"])
        else:
            steps = iter([lambda: st.backward(out, grad)])
        return _Pass(self._backward_steps(a, st, steps), 0)

    def _backward_steps(self, a: Action, st: RuntimeStage, steps):
        wstore = self.rt.wstore
        while True:
            # weight gradients are deferred during this pass's steps only (a braid's forward
            # steps run in between)
            wstore.deferring = a.op == "I"
            try:
                step = next(steps)
                if callable(step):
                    step()
            except StopIteration:
                break
            finally:
                wstore.deferring = False
            yield a.op
        key = (st.index, a.microbatch)
        if a.op == "I":
            self.deferred[key] = wstore.take()
        if not st.is_first:
            received = self.inputs.pop(key)
            g = {d.name: grad_of(received[d.name]) for d in st.recv_descs if d.has_grad}
            if st.local_prev:
                self.local_bwd[(st.index - 1, a.microbatch)] = g
            else:
                self.grads_to_send[key] = g

    def weight(self, a: Action, chunks: int = 1) -> _Pass:
        """W: the weight gradients its I deferred, in `chunks` slices (a braid's forward steps
        run in between)."""
        items = self.deferred.pop((a.stage, a.microbatch))
        size = max(1, -(-len(items) // max(1, chunks)))

        def steps():
            for k in range(0, len(items), size):
                WeightGradStore.flush(items[k:k + size])
                yield "W"
        return _Pass(steps())

    def _flush_timeline(self) -> None:
        if not self.stamps:
            return
        if self.gpu_clock:
            torch.cuda.current_stream(self.rt.device).synchronize()   # tracing only
            ms = self.t_origin.elapsed_time
        else:
            def ms(t):
                return (t - self.t_origin) * 1e3
        self.rt.events.extend(Event(self.rt.comm.rank, stream, name, ms(t0), ms(t1), self.step)
                              for stream, name, t0, t1 in self.stamps)


_ACTIONS = {"RECV_F": _StepRun.recv_f, "RECV_B": _StepRun.recv_b,
            "SEND_F": _StepRun.send_f, "SEND_B": _StepRun.send_b}   # the rest: compute
_PREPARE = {"F": _StepRun.forward, "B": _StepRun.backward, "I": _StepRun.backward,
            "W": _StepRun.weight}


class _Pass:
    """One plain action's work as a generator of steps (`steps`: how many, where known)."""

    __slots__ = ("run", "steps")

    def __init__(self, run, steps: int = 1):
        self.run, self.steps = run, steps


def _alternate(runs: list) -> None:
    """Run generators to the end, one step of each in turn."""
    if len(runs) == 1:
        for _ in runs[0]:
            pass
        return
    while runs:
        for r in list(runs):
            try:
                next(r)
            except StopIteration:
                runs.remove(r)
