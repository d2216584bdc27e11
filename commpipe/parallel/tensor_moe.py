"""Tensor parallelism (Megatron-LM) applied to a plain MoE decoder stage (commpipe.models.moe).

    attention:  wq, wk, wv column-parallel (heads split), wo row-parallel (grouped-query only)
    embedding:  vocabulary-parallel;  head: column-parallel, vocabulary-parallel loss
    MLP:        the router, the routed and shared experts and dense MLPs stay replicated: every
                TP rank routes the whole (all-reduced) sequence through the same experts, so
                their gradients agree on every TP rank without a reduction (as LLaMA's norms
                without sequence parallelism). Sharding experts is expert parallelism's job
                (commpipe.parallel.expert); tensor parallelism inside experts is not applied.
"""

from __future__ import annotations

from torch import nn

from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import copy_to, reduce_from
from commpipe.parallel.tensor import VocabParallelEmbedding, _shard_
from commpipe.parallel.weight_grad import route_linear


def _enter(module: nn.Module, comm: Comm) -> None:
    """`f` (identity forward, all-reduce backward) on the module's first input."""

    def pre(mod, args):
        return (copy_to(args[0], comm, "tp"), *args[1:])

    module.register_forward_pre_hook(pre)


def apply_tp_moe(model: nn.Module, comm: Comm) -> nn.Module:
    """Shard a MoE stage's attention, embedding and head in place across comm's TP group; a
    no-op when tp=1."""
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
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, comm)
    if model.output is not None:
        _shard_(model.output, 0, comm)
        _enter(model.output, comm)
    return model
