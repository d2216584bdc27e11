"""Context parallelism: each CP rank holds 1/cp of every sequence.

Load balance for causal attention (as in Megatron-LM's CP and Llama 3's): the sequence is cut
into 2*cp chunks and CP rank r takes chunks r and 2*cp-1-r, so every rank gets one early (cheap)
and one late (expensive) chunk. Attention all-gathers K and V across the CP group (their
gradients are reduce-scattered backward) and masks by absolute position; rotary positions are
the chunks' absolute positions.

Overlapped (the default; `--no-overlap` keeps the exposed gather): the all-gathers of K and V
are issued as handles, attention over this rank's own chunk runs while they travel, then the
other ranks' chunks are attended to and the two partial results merged by their log-sum-exp
(the online-softmax merge of ring attention). The backward recomputes the attention over the
gathered K/V and reduce-scatters their gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from commpipe.models.llama import Transformer
from commpipe.parallel.comm import Comm
from commpipe.parallel.functional import all_gather_seq, gather_seq, reduce_scatter_seq


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


def _attend(q, k, v, q_pos, k_pos):
    """Causal attention by absolute position, with its log-sum-exp: q [b, s, nh, d], k and v
    [b, sk, nkv, d] -> (out [b, nh, s, d], lse [b, nh, s, 1]); rows with no visible key give
    out 0 and lse -inf, so they drop out of a merge."""
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(groups, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0))
    return p @ vh, lse


class _OverlappedCPAttention(torch.autograd.Function):
    """softmax(q K^T) V over every CP rank's K/V, the gather hidden behind the local chunk."""

    @staticmethod
    def forward(ctx, q, k, v, positions, all_positions, comm: Comm):
        n, me, s = comm.size("cp"), comm.local_rank("cp"), k.shape[1]
        handles = [all_gather_seq(t, comm, "cp", async_op=True) for t in (k, v)]
        out_l, lse_l = _attend(q, k, v, positions, positions)        # own chunk meanwhile
        kg, vg = (h.wait() for h in handles)                         # [b, n * s, nkv, d]
        others = torch.cat([torch.arange(r * s, (r + 1) * s) for r in range(n) if r != me])
        others = others.to(q.device)
        out_r, lse_r = _attend(q, kg[:, others], vg[:, others], positions, all_positions[others])
        lse = torch.logaddexp(lse_l, lse_r)
        out = out_l * torch.exp(lse_l - lse) + out_r * torch.exp(lse_r - lse)
        ctx.save_for_backward(q, kg, vg, positions, all_positions)
        ctx.comm = comm
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)   # [b, s, nh * d]

    @staticmethod
    def backward(ctx, grad):
        q, kg, vg, positions, all_positions = ctx.saved_tensors
        with torch.enable_grad():   # the same attention the exposed path differentiates
            q_, kg_, vg_ = (t.detach().requires_grad_(True) for t in (q, kg, vg))
            groups = q.shape[2] // kg.shape[2]
            qh, kh, vh = (t.transpose(1, 2) for t in (q_, kg_.repeat_interleave(groups, dim=2),
                                                      vg_.repeat_interleave(groups, dim=2)))
            mask = all_positions[None, :] <= positions[:, None]
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
            out = out.transpose(1, 2).reshape(grad.shape)
            gq, gk, gv = torch.autograd.grad(out, (q_, kg_, vg_), grad)
        comm = ctx.comm
        handles = [reduce_scatter_seq(g, comm, "cp", async_op=True) for g in (gk, gv)]
        gk, gv = (h.wait() for h in handles)
        return gq, gk, gv, None, None, None


class CPOverlappedCore:
    """Attention.core for context parallelism with the K/V gather overlapped (a plain callable:
    installed in the instance, it takes the place of the method)."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self._positions: dict[tuple, torch.Tensor] = {}

    def __call__(self, q, k, v, positions, k_positions):
        n = self.comm.size("cp")
        key = (positions.numel() * n, positions.device)
        if key not in self._positions:  # every rank's positions, in gather order
            self._positions[key] = torch.cat(
                [cp_positions(key[0], n, r) for r in range(n)]).to(positions.device)
        return _OverlappedCPAttention.apply(q, k, v, positions, self._positions[key], self.comm)


def apply_cp(model: Transformer, comm: Comm, overlap: bool = False) -> Transformer:
    if comm.size("cp") == 1:
        return model
    if overlap:
        core = CPOverlappedCore(comm)
        for block in model.layers.values():
            block.attention.core = core
        return model
    exchange = CPKVExchange(comm)
    for block in model.layers.values():
        block.attention.kv_exchange = exchange
    return model
