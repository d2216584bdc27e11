"""A MoE stage run unit by unit (commpipe.runtime.units), for braided schedules: expert
parallelism's all-to-alls sit on the edges between steps, so each is in flight while the other
pass of the braid computes (DualPipe's overlap, DeepSeek-V3 report section 3.2.1).

Per layer, the units of LLaMA's block (pre_attn, attn, pre_mlp), then a routed MLP cut at its
token exchanges (commpipe.models.moe.MoELayer):

    route     router, top-k, rows per expert
    dispatch  the splits the exchanged counts fix, the local permutation grouping each token's
              copies by expert, and the shared experts (computed here, as DeepSeek-V3 does, so
              they cover the other pass's exchange in flight)
    experts   this rank's experts on the rows it received
    combine   each token's k copies weighted and summed, plus the shared experts' output

    edge                  forward                             backward (adjoint)
    route -> dispatch     all-to-all of the row counts        none (integers)
    dispatch -> experts   dispatch all-to-all (variable)      the reverse all-to-all
    experts -> combine    combine all-to-all (variable)       the reverse all-to-all

Each edge's all-to-all is issued asynchronously through Comm (dim "ep",
commpipe.parallel.expert.ExchangeEdges) when its producer finishes and waited by its consumer;
an adjoint is issued when the consumer's backward finishes and waited by the producer's
backward. The counts have their own edge: a blocking exchange would wait behind the other
pass's all-to-all on the same link. With ep = 1 the edges move nothing. The residual add runs
in the next unit (the next layer's pre_attn or the stage's end), as for LLaMA; a dense layer's
MLP is one unit. Each route step outputs its layer's balancing term and the end step sums the
carried term and the layer terms in layer order, as MoETransformer.forward does, so the values
are those of the whole stage: the same operations in the same order.
"""

from __future__ import annotations

import dataclasses

import torch

from commpipe.parallel.expert import ExpertParallelExperts
from commpipe.runtime.units import _Step


def moe_plan(mod, x: torch.Tensor, carried_aux: bool) -> list[_Step]:
    """The steps of MoE stage `mod` on input x (tokens [b, s] or hidden states [b, s, h]);
    `carried_aux`: the stage receives the balancing term so far (edge `in.aux`)."""
    b, s = x.shape[:2]
    positions = torch.arange(s, device=x.device)
    steps, h, m, terms = [], "in", None, []
    if mod.tok_embeddings is not None:
        steps.append(_Step("embed", lambda t: (mod.tok_embeddings(t),), ("in",), ("e",), (None,)))
        h = "e"
    for i, block in mod.layers.items():
        steps += _layer_steps(mod, i, block, positions, (b, s, mod.spec.hidden), h, m)
        h, m = f"{i}.h", f"{i}.m"
        if block.is_moe:
            terms.append(f"{i}.aux")
    aux_in = ("in.aux",) if carried_aux else ()

    def end(h, m, *aux):
        total = aux[0].reshape(()) if carried_aux else torch.zeros((), device=h.device)
        for term in aux[len(aux_in):]:
            total = total + term
        h = block.residual(h, m)
        return (mod.outputs(mod.output(mod.norm(h)) if mod.output is not None else h, total),)

    steps.append(_Step("end", end, (h, m, *aux_in, *terms), ("out",), (None,)))
    return steps


def _layer_steps(mod, i: str, block, positions, shape, h: str, m: str | None) -> list:
    """Block i's units; (h, m) name the previous layer's residual and MLP output (m None: the
    stage input, nothing to add); shape: the hidden states' [b, s, h]."""
    tokens = shape[0] * shape[1]

    def pre_attn(*hm):
        x = hm[0] if len(hm) == 1 else block.residual(*hm)
        return x, block.unit_pre_attn(x)

    steps = [
        _Step("pre_attn", pre_attn, (h,) if m is None else (h, m), (f"{i}.x", f"{i}.n"),
              (None, None)),
        _Step("attn", lambda n: (block.unit_attn(n, positions),), (f"{i}.n",), (f"{i}.a",),
              (None,)),
    ]
    if not block.is_moe:
        return steps + [
            _Step("pre_mlp", block.unit_pre_mlp, (f"{i}.x", f"{i}.a"), (f"{i}.h", f"{i}.n2"),
                  (None, None)),
            _Step("mlp", lambda n: (block.feed_forward(n),), (f"{i}.n2",), (f"{i}.m",), (None,)),
        ]
    ff = block.feed_forward
    # expert parallelism's all-to-alls for this micro-batch (None: ep = 1, nothing moves)
    edges = ff.experts.unit_edges() if isinstance(ff.experts, ExpertParallelExperts) else None
    routing = {}

    def pre_mlp(x, a):
        h, n = block.unit_pre_mlp(x, a)
        return h, n, n      # n read by route and by dispatch (permutation, shared experts)

    def route(n):
        r = ff.route(n.reshape(-1, n.shape[-1]))
        routing["r"] = r
        counts = torch.tensor(r.counts, dtype=torch.int64, device=n.device)
        return r.weights, mod.aux_term(r.aux, tokens), counts

    def dispatch(n, received):
        r, flat = routing["r"], n.reshape(-1, n.shape[-1])
        if edges is not None:
            edges.settle(r.counts, received)
        rows, shared = ff.unit_dispatch(flat, r)
        return (rows,) + (() if shared is None else (shared,))

    def experts(rows):
        if edges is not None:
            return (edges.local_experts(rows),)
        return (ff.experts(rows, routing["r"].counts),)

    def combine(y, weights, *shared):
        r = dataclasses.replace(routing.pop("r"), weights=weights)
        return (ff.unit_combine(y, r, shared[0] if shared else None).view(shape),)

    count_edge, dispatch_edge, combine_edge = \
        (edges.counts, edges.dispatch, edges.combine) if edges else (None, None, None)
    shared = (f"{i}.shared",) if ff.shared is not None else ()
    return steps + [
        _Step("pre_mlp", pre_mlp, (f"{i}.x", f"{i}.a"), (f"{i}.h", f"{i}.n2", f"{i}.n2d"),
              (None, None, None)),
        _Step("route", route, (f"{i}.n2",), (f"{i}.w", f"{i}.aux", f"{i}.counts"),
              (None, None, count_edge)),
        _Step("dispatch", dispatch, (f"{i}.n2d", f"{i}.counts"), (f"{i}.rows", *shared),
              (dispatch_edge, *[None] * len(shared))),
        _Step("experts", experts, (f"{i}.rows",), (f"{i}.y",), (combine_edge,)),
        _Step("combine", combine, (f"{i}.y", f"{i}.w", *shared), (f"{i}.m",), (None,)),
    ]
