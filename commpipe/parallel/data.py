"""Data parallelism: bucketed gradient reduction overlapped with the backward, global-norm
clipping, optional ZeRO-1 (a distributed optimizer: gradients reduce-scattered, parameters
all-gathered).

ZeRO-1 shards each parameter's optimizer state over the ranks that replicate the parameter:
attention and the other dense parameters over dp (their CP replicas hold the same shards),
routed experts sharded by expert parallelism over edp, the dp*cp/ep ranks holding the same
experts (commpipe.parallel.expert). Sharding an expert over the whole DP group would sum
different experts' gradients in one reduce-scatter.

The loss of every micro-batch is already divided by the number of tokens in the *global*
batch, so gradients are summed (not averaged) across data-parallel and context-parallel ranks:
the sum over DP ranks, CP chunks and micro-batches is then exactly the gradient of the global
mean loss that one device computes.

Overlap: every parameter counts its gradient accumulations (`watch_grad` of
commpipe.parallel.weight_grad: autograd's, and the deferred weight-gradient GEMMs'). Each micro-batch
adds exactly one, so a parameter is final after `microbatches` of them: on a pipeline stage that
is its last micro-batch's backward (or W). A bucket is issued as a handle once all its
parameters are final, while the rest of the backward runs; buckets go out in index order (the
same on every rank of the group, as NCCL needs) and, after the first step, are rebuilt in the
order their gradients became final (ready-order buckets, as torch DDP does).
"""

from __future__ import annotations

import math
import weakref
from functools import partial

import torch
from torch import nn

from commpipe.parallel.comm import Comm
from commpipe.parallel.placement import placement
from commpipe.parallel.weight_grad import watch_grad


class Bucket:
    """Parameters reduced together over one group (`dim`: dp_cp, or edp for experts sharded by
    expert parallelism, commpipe.parallel.expert). For ZeRO-1 each parameter has an owner among
    the `n` ranks of `shard_dim` (dp, or edp for experts; a greedy size balance, identical on
    every rank) and the flat buffer is laid out owner by owner, each segment padded to the
    longest, so one reduce-scatter leaves every rank the summed gradients of exactly the
    parameters it updates, and one all-gather returns them."""

    def __init__(self, params: list[nn.Parameter], n: int, dim: str = "dp_cp",
                 shard_dim: str = "dp"):
        self.params, self.dim, self.shard_dim, self.n = params, dim, shard_dim, n
        loads = [0] * n
        self.owner = []
        for p in params:
            r = loads.index(min(loads))
            self.owner.append(r)
            loads[r] += p.numel()
        self.segment = max(loads)
        self.by_owner = [[p for p, o in zip(params, self.owner) if o == r] for r in range(n)]

    def pack(self, tensors_of, zero: bool) -> torch.Tensor:
        if not zero:
            return torch.cat([tensors_of(p).reshape(-1) for p in self.params])
        return torch.cat([self.pack_segment(r, tensors_of) for r in range(self.n)])

    def pack_segment(self, r: int, tensors_of) -> torch.Tensor:
        ps = self.by_owner[r]
        ref = self.params[0]
        flat = torch.zeros(self.segment, dtype=ref.dtype, device=ref.device)
        if ps:
            torch.cat([tensors_of(p).reshape(-1) for p in ps], out=flat[:sum(p.numel() for p in ps)])
        return flat

    @staticmethod
    def unpack(flat: torch.Tensor, params: list[nn.Parameter]):
        offset = 0
        for p in params:
            n = p.numel()
            yield p, flat[offset:offset + n].view_as(p)
            offset += n


def _call(ref: weakref.ref, method: str, p: nn.Parameter) -> None:
    """A parameter hook calling `method` of the reducer `ref` points to, while it lives."""
    reducer = ref()
    if reducer is not None:
        getattr(reducer, method)(p)


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


