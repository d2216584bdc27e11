"""Tensor parallelism (Megatron-LM) applied to a plain BLIP-style stage (commpipe.models.blip).

Both towers are split as LLaMA is (commpipe.parallel.tensor), by hooks and parameter swaps, so the
model code stays plain:

    attention (ViT self-, decoder causal self- and cross-attention):
                wq, wk, wv column-parallel (heads split), wo row-parallel
    MLP:        fc1 column-parallel, fc2 row-parallel
    text words: vocabulary-parallel embedding
    LM head:    dense and norm replicated, the vocabulary projection column-parallel, the loss by
                vocabulary-parallel cross-entropy over labelled tokens only

Cross-attention's keys and values come from the image features, which every TP rank holds
whole; `f` (identity forward, all-reduce backward) is applied to them as to the text queries, so
each rank's partial gradient of the image features (from its heads' K/V projections) is summed
before it flows back to the encoder. Every Linear here has a bias: a column-parallel bias is
split with its output features; a row-parallel bias is added once, after the all-reduce `g`.
Replicated parameters (patch projection, [CLS], positions, norms, the head's dense) get
identical gradients on every TP rank, as LLaMA's norms do. No sequence parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from commpipe.models.blip import IGNORE, Attention, Blip, DecoderBlock
from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import copy_to, reduce_from
from commpipe.parallel.placement import place
from commpipe.parallel.tensor import VocabParallelEmbedding, _shard_, run_steps, vocab_parallel_ce_steps
from commpipe.parallel.weight_grad import route_linear


def _column(linear: nn.Linear, comm: Comm) -> None:
    _shard_(linear, 0, comm)
    shard = linear.bias.detach().chunk(comm.size("tp"))[comm.local_rank("tp")]
    linear.bias = nn.Parameter(shard.clone())
    place(linear.bias, tp_dim=0)


def _row(linear: nn.Linear, comm: Comm) -> None:
    """Input features split; the partial products are summed across TP, then the bias added.
    Routed through commpipe.parallel.weight_grad now, so that a zero-bubble schedule's I/W split
    (which routes every other Linear later) defers this weight and bias too."""
    _shard_(linear, 1, comm)
    route_linear(linear, reduce=lambda y: reduce_from(y, comm, "tp"))


def _enter(module: nn.Module, comm: Comm) -> None:
    """`f` on every tensor the module is called with (queries, and cross-attention's context)."""

    def pre(mod, args):
        return tuple(copy_to(a, comm, "tp") if isinstance(a, torch.Tensor) else a for a in args)

    module.register_forward_pre_hook(pre)


def _attention(attn: Attention, comm: Comm) -> None:
    for name in ("wq", "wk", "wv"):
        _column(getattr(attn, name), comm)
    _row(attn.wo, comm)
    _enter(attn, comm)


def apply_tp_blip(model: Blip, comm: Comm) -> Blip:
    """Shard a BLIP stage in place across comm's TP group; a no-op when tp=1."""
    if comm.size("tp") == 1:
        return model
    for block in model.layers.values():
        _attention(block.attention, comm)
        if isinstance(block, DecoderBlock):
            _attention(block.cross_attention, comm)
        _column(block.mlp.fc1, comm)
        _row(block.mlp.fc2, comm)
        _enter(block.mlp, comm)
    if model.text_embed is not None:
        model.text_embed.words = VocabParallelEmbedding(model.text_embed.words, comm)
    if model.head is not None:
        _column(model.head.output, comm)
        _enter(model.head.output, comm)
    return model


def vocab_parallel_caption_loss(comm: Comm, head_output: nn.Linear):
    """Summed cross-entropy of the labelled tokens (label != IGNORE) over logits split along the
    vocabulary: padding rows are dropped before the vocabulary-parallel softmax."""
    start = comm.local_rank("tp") * head_output.weight.shape[0]

    def loss_fn(logits, labels):
        logits, labels = logits.flatten(0, -2), labels.flatten()
        keep = labels != IGNORE
        return run_steps(vocab_parallel_ce_steps(logits[keep], labels[keep], comm, start))

    return loss_fn
