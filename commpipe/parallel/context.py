"""Context parallelism: each CP rank holds 1/cp of every sequence.

Load balance for causal attention (as in Megatron-LM's CP and Llama 3's): the sequence is cut
into 2*cp chunks and CP rank r takes chunks r and 2*cp-1-r, so every rank gets one early (cheap)
and one late (expensive) chunk. Attention all-gathers K and V across the CP group (their
gradients are reduce-scattered backward) and masks by absolute position; rotary positions are
the chunks' absolute positions.
"""

from __future__ import annotations

import torch
from torch import nn

from commpipe.models.llama import Transformer
from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import gather_seq


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Absolute positions held by `cp_rank`: chunks r and 2*cp-1-r of 2*cp equal chunks."""
    if cp_size == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    j = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(j * chunk, (j + 1) * chunk)])


def cp_split(x: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's slice of a [b, s, ...] tensor along the sequence."""
    if cp_size == 1:
        return x
    return x[:, cp_positions(x.shape[1], cp_size, cp_rank).to(x.device)]


class CPKVExchange(nn.Module):
    """All-gather K, V (and their positions) across the CP group; see Attention.kv_exchange."""

    def __init__(self, comm: Comm):
        super().__init__()
        self.comm = comm
        self._positions: dict[tuple, torch.Tensor] = {}

    def forward(self, k, v, positions):
        n = self.comm.size("cp")
        s_full = positions.numel() * n
        key = (s_full, positions.device)
        if key not in self._positions:  # every rank's positions, in gather order
            self._positions[key] = torch.cat(
                [cp_positions(s_full, n, r) for r in range(n)]).to(positions.device)
        return gather_seq(k, self.comm, "cp"), gather_seq(v, self.comm, "cp"), self._positions[key]


def apply_cp(model: Transformer, comm: Comm) -> Transformer:
    if comm.size("cp") == 1:
        return model
    exchange = CPKVExchange(comm)
    for block in model.layers.values():
        block.attention.kv_exchange = exchange
    return model
