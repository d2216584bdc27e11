"""Where a parameter lives across the ranks: one typed record, set where a parallel dimension
shards the parameter and read by everything that must know it.

    tp_dim      the dimension split across the TP group (column-parallel weights 0, row-parallel
                1, vocabulary-parallel embedding and head 0; stacked routed experts [E, ...]: 1
                for gate and up, 2 for down); None: whole on every TP rank
    sp_partial  a norm weight under sequence parallelism: each TP rank sees only its tokens, so
                its gradient is summed over TP before the DP reduction
    ep_sharded  routed experts: rows [ep_rank * E/ep, (ep_rank + 1) * E/ep) of the stacked expert
                weights; the gradient is summed over the ranks holding the same experts (edp).
                With tp > 1 an expert tensor is both: its rows over ep, its tp_dim over tp
                (commpipe.parallel.tensor_moe), as Megatron-Core's expert tensor parallelism

Set by commpipe.parallel.tensor, tensor_blip and expert (`place`); read by the DP reduction and
the gradient norm (commpipe.parallel.data), checkpoints (commpipe.train.checkpoint,
checkpoint_shards), the in-memory layout switch (commpipe.adapt.switch) and the equivalence
tests (`placement`). A parameter no dimension shards has `REPLICATED`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Placement:
    tp_dim: int | None = None
    sp_partial: bool = False
    ep_sharded: bool = False


REPLICATED = Placement()


def placement(p: torch.Tensor) -> Placement:
    """p's placement (`REPLICATED` unless a parallel dimension set one)."""
    return p.__dict__.get("_placement", REPLICATED)


def place(p: torch.Tensor, **fields) -> Placement:
    """Record on p that a parallel dimension shards it (fields of `Placement`); returns the
    placement now held."""
    new = replace(placement(p), **fields)
    if new.ep_sharded and new.tp_dim == 0:
        raise ValueError("dimension 0 of a stacked expert tensor is the experts, which ep "
                         "shards; tensor parallelism splits dimension 1 or 2")
    p._placement = new
    return new
