"""Expert parallelism (GShard, Lepikhin et al. 2020; as Megatron-Core and torchtitan lay it out):
the routed experts of every MoE layer are sharded over `ep` ranks carved from the data-parallel
(x context-parallel) ranks, attention and everything else stays replicated over them.

    dp_cp group   [r0 r1 r2 r3 r4 r5 r6 r7]     (dp=8, ep=4)
    ep groups     [r0 r1 r2 r3] [r4 r5 r6 r7]   consecutive: the all-to-all stays inside a node
    edp groups    [r0 r4] [r1 r5] [r2 r6] [r3 r7]   same experts: their gradients are summed

Each rank routes its own tokens (the router is replicated), then `ExpertParallelExperts`:
    exchange counts   all-to-all of rows per (rank, local expert)             [ep, E/ep]
    dispatch          all-to-all of the expert-grouped rows to their owners   variable splits
    local experts     rows regrouped source-major -> expert-major, one SwiGLU per local expert
    combine           the inverse regrouping and all-to-all back                variable splits
Routing is dropless, so the layer computes exactly what one device computes; only the order in
which an expert's rows are summed into its weight gradient changes. Every exchange goes through
Comm (dim "ep"), so the monitor sees it: dispatch and combine as op "all_to_all", the row counts
as COUNTS_OP, in records of their own, so EP bytes and time are the payload's. An expert's
gradient is summed over `edp` (the ranks holding the same experts), never over `ep`
(commpipe.parallel.data reads their placement, `ep_sharded`; ZeRO-1 shards its optimizer state over edp too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from commpipe.models.moe import GroupedExperts, MoELayer
from commpipe.parallel.comm import Comm
from commpipe.parallel.dims import ParallelDims
from commpipe.parallel.placement import place, placement

COUNTS_OP = "all_to_all_counts"     # the monitor's name of the row-count exchange


def check_ep(ep: int, dims: ParallelDims, experts: int) -> None:
    """Bad --ep fails before any process group starts, naming the values that work."""
    replicas = dims.dp * dims.cp
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"--ep {ep!r} must be a positive integer")
    if replicas % ep:
        ok = [e for e in range(1, replicas + 1) if replicas % e == 0 and experts % e == 0]
        raise ValueError(f"--ep {ep} does not divide dp*cp = {dims.dp}*{dims.cp} = {replicas} "
                         f"(expert-parallel groups are carved from the data-parallel ranks); use "
                         f"--ep in {ok} or raise --dp to a multiple of {ep}")
    if experts % ep:
        ok = [e for e in range(1, replicas + 1) if replicas % e == 0 and experts % e == 0]
        raise ValueError(f"--ep {ep} does not divide the model's {experts} experts; use --ep in "
                         f"{ok}")


def ep_groups(dims: ParallelDims, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups): each dp_cp group cut into blocks of `ep` consecutive ranks
    (one block holds every expert once), and the ranks at the same place of each block."""
    eps, edps = [], []
    for group in dims.groups("dp_cp"):
        eps += [group[i:i + ep] for i in range(0, len(group), ep)]
        edps += [group[j::ep] for j in range(ep)]
    return eps, edps


