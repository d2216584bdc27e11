"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) applied to a plain `Transformer`.

    attention:  wq, wk, wv column-parallel (heads split), wo row-parallel
    MLP:        w1, w3 column-parallel, w2 row-parallel
    embedding:  vocabulary-parallel (rows split; out-of-range tokens masked, then all-reduce)
    head:       column-parallel over the vocabulary, loss by vocabulary-parallel cross-entropy

Each block gets `f` (copy into the TP region) on its attention and MLP inputs and `g` (reduce
out of it) on the outputs of wo and w2, installed as module hooks: the model code stays plain.

Sequence parallelism (Korthikanti et al. 2022): the residual stream, the norms and the stage
boundaries hold 1/tp of the sequence ([b, s/tp, h]); `f` becomes an all-gather along the
sequence and `g` a reduce-scatter; the embedding reduce-scatters instead of all-reducing. The
norm weights then see only their rank's tokens: their placement is `sp_partial` and their
gradients are summed over TP (commpipe.parallel.data) before the DP reduction.

With overlap, the column-parallel Linears behind each entry stash their weight-gradient GEMMs
in that entry's `TPRegion`, run while the input-gradient collective travels (functional.py).
With sequence parallelism and `forward_overlap`, the entry hook also computes those Linears
itself, their GEMMs over the rank's own rows beside the all-gather (`gather_seq_columns`); each
Linear (a `DeferrableLinear`, commpipe.parallel.weight_grad) then returns the output computed
for it (its `ready`).
Sharded parameters' placement (commpipe.parallel.placement) names `tp_dim`, the dimension split
across TP ranks, which checkpoints and the equivalence tests use to reassemble full tensors.

The stage's `tp` (a `TPStage`) is what the hooks and a unit-by-unit runtime (commpipe.runtime.units)
share: the group, each layer's overlap regions, and `by_units`, whether the hooks issue the
collectives or that runtime does, between its units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.llama import Transformer, cross_entropy_sum
from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import (
    TPRegion,
    copy_to,
    gather_seq,
    gather_seq_columns,
    reduce_from,
    scatter_seq,
)
from commpipe.parallel.placement import place
from commpipe.parallel.weight_grad import route_linear

COLUMN = ("wq", "wk", "wv", "w1", "w3")   # output features split: dim 0 of the weight
ROW = ("wo", "w2")                         # input features split: dim 1 of the weight


def _shard_(linear: nn.Linear, dim: int, comm: Comm) -> None:
    shard = linear.weight.detach().chunk(comm.size("tp"), dim=dim)[comm.local_rank("tp")]
    linear.weight = nn.Parameter(shard.clone())
    place(linear.weight, tp_dim=dim)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding table; tokens outside are looked up as zeros and the
    partial results summed across TP ranks (Megatron-LM, VocabParallelEmbedding)."""

    def __init__(self, full: nn.Embedding, comm: Comm, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.sequence_parallel = comm, sequence_parallel
        vocab = full.num_embeddings
        per_rank = vocab // comm.size("tp")
        self.start = comm.local_rank("tp") * per_rank
        self.end = self.start + per_rank
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone())
        place(self.weight, tp_dim=0)
        # True: the partial lookups are returned unsummed, a unit-by-unit runtime sums them on
        # its edge (set with the stage's TPStage.use_units)
        self.by_units = False

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        if self.by_units:
            return out
        if self.sequence_parallel:
            return scatter_seq(out, self.comm, "tp")          # [b, s/tp, h]
        return reduce_from(out, self.comm, "tp")


class _VocabParallelCE(torch.autograd.Function):
    """Summed cross-entropy over logits split along the vocabulary, from the TP-global row maxima,
    sums of exponentials and target logits (`vocab_parallel_ce_steps` all-reduces them); the
    full [tokens, vocab] logits never exist on one rank."""

    @staticmethod
    def forward(ctx, logits, exp, sum_exp, target, local_labels, inside):
        loss = (sum_exp.log() - target).sum()
        ctx.save_for_backward(exp / sum_exp[:, None], local_labels, inside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_labels, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[inside], local_labels[inside]] -= 1.0
        return g * grad, None, None, None, None, None


def vocab_parallel_ce_steps(logits, labels, comm: Comm, start: int):
    """The vocabulary-parallel cross-entropy (Megatron-LM, vocab_parallel_cross_entropy) as a
    generator: it yields after issuing each of its two all-reduces (the row maxima; then the
    sums of exponentials and the target logits in one call, where Megatron makes two) and
    returns the summed loss, so a braid can run a step of its other pass while they travel."""
    x = logits.detach().float()
    logits_max = x.max(dim=-1).values
    handle = comm.all_reduce(logits_max, "tp", op="max", async_op=True)
    yield "loss"
    handle.wait()
    shifted = x - logits_max[:, None]
    exp = shifted.exp()
    inside = (labels >= start) & (labels < start + x.shape[-1])
    local_labels = (labels - start).masked_fill(~inside, 0)
    target = shifted.gather(1, local_labels[:, None]).squeeze(1).masked_fill(~inside, 0.0)
    sums = torch.stack([exp.sum(dim=-1), target])
    handle = comm.all_reduce(sums, "tp", async_op=True)
    yield "loss"
    handle.wait()
    return _VocabParallelCE.apply(logits, exp, sums[0], sums[1], local_labels, inside)


def run_steps(gen):
    """Run a generator of steps to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def make_loss_fn(comm: Comm, head: nn.Linear | None):
    """Summed token cross-entropy for this rank's logits (full or vocabulary shard). With a
    vocabulary shard it also has `.steps(logits, labels)`: the same loss as a generator that
    yields while its collectives travel (`vocab_parallel_ce_steps`)."""
    if comm.size("tp") == 1 or head is None:
        return cross_entropy_sum
    start = comm.local_rank("tp") * head.weight.shape[0]

    def steps(logits, labels):
        return vocab_parallel_ce_steps(logits.flatten(0, -2), labels.flatten(), comm, start)

    def loss_fn(logits, labels):
        return run_steps(steps(logits, labels))

    loss_fn.steps = steps
    return loss_fn