class GradReducer:
    """Sum gradients over the dp_cp group in flat buckets of about `bucket_mb` MB, each issued
    as soon as its gradients are final (overlap) or all after the backward (no overlap); with
    sequence parallelism, norm-weight gradients (partial per TP rank) are first summed over TP."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, bucket_mb: float = 25.0,
                 microbatches: int = 1, overlap: bool = True, zero: bool = False):
        self.comm, self.params, self.overlap = comm, params, overlap
        self.n = comm.size("dp_cp")
        self.zero = zero and comm.size("dp") > 1
        self.bucket_bytes = bucket_mb * 1e6
        self.expected = microbatches
        self.sp_partial = {id(p) for p in params if placement(p).sp_partial} \
            if comm.size("tp") > 1 else set()
        self.buckets = self._make_buckets(list(reversed(params)))  # last layers are final first
        # ready-order buckets: the first step records the order gradients became final
        # (ZeRO-1 keeps its layout: it decides which rank owns which parameter)
        self._ready_order: list[nn.Parameter] | None = [] if overlap and not self.zero else None
        self._begin_step()
        # the parameters reach the reducer only weakly: a strong reference from their hooks
        # would make a cycle through autograd that Python's collector does not free, and a
        # discarded Trainer (a layout switch, a restart in the same process) would keep all its
        # parameters and gradients alive (on a GPU, gigabytes per discarded layout)
        me = weakref.ref(self)
        handles = [watch_grad(p, partial(_call, me, "_accumulated")) for p in params]
        weakref.finalize(self, _remove_hooks, handles)

    def _bucket(self, params: list[nn.Parameter], dim: str) -> Bucket:
        # ZeRO-1 shards a bucket over the ranks replicating it: dp (the CP replicas hold the
        # same shards), or edp for experts, whose other EP ranks hold other experts
        shard_dim = "edp" if dim == "edp" else "dp"
        return Bucket(params, self.comm.size(shard_dim) if self.zero else 1, dim, shard_dim)

    def _make_buckets(self, order: list[nn.Parameter]) -> list[Bucket]:
        # experts sharded over ep are summed over the ranks holding the same experts (edp)
        buckets, cur, size = [], [], 0
        dim = "dp_cp"
        for p in order:
            p_dim = "edp" if placement(p).ep_sharded else "dp_cp"
            if cur and p_dim != dim:
                buckets.append(self._bucket(cur, dim))
                cur, size = [], 0
            dim = p_dim
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                buckets.append(self._bucket(cur, dim))
                cur, size = [], 0
        if cur:
            buckets.append(self._bucket(cur, dim))
        self.bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b.params}
        self.owner_of = {id(p): (o, b.shard_dim) for b in buckets for p, o in zip(b.params, b.owner)}
        return buckets

    def _begin_step(self) -> None:
        self._count = dict.fromkeys(map(id, self.params), 0)
        self._waiting = [len(b.params) for b in self.buckets]   # params not yet final
        self._next = 0                                          # next bucket to issue
        self._inflight: list = []                               # (bucket, flat, handle)

    # -- readiness --------------------------------------------------------------------------------
    def _accumulated(self, p: nn.Parameter) -> None:
        c = self._count[id(p)] = self._count[id(p)] + 1
        if c != self.expected or not self.overlap:
            return
        self._final(p)
        self._issue_ready()

    @torch.no_grad()
    def _final(self, p: nn.Parameter) -> None:
        if id(p) in self.sp_partial:      # sequence shards: each TP rank saw its own tokens
            self.comm.all_reduce(p.grad, "tp")
        if self._ready_order is not None:
            self._ready_order.append(p)
        self._waiting[self.bucket_of[id(p)]] -= 1

    def _issue_ready(self) -> None:
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            self._issue(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _issue(self, bucket: Bucket) -> None:
        if self.comm.size(bucket.dim) == 1:
            return
        grads = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)  # noqa: E731
        flat = bucket.pack(grads, self.zero)
        if self.zero and bucket.shard_dim == "edp":    # experts: edp spans the CP replicas too
            handle = self.comm.reduce_scatter(flat, "edp", async_op=True)
        elif self.zero:
            # CP replicas hold the same shards: sum over CP, then reduce-scatter over DP
            self.comm.all_reduce(flat, "cp")
            handle = self.comm.reduce_scatter(flat, "dp", async_op=True)
        else:
            handle = self.comm.all_reduce(flat, bucket.dim, async_op=True)
        self._inflight.append((bucket, handle))

    @torch.no_grad()
    def reduce(self) -> None:
        """Issue what the backward has not, wait for every bucket, unpack (ZeRO-1: this rank's
        owned gradients only; the others become None)."""
        if not self.overlap:
            for p in self.params:
                self._final(p)
        self._issue_ready()
        if self._next != len(self.buckets):
            missing = [p for p in self.params if self._count[id(p)] != self.expected][:3]
            raise RuntimeError(f"gradients not final after the step: {len(missing)} parameter(s) "
                               f"saw accumulations {[self._count[id(p)] for p in missing]}, "
                               f"expected {self.expected} (one per micro-batch)")
        for bucket, handle in self._inflight:
            flat = handle.wait()
            if self.zero:
                for p in bucket.params:
                    p.grad = None
                me = self.comm.local_rank(bucket.shard_dim)
                for p, g in Bucket.unpack(flat, bucket.by_owner[me]):
                    p.grad = g.clone()
            else:
                for p, g in Bucket.unpack(flat, bucket.params):
                    p.grad = g.clone()
        if self._ready_order is not None:   # first step done: buckets in ready order
            order, self._ready_order = self._ready_order, None
            if [id(p) for p in order] != [id(p) for b in self.buckets for p in b.params]:
                self.buckets = self._make_buckets(order)
        self._begin_step()

    # -- ZeRO-1 ----------------------------------------------------------------------------------
    def owns(self, p: nn.Parameter) -> bool:
        if not self.zero:
            return True
        owner, shard_dim = self.owner_of[id(p)]
        return owner == self.comm.local_rank(shard_dim)

    @torch.no_grad()
    def all_gather(self, tensors_of, write) -> None:
        """Every bucket's owned segments all-gathered over its shard group (issued together,
        then unpacked): `write(p, full_value)` for every parameter."""
        pending = [(b, self.comm.all_gather(
            b.pack_segment(self.comm.local_rank(b.shard_dim), tensors_of), b.shard_dim,
            async_op=True)) for b in self.buckets]
        for b, handle in pending:
            flat = handle.wait()
            for r in range(b.n):
                seg = flat[r * b.segment:(r + 1) * b.segment]
                for p, value in Bucket.unpack(seg, b.by_owner[r]):
                    write(p, value)


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, comm: Comm,
                    sharded: bool = False) -> float:
    """Clip by the norm of the *whole model's* gradient: squares summed over this rank's
    parameters (TP-replicated ones counted on tp rank 0 only), then over the TP and PP groups
    (and DP when ZeRO-1 left each rank only the gradients it owns: `sharded`); experts sharded
    over ep are summed over ep first (every other parameter is the same on each ep rank), or,
    sharded, over dp_cp (each expert row is owned by one rank of its edp group, and the ep
    groups' shards together are every expert once)."""
    # on the parameters' device: NCCL reduces only device tensors, and one sync per step
    device = next((p.grad.device for p in params if p.grad is not None), comm.device)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    sq_ep = torch.zeros((), dtype=torch.float64, device=device)
    tp_rank = comm.local_rank("tp")
    for p in params:
        where = placement(p)
        if p.grad is None or (where.tp_dim is None and tp_rank != 0):
            continue
        (sq_ep if where.ep_sharded else sq).add_(p.grad.detach().double().pow(2).sum())
    if sharded:
        if comm.size("ep") > 1:
            comm.all_reduce(sq_ep, "dp_cp")
        comm.all_reduce(sq, "dp")
    else:
        comm.all_reduce(sq_ep, "ep")
    sq += sq_ep
    for dim in ("tp", "pp"):
        comm.all_reduce(sq, dim)
    norm = math.sqrt(sq.item())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


class Zero1:
    """ZeRO stage 1 (Rajbhandari et al., 2020) as Megatron's distributed optimizer: each DP rank
    keeps optimizer state for, and updates, only the parameters it owns (the
    reducer's bucket layout; an expert's owner is one of the edp ranks replicating it, as
    Megatron-Core shards expert states over its expert-data-parallel group); gradients arrive
    reduce-scattered and the updated parameters are all-gathered, bucket by bucket."""

    def __init__(self, params: list[nn.Parameter], reducer: GradReducer, make_optimizer):
        self.comm, self.reducer, self.params = reducer.comm, reducer, params
        mine = [p for p in params if reducer.owns(p)]
        self.optimizer = make_optimizer(mine or [nn.Parameter(torch.zeros(1))])

    def owns(self, p: nn.Parameter) -> bool:
        return self.reducer.owns(p)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            self.reducer.all_gather(lambda p: p.data, lambda p, v: p.data.copy_(v))

    def full_grads(self) -> dict[int, torch.Tensor]:
        """Every parameter's reduced gradient (tests compare them with one device)."""
        out = {}
        zeros = lambda p: p.grad if p.grad is not None else torch.zeros_like(p)  # noqa: E731
        self.reducer.all_gather(zeros, lambda p, v: out.__setitem__(id(p), v.clone()))
        return out

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd)
