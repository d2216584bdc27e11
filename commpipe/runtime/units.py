"""A LLaMA stage run unit by unit, for braided schedules (STP, DualPipeV).

A stage's pass over one micro-batch becomes a list of steps: the embedding (first stage), then
per layer the four units of `Block` (pre_attn, attn, pre_mlp, mlp), then the last residual add
(with the final norm on the last stage, then the head, whose output the loss reads). Steps are
separate autograd graphs joined by leaf tensors, so the backward also runs step by step, in
reverse. `forward_steps` and `backward_steps` are generators that yield after each step; the
executor alternates two of them for a braid.

With tensor parallelism the layer's four collectives sit on the edges between steps instead of
inside the modules, and so do the vocabulary-parallel embedding's sum (an exit edge) and the
head's input (an enter edge): the stage's `TPStage.use_units` (commpipe.parallel.tensor) moves
them out of the module hooks. An edge's forward
collective is issued asynchronously when its producer finishes and waited by its consumer, and
its adjoint is issued when the consumer's backward finishes and waited by the producer's
backward. Between the two, the executor runs a step of the other pass of the braid:

    edge                      forward                      backward (adjoint)
    norm -> attention / MLP   identity (SP: all-gather)    all-reduce (SP: reduce-scatter)
    attention / MLP -> add    all-reduce (SP: reduce-sc.)  identity (SP: all-gather)

The values are those of `Block.forward` with the hooks in place: the same operations in the same
order. With overlap on, the column-parallel Linears' weight-gradient GEMMs (stashed in their
`TPRegion`) run while the input-gradient collective of their edge travels, as in the whole-stage
path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from commpipe.models.llama import PreNormUnits, Transformer
from commpipe.models.moe import MoEBlock
from commpipe.parallel.functional import all_gather_seq, reduce_scatter_seq
from commpipe.parallel.tensor import TPStage

ENTER, EXIT = "enter", "exit"


class _InFlight:
    """A collective issued on an edge; `value()` waits for it."""

    def __init__(self, handle):
        self.handle = handle
        self.root = None        # the producer's output, kept only as its backward's root

    def value(self) -> torch.Tensor:
        out = self.handle.wait()
        if self.root is not None:
            _release(self.root)
        return out


def _release(root: torch.Tensor) -> None:
    """Free a backward root's values and keep its graph: the collective has read them, and the
    backward needs only the node (and a tensor of the root's shape to start from). Without this
    a layer's row-parallel partial sums (full sequence) would stay alive until its backward,
    which the whole-stage path never keeps."""
    root.data = torch.empty(1, dtype=root.dtype, device=root.device).expand(root.shape)


def _issue(tp, kind, backward: bool, t: torch.Tensor):
    """The collective of one edge (table above), issued asynchronously; a tensor when the edge
    moves nothing. `kind` may instead be an edge that issues its own collective
    (`kind.issue(t, backward)`), as expert parallelism's all-to-alls (runtime/units_moe.py)."""
    if not isinstance(kind, str):
        return _InFlight(kind.issue(t.contiguous(), backward))
    comm, sp = tp.comm, tp.sequence_parallel
    gather = (kind == ENTER) != backward           # enter forward / exit backward gather
    if sp:                                         # along the sequence, as GatherSeq / ScatterSeq
        op = all_gather_seq if gather else reduce_scatter_seq
        return _InFlight(op(t, comm, "tp", async_op=True))
    if gather:                                     # identity without sequence parallelism
        return t
    buf = t.detach().contiguous().clone()
    return _InFlight(comm.all_reduce(buf, "tp", async_op=True))


def _resolve(v):
    return v.value() if isinstance(v, _InFlight) else v


@dataclass
class _Step:
    unit: str
    fn: object                     # (*inputs) -> tuple of outputs
    ins: tuple                     # edge names read
    outs: tuple                    # edge names written
    kinds: tuple                   # per output: None, ENTER, EXIT (its edge's collective) or an
                                   # edge object with issue(t, backward)
    tp: TPStage | None = None      # the stage's TP (None: tp=1, edges move nothing)
    region: object = None          # TPRegion to flush while the input's adjoint travels
    leaves: list = field(default_factory=list)
    results: tuple = ()


def supports_units(module) -> bool:
    """A LLaMA stage (layers of `Block`) or a MoE stage (layers of `MoEBlock`), whose blocks
    are cut into units (`PreNormUnits`), runs unit by unit; other stages run whole."""
    layers = getattr(module, "layers", None)
    return layers is not None and len(layers) > 0 and \
        all(isinstance(b, PreNormUnits) for b in layers.values())


def stage_tp(module) -> TPStage | None:
    """The TP whose collectives a unit-by-unit LLaMA stage moves onto its edges (None: tp=1).
    A MoE stage keeps its TP collectives inside its modules (commpipe.parallel.tensor_moe)."""
    return module.tp if isinstance(module, Transformer) else None


def use_unit_collectives(module, on: bool = True) -> None:
    """Move the TP collectives of `module`'s layers, embedding and head onto the unit edges
    (or back)."""
    tp = stage_tp(module)
    if tp is not None:
        tp.use_units(on)


def _layer_steps(i: str, block, tp: TPStage | None, positions, h: str,
                 m: str | None) -> list[_Step]:
    """Block i's four units; (h, m) name the previous layer's residual and MLP output (m None:
    the stage input, nothing to add)."""
    enter, exit_ = (ENTER, EXIT) if tp is not None else (None, None)
    regions = tp.layers[i] if tp is not None else None

    def pre_attn(*hm):
        x = hm[0] if len(hm) == 1 else block.residual(*hm)
        return x, block.unit_pre_attn(x)

    return [
        _Step("pre_attn", pre_attn, (h,) if m is None else (h, m), (f"{i}.x", f"{i}.n"),
              (None, enter), tp),
        _Step("attn", lambda n: (block.unit_attn(n, positions),), (f"{i}.n",), (f"{i}.a",),
              (exit_,), tp, regions.attn_region if regions else None),
        _Step("pre_mlp", block.unit_pre_mlp, (f"{i}.x", f"{i}.a"), (f"{i}.h", f"{i}.n2"),
              (None, enter), tp),
        _Step("mlp", lambda n: (block.unit_mlp(n),), (f"{i}.n2",), (f"{i}.m",), (exit_,), tp,
              regions.mlp_region if regions else None),
    ]


class UnitPass:
    """One micro-batch through one LLaMA stage, step by step.

    `x`: the stage input (tokens on the first stage, else the received hidden state: a leaf
    whose `.grad` the executor reads). `tail(out)`: a generator returning what the stage output
    becomes (the scaled loss on the last stage, run outside autocast, yielding while the loss's
    collectives travel; else the dict the executor sends).
    `autocast()`: a context for the steps. `grad=False`: forward only, nothing kept.
    `extra`: further stage inputs by name (a MoE stage's carried balancing term), read as edges
    `in.<name>`; a stage whose output is a dict of such tensors (MoE) takes its gradient as a
    dict too."""

    def __init__(self, module, x, positions, tail, autocast, grad: bool = True,
                 extra: dict | None = None):
        self.tail, self.autocast, self.grad = tail, autocast, grad
        self.env: dict = {"in": x}          # edge name -> tensor or collective in flight
        self.env.update({f"in.{k}": v for k, v in (extra or {}).items()})
        self.stage_inputs = set(self.env)   # leaves the executor reads .grad of
        self.edges: dict = {}               # edge name -> (collective or None, its TPLayer)
        self.grads: dict = {}               # edge name -> gradient or adjoint in flight
        self.output = None
        # A MoE pass hands the braid's turn to the other pass only where it has an all-to-all
        # in flight (runtime/units_moe.py), so each exchange travels behind the other pass's
        # whole run of units up to its own next exchange (DualPipe pairs attention and MLP
        # compute with the other pass's dispatch and combine the same way); a LLaMA pass yields
        # after every unit.
        self.at_edges = any(isinstance(b, MoEBlock) for b in module.layers.values())
        if self.at_edges:
            from commpipe.runtime.units_moe import moe_plan

            self.steps = moe_plan(module, x, "in.aux" in self.env)
        else:
            self.steps = self._plan(module, positions)

    @property
    def turns(self) -> int:
        """How often forward_steps yields before its tail (a braid slices its W to match)."""
        if not self.at_edges:
            return len(self.steps)
        return max(1, sum(any(k is not None for k in s.kinds) for s in self.steps))

    @staticmethod
    def _plan(mod, positions) -> list[_Step]:
        tp = stage_tp(mod)
        enter, exit_ = (ENTER, EXIT) if tp is not None else (None, None)
        steps, h, m = [], "in", None
        if mod.tok_embeddings is not None:      # vocabulary-parallel: partial lookups summed
            steps.append(_Step("embed", lambda t: (mod.tok_embeddings(t),), ("in",), ("e",),
                               (exit_,), tp))
            h = "e"
        for i, block in mod.layers.items():
            steps += _layer_steps(i, block, tp, positions, h, m)
            h, m = f"{i}.h", f"{i}.m"
        if mod.output is None:
            steps.append(_Step("end", lambda h, m: (block.residual(h, m),), (h, m), ("out",), (None,)))
            return steps
        # the last stage: the final norm, then the column-parallel head on the gathered input
        steps.append(_Step("end", lambda h, m: (mod.norm(block.residual(h, m)),), (h, m), ("n",),
                           (enter,), tp))
        steps.append(_Step("head", lambda n: (mod.output(n),), ("n",), ("out",), (None,), tp,
                           tp.head_region if tp else None))
        return steps

    def forward_steps(self):
        """Run the steps in order, yielding after each (or, `at_edges`, after each that leaves
        a collective in flight); then `self.output` holds the tail."""
        for step in self.steps:
            issued = False
            args = []
            for name in step.ins:
                v = _resolve(self.env.pop(name))
                if name not in self.stage_inputs and self.grad and v.is_floating_point():
                    v = v.detach().requires_grad_()
                args.append(v)
            with self.autocast():
                outs = step.fn(*args)
            if self.grad:
                step.leaves, step.results = args, outs
            for name, out, kind in zip(step.outs, outs, step.kinds):
                self.edges[name] = (kind, step.tp)
                sent = _issue(step.tp, kind, False, out.detach()) if kind else out
                if isinstance(sent, _InFlight) and self.grad:
                    sent.root = out
                self.env[name] = sent
                issued |= isinstance(sent, _InFlight)
            if issued or not self.at_edges:
                yield step.unit
        self.output = yield from self.tail(_resolve(self.env.pop("out")))
        if not self.grad:
            self.steps = []

    def backward_steps(self, grad_out):
        """Back-propagate step by step in reverse, yielding after each. `grad_out`: the
        gradient of the stage output, or None on the last stage (backward from the scalar
        loss). The stage input's gradient lands in its `.grad`. `at_edges`: yields only after
        the steps that leave an adjoint in flight."""
        for step in reversed(self.steps):
            issued = False
            if step.outs == ("out",):
                out = step.results[0]
                if grad_out is None:
                    torch.autograd.backward(self.output)
                elif isinstance(grad_out, dict):    # every sent tensor that carries a gradient
                    sent = [(out[k], g) for k, g in grad_out.items() if out[k].requires_grad]
                    torch.autograd.backward([t for t, _ in sent], [g.to(t.dtype) for t, g in sent])
                else:
                    torch.autograd.backward(out, grad_out.to(out.dtype))
            else:
                pairs = [(out, _resolve(self.grads.pop(name)))
                         for name, out in zip(step.outs, step.results) if out.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs],
                                            [g.to(o.dtype) for o, g in pairs])
            for name, leaf in zip(step.ins, step.leaves):
                if name in self.stage_inputs or not leaf.requires_grad:
                    continue
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                kind, tp = self.edges[name]
                self.grads[name] = _issue(tp, kind, True, g) if kind else g
                issued |= isinstance(self.grads[name], _InFlight)
            if step.region is not None and self.edges[step.ins[0]][0] == ENTER:
                step.region.flush()      # dW GEMMs while the input-gradient collective travels
            step.leaves, step.results = [], ()
            if issued or not self.at_edges:
                yield step.unit
        self.steps = []