@dataclass(eq=False)
class TPLayer:
    """A sharded layer's two TP regions, attention (wq, wk, wv -> wo) and MLP (w1, w3 -> w2): the
    `TPRegion` each region's column-parallel Linears stash their weight-gradient GEMMs in, to
    run beside the region's input-gradient collective (None: overlap off)."""

    attn_region: TPRegion | None = None
    mlp_region: TPRegion | None = None


@dataclass(eq=False)
class TPStage:
    """A stage's tensor parallelism as its module hooks and a unit-by-unit runtime
    (commpipe.runtime.units) read it; `apply_tp` sets it as the stage's `tp`.

      comm, sequence_parallel  the TP group, and whether sequence parallelism is on
      layers      per block name, its `TPLayer` (overlap regions)
      head_region the column-parallel head's overlap region (None: no head, or overlap off)
      embedding   the stage's `VocabParallelEmbedding`, or None
      by_units    False: the module hooks issue the stage's TP collectives (f or the all-gather
                  before attention, MLP and head; g or the reduce-scatter after wo and w2; the
                  embedding's sum). True: a unit-by-unit runtime issues them asynchronously on
                  the edges between its units and the hooks step aside. Set with `use_units`.
    """

    comm: Comm
    sequence_parallel: bool
    layers: dict[str, TPLayer] = field(default_factory=dict)
    head_region: TPRegion | None = None
    embedding: VocabParallelEmbedding | None = None
    by_units: bool = False

    def use_units(self, on: bool) -> None:
        """Hand every TP collective of the stage to a unit-by-unit runtime (on) or back to the
        module hooks."""
        self.by_units = on
        if self.embedding is not None:
            self.embedding.by_units = on


def apply_tp(model: Transformer, comm: Comm, sequence_parallel: bool = False,
             overlap: bool = False, forward_overlap: bool = False) -> Transformer:
    """Shard `model` in place across comm's TP group; a no-op when tp=1. `overlap`: the
    backward's input-gradient collectives beside the weight-gradient GEMMs; `forward_overlap`
    (with sequence parallelism): the forward all-gathers beside the GEMMs over own rows."""
    if comm.size("tp") == 1:
        return model
    stage = TPStage(comm, sequence_parallel)

    def entry(module: nn.Module, columns: list[nn.Linear]) -> TPRegion | None:
        """`f` (or the SP all-gather) on the module's input; with overlap, the region its
        column-parallel Linears stash their weight-gradient GEMMs in (returned)."""
        region = TPRegion() if overlap else None
        for linear in columns:
            route_linear(linear).wg_region = region
        enter = gather_seq if sequence_parallel else copy_to
        chunked = sequence_parallel and forward_overlap

        def pre(mod, args):
            if stage.by_units:       # the unit-by-unit runtime issues it (runtime/units.py)
                return None
            if chunked:              # gathered input, and the column outputs computed beside it
                x, outs = gather_seq_columns(args[0], comm, "tp", region, columns)
                for linear, y in zip(columns, outs):
                    linear.ready = (x, y)      # DeferrableLinear.forward returns it
                return (x, *args[1:])
            return (enter(args[0], comm, "tp", region), *args[1:])

        module.register_forward_pre_hook(pre)
        return region

    def post_g(module, args, out):
        if stage.by_units:
            return None
        return (scatter_seq if sequence_parallel else reduce_from)(out, comm, "tp")

    for name, block in model.layers.items():
        for parent in (block.attention, block.feed_forward):
            for linear in COLUMN + ROW:
                if hasattr(parent, linear):
                    _shard_(getattr(parent, linear), 0 if linear in COLUMN else 1, comm)
        stage.layers[name] = TPLayer(*(
            entry(parent, [getattr(parent, n) for n in COLUMN if hasattr(parent, n)])
            for parent in (block.attention, block.feed_forward)))
        for row in (block.attention.wo, block.feed_forward.w2):
            row.register_forward_hook(post_g)
        if sequence_parallel:
            place(block.attention_norm.weight, sp_partial=True)
            place(block.ffn_norm.weight, sp_partial=True)
    if model.tok_embeddings is not None:
        model.tok_embeddings = stage.embedding = VocabParallelEmbedding(
            model.tok_embeddings, comm, sequence_parallel)
    if model.output is not None:
        _shard_(model.output, 0, comm)
        stage.head_region = entry(model.output, [model.output])
        if sequence_parallel:
            place(model.norm.weight, sp_partial=True)
    model.tp = stage
    return model
