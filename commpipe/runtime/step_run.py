"""One step of a rank's lowered program, run with real tensors (`StepRun`, made by
`commpipe.runtime.executor.PipelineRuntime.run_step`).

The step's state (posted receives, kept inputs and outputs, gradients waiting for their send,
deferred weight gradients, unit-by-unit passes) lives on the `StepRun`, with one method per
action kind dispatched from a table, as torch pipelining's `_perform_action` does. Compute
actions (F, B, I, W) become generators of steps (`_Pass`), so a braided action can alternate
its two passes' units (`_alternate`); a plain action runs its one step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from commpipe.runtime.messages import pack, unpack
from commpipe.runtime.stage import RuntimeStage, format_program, grad_of
from commpipe.runtime.units import UnitPass
from commpipe.runtime.weight_grad import WeightGradStore
from commpipe.schedules.actions import Action
from commpipe.timeline import Event

if TYPE_CHECKING:
    from commpipe.runtime.executor import PipelineRuntime


class StepRun:
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
                _ACTIONS.get(a.op, StepRun.compute)(self, a)
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


_ACTIONS = {"RECV_F": StepRun.recv_f, "RECV_B": StepRun.recv_b,
            "SEND_F": StepRun.send_f, "SEND_B": StepRun.send_b}   # the rest: compute
_PREPARE = {"F": StepRun.forward, "B": StepRun.backward, "I": StepRun.backward,
            "W": StepRun.weight}


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