def build_ep_groups(comm: Comm, ep: int) -> None:
    """Give `comm` its ep and edp groups (every rank calls this, in the same order)."""
    if ep == 1:
        return
    eps, edps = ep_groups(comm.dims, ep)
    comm.add_groups("ep", eps)
    comm.add_groups("edp", edps)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of the ep group by `input_splits`; the backward sends the gradients
    back the way they came (splits swapped)."""

    @staticmethod
    def forward(ctx, x, comm: Comm, output_splits: list[int], input_splits: list[int]):
        ctx.comm, ctx.splits = comm, (output_splits, input_splits)
        return comm.all_to_all_single(x, output_splits, input_splits, "ep")

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return ctx.comm.all_to_all_single(grad, input_splits, output_splits, "ep"), None, None, None


class ExpertParallelExperts(GroupedExperts):
    """This rank's `experts / ep` experts (same parameter names as GroupedExperts, rows
    [ep_rank * E/ep, (ep_rank + 1) * E/ep) of the stacked weights), called like the whole set:
    rows grouped by global expert in, the experts' outputs in the same order out."""

    def __init__(self, full: GroupedExperts, comm: Comm):
        experts, ffn, hidden = full.w1.shape
        ep, ep_rank = comm.size("ep"), comm.local_rank("ep")
        local = experts // ep
        nn.Module.__init__(self)
        self.comm, self.local = comm, local
        mine = slice(ep_rank * local, (ep_rank + 1) * local)
        for name in ("w1", "w3", "w2"):
            whole = getattr(full, name)
            p = nn.Parameter(whole.detach()[mine].clone())
            # gradient summed over edp, norm over ep; a TP split (tensor_moe) is kept
            place(p, tp_dim=placement(whole).tp_dim, ep_sharded=True)
            setattr(self, name, p)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [sum(counts), h], counts [E] rows per global expert -> the experts' outputs."""
        ex = self.exchange(counts, x.device)
        rows = _AllToAll.apply(x, self.comm, ex.output_splits, ex.input_splits)   # source-major
        return _AllToAll.apply(self.local_experts(rows, ex), self.comm, ex.input_splits,
                               ex.output_splits)

    def exchange(self, counts: list[int], device) -> Exchange:
        """The row counts each rank sends each local expert, exchanged (one blocking
        all-to-all of [ep, E/ep] integers), and the splits and regrouping they give."""
        # on the rows' device: NCCL exchanges device tensors only
        send = torch.tensor(counts, dtype=torch.int64, device=device)
        return self.settle(counts, self.count_exchange(send).wait())

    def count_exchange(self, send: torch.Tensor):
        """The all-to-all of row counts per (rank, local expert), issued asynchronously."""
        ep, local = self.comm.size("ep"), self.local
        return self.comm.all_to_all_single(send, [local] * ep, [local] * ep, "ep", async_op=True,
                                           op=COUNTS_OP)

    def settle(self, counts: list[int], received: torch.Tensor) -> Exchange:
        """The exchange that the counts sent (`counts`, per global expert) and received
        ([ep * E/ep], per source rank and local expert) fix."""
        ep, local = self.comm.size("ep"), self.local
        recv = received.view(ep, local).cpu()                # [source, local expert]; one sync
        send = torch.tensor(counts, dtype=torch.int64).view(ep, local)   # [dest, local expert]
        return Exchange(send.sum(1).tolist(), recv.sum(1).tolist(),
                        _expert_major(recv).to(received.device), recv.sum(0).tolist())

    def local_experts(self, rows: torch.Tensor, ex: Exchange) -> torch.Tensor:
        """The received rows (source-major) through this rank's experts, regrouped
        expert-major for them and back to source-major for the combine."""
        out = super().forward(rows[ex.order], ex.counts)                  # expert-major
        return torch.empty_like(out).index_copy(0, ex.order, out)        # source-major again

    def unit_edges(self) -> ExchangeEdges:
        """The dispatch and combine of one micro-batch as unit edges (runtime/units_moe.py)."""
        return ExchangeEdges(self)


@dataclass
class Exchange:
    """One layer's token exchange for one micro-batch, as the row counts fixed it."""

    input_splits: list[int]        # rows this rank sends each ep rank (dispatch)
    output_splits: list[int]       # rows it receives from each
    order: torch.Tensor            # received rows, source-major -> expert-major
    counts: list[int]              # received rows per local expert


class ExchangeEdges:
    """A MoE layer's three all-to-alls for one micro-batch as edges of the unit-by-unit
    runtime (commpipe.runtime.units_moe), each `issue(t, backward)` starting its all-to-all
    asynchronously through Comm (dim "ep") and returning the handle: `counts` (the row counts,
    integers, no adjoint), then `dispatch` and `combine` with the splits that `settle` fixed
    once the counts arrived; the backward issues the same exchange reversed (the adjoint of an
    all-to-all). The counts travel on their own edge so that no step blocks on an exchange
    queued behind another pass's all-to-all on the same link (gloo's one connection per rank
    pair, NCCL's one stream per group)."""

    def __init__(self, experts: ExpertParallelExperts):
        self.experts, self.ex = experts, None
        self.counts = _CountEdge(experts)
        self.dispatch, self.combine = _Edge(self, False), _Edge(self, True)

    def settle(self, counts: list[int], received: torch.Tensor) -> None:
        self.ex = self.experts.settle(counts, received)

    def local_experts(self, rows: torch.Tensor) -> torch.Tensor:
        return self.experts.local_experts(rows, self.ex)


class _CountEdge:
    def __init__(self, experts: ExpertParallelExperts):
        self.experts = experts

    def issue(self, t: torch.Tensor, backward: bool):
        return self.experts.count_exchange(t)


class _Edge:
    def __init__(self, edges: ExchangeEdges, back: bool):
        self.edges, self.back = edges, back      # back: the combine (splits swapped)

    def issue(self, t: torch.Tensor, backward: bool):
        ex = self.edges.ex
        splits = (ex.output_splits, ex.input_splits)
        out_splits, in_splits = splits[::-1] if self.back != backward else splits
        return self.edges.experts.comm.all_to_all_single(t, out_splits, in_splits, "ep",
                                                         async_op=True)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows laid out by (source, local expert) into (local expert, source),
    each block keeping its order: every expert then sees its rows from rank 0, 1, ... in turn."""
    starts = torch.cumsum(recv.flatten(), 0) - recv.flatten()
    starts = starts.view_as(recv)
    blocks = [torch.arange(int(starts[s, e]), int(starts[s, e] + recv[s, e]))
              for e in range(recv.shape[1]) for s in range(recv.shape[0])]
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)


def apply_ep(model: nn.Module, comm: Comm) -> nn.Module:
    """Shard the routed experts of every MoE layer of `model` over comm's ep group, in place;
    a no-op when ep = 1."""
    if comm.size("ep") == 1:
        return model
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.experts = ExpertParallelExperts(layer.experts, comm)
    return model
