"""Tensor parallelism (Megatron-LM) applied to a plain MoE decoder stage (commpipe.models.moe).

    attention:  wq, wk, wv column-parallel (heads split), wo row-parallel (grouped-query only)
    embedding:  vocabulary-parallel;  head: column-parallel, vocabulary-parallel loss
    dense MLP:  w1, w3 column-parallel, w2 row-parallel, `f` before and `g` after (as LLaMA's)
    MoE layer:  expert tensor parallelism, as Megatron-Core's with --expert-tensor-parallel-size
                equal to --tensor-model-parallel-size (its default): every routed expert's gate
                and up projections (w1, w3 [E, f, h]) split by output columns (tp_dim 1), its
                down projection (w2 [E, h, f]) by input columns (tp_dim 2); the shared experts
                split as a dense MLP; the router replicated.

A MoE layer under TP (`TensorParallelMoELayer`) sees the whole sequence on every TP rank (the
attention's all-reduce gave it), so every rank routes the same tokens to the same experts and,
under expert parallelism, exchanges them with the ranks of its own EP group (the ranks at the
same TP position, which hold the same TP slice of other experts). Each rank's experts then give
a partial sum over TP of each token copy's output, and so do the shared experts. Three
collectives make the layer equal the one-device layer:

    f on the tokens entering the experts (routed and shared): identity forward; backward, the
        all-reduce of their input gradient, a partial sum over TP
    g after the combine: the routed copies weighted and summed per token plus the shared
        experts' output, both partial sums, reduced in one all-reduce (the MLP's one forward
        collective, where a dense MLP has its w2 all-reduce; the routed part adds none)
    f on the gate weights [T, k]: identity forward; backward, the all-reduce of their gradient,
        which each rank computes from its partial expert outputs, so the router and the
        layer's input get the whole gradient on every TP rank and the router stays replicated.
        It is the one collective TP inside experts adds: T k values per layer and micro-batch,
        k/h of the input gradient's all-reduce (Megatron-Core avoids it by applying the
        weights after its reduce-scatter, which needs sequence parallelism)

The router's own input is outside f: its gradient (from the gate weights and the balancing loss)
is whole on every rank already. Under the braided schedules the unit-by-unit runtime calls the
same methods (route, unit_dispatch, unit_combine), so these collectives run inside the units,
blocking, as the attention's do.
"""

from __future__ import annotations

import torch
from torch import nn

from commpipe.models.moe import GroupedExperts, MoELayer, Routing, SwiGLU
from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import copy_to, reduce_from
from commpipe.parallel.placement import place
from commpipe.parallel.tensor import VocabParallelEmbedding, _shard_
from commpipe.parallel.weight_grad import route_linear

EXPERT_TP_DIMS = {"w1": 1, "w3": 1, "w2": 2}   # stacked [E, f, h], [E, f, h], [E, h, f]


def _enter(module: nn.Module, comm: Comm) -> None:
    """`f` (identity forward, all-reduce backward) on the module's first input."""

    def pre(mod, args):
        return (copy_to(args[0], comm, "tp"), *args[1:])

    module.register_forward_pre_hook(pre)


def _shard_swiglu_(mlp: SwiGLU, comm: Comm) -> None:
    """w1, w3 column-parallel, w2 row-parallel, in place; no collective."""
    _shard_(mlp.w1, 0, comm)
    _shard_(mlp.w3, 0, comm)
    _shard_(mlp.w2, 1, comm)


def shard_experts_(experts: GroupedExperts, comm: Comm) -> None:
    """Each expert's slice of f on this TP rank, in place: w1, w3 by output columns, w2 by input
    columns (EXPERT_TP_DIMS)."""
    tp, tp_rank = comm.size("tp"), comm.local_rank("tp")
    for name, dim in EXPERT_TP_DIMS.items():
        shard = getattr(experts, name).detach().chunk(tp, dim=dim)[tp_rank]
        p = nn.Parameter(shard.clone())
        place(p, tp_dim=dim)
        setattr(experts, name, p)


class TensorParallelMoELayer(MoELayer):
    """A MoELayer whose routed and shared experts hold this TP rank's slice of their width; the
    router is replicated (module docstring: the three collectives)."""

    def __init__(self, layer: MoELayer, comm: Comm):
        nn.Module.__init__(self)
        self.spec, self.comm = layer.spec, comm
        self.router, self.experts, self.shared = layer.router, layer.experts, layer.shared
        shard_experts_(self.experts, comm)
        if self.shared is not None:
            _shard_swiglu_(self.shared, comm)

    def route(self, x: torch.Tensor) -> Routing:
        r = super().route(x)
        r.weights = self.weigh(r.weights)
        return r

    def weigh(self, weights: torch.Tensor) -> torch.Tensor:
        """`f` on the gate weights [T, k]: their gradient summed over TP."""
        return copy_to(weights, self.comm, "tp")

    def unit_dispatch(self, flat: torch.Tensor, r: Routing):
        return super().unit_dispatch(copy_to(flat, self.comm, "tp"), r)

    def unit_combine(self, y: torch.Tensor, r: Routing, shared: torch.Tensor | None):
        """The partial sums over TP of the routed and shared outputs, added, then one
        all-reduce: [T, h] whole on every TP rank."""
        return reduce_from(super().unit_combine(y, r, shared), self.comm, "tp")


def apply_tp_moe(model: nn.Module, comm: Comm) -> nn.Module:
    """Shard a MoE stage in place across comm's TP group (module docstring); a no-op when
    tp=1. Apply before expert parallelism (commpipe.parallel.expert.apply_ep), which keeps
    the experts' TP placement."""
    if comm.size("tp") == 1:
        return model
    for block in model.layers.values():
        attn = block.attention
        for name in ("wq", "wk", "wv"):
            _shard_(getattr(attn, name), 0, comm)
        _shard_(attn.wo, 1, comm)
        # routed now, so a zero-bubble schedule's I/W split defers this weight too
        route_linear(attn.wo, reduce=lambda y: reduce_from(y, comm, "tp"))
        _enter(attn, comm)
        if block.is_moe:
            block.feed_forward = TensorParallelMoELayer(block.feed_forward, comm)
        else:
            ff = block.feed_forward
            _shard_swiglu_(ff, comm)
            route_linear(ff.w2, reduce=lambda y: reduce_from(y, comm, "tp"))
            _enter(ff, comm)
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, comm)
    if model.output is not None:
        _shard_(model.output, 0, comm)
        _enter(model.output, comm)
    return model
