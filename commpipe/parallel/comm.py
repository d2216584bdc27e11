"""The one communication chokepoint.

Every collective and point-to-point transfer of every dimension goes through a `Comm`: each
call is tagged with its dimension (tp, cp, pp, dp, dp_cp, world), op, peer or group, and bytes,
and is shown to the registered observers (the monitor) before it starts and once it completes.
Nothing else in commpipe calls torch.distributed communication directly (a test greps for it).

Groups of size 1 do nothing, so the single-process path is the reference path.
Expert parallelism adds two groups carved from dp_cp (commpipe.parallel.expert, `add_groups`):
`ep` (ranks holding different experts, which exchange tokens by all-to-all) and `edp` (ranks
holding the same experts, which sum their gradients); without it `ep` is this rank alone and
`edp` is dp_cp.

Observer protocol (see commpipe.monitor):
    ctx = observer.begin(call)          # before the op is issued; may return None (not sampled)
    observer.end(ctx, call)             # once the consumer's wait() returned
An observer that sets `call.watch = True` in begin() gets `call.t_done` stamped when the data
has arrived (or, on CUDA, its `call.ev_done` event recorded after the op on a side stream),
however late the consumer waits (commpipe.parallel.completion); otherwise t_done is when
wait() returned.

Last call: each `Comm` keeps a reference to the call it issued last (`last_call`) and to the one
its caller is blocked on (`waiting`); two attribute stores per call, no lock, no device sync.
The hang watchdog (commpipe.elastic.watchdog) reads them from its own thread.
"""

from __future__ import annotations

import datetime
import pickle
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commpipe.parallel import object_rows
from commpipe.parallel.completion import watch
from commpipe.parallel.dims import ParallelDims

GROUP_DIMS = ("tp", "cp", "dp", "pp", "dp_cp")
# torch 2.13 renamed all_gather_into_tensor, which became an alias warning once in every process
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommCall:
    """One communication call as observers see it."""

    dim: str                      # tp | cp | dp | pp | dp_cp | ep | edp | world
    op: str                       # all_reduce | all_gather | reduce_scatter | send | recv | ...
    nbytes: int                   # payload bytes this rank sends (send) or receives (recv);
                                  # for collectives the size of this rank's input tensor
    group: tuple[int, ...] = ()   # global ranks of the group (collectives)
    peer: int | None = None       # global rank of the peer (point-to-point)
    seq: int = 0                  # per (dim, op, peer/group) sequence number on this rank
    size_class: int = 0           # nbytes.bit_length(): calls of [2^(c-1), 2^c) bytes share one
    size_seq: int = 0             # sequence number among this stream's calls of size_class
                                  # (the monitor samples each size class on its own)
    t_post: float = 0.0           # time.perf_counter() when issued
    t_done: float = 0.0           # when observed complete (the data has arrived, if watched)
    dtype: str = ""
    tag: int = 0                  # point-to-point tag (messages pair by (peer, tag) on gloo)
    extra: dict = field(default_factory=dict)
    watch: bool = False           # set by an observer's begin(): observe completion on arrival
    ev_done: object = None        # CUDA: the observer's event, recorded when the op completes
    prev: CommCall | None = None  # watched p2p: this rank's earlier message on the same link,
                                  # still in flight when this one was posted
    blocked_s: float = 0.0        # host seconds the caller spent in wait() (CPU: the exposed
                                  # part; a blocking op waits at once, so all of it)


class Handle:
    """An in-flight async op; `wait()` completes it and notifies observers exactly once."""

    def __init__(self, comm: Comm, work, call: CommCall, ctxs: list, on_done=None):
        self._comm, self._work, self.call, self._ctxs = comm, work, call, ctxs  # (observer, ctx)
        self._on_done = on_done
        self.done = False
        # a watched call: its completion is observed independently of this handle's wait()
        self._watch = (watch(work, call, comm.device, comm.backend) if call.watch and work is not None
                       else None)
        if ctxs and call.peer is not None:
            self._link_predecessor(comm)

    def _link_predecessor(self, comm: Comm) -> None:
        """Messages between a rank pair share one connection: a watched message posted while
        this rank's previous message on the same (dim, op, peer) is still in flight moves only
        after it. That predecessor is watched from now on and named in `call.prev`, so the
        observer can start the transfer once the link was free (CPU; on CUDA the side-stream
        event already follows the communication stream's order)."""
        chan = (self.call.dim, self.call.op, self.call.peer)
        prev = comm._last_p2p.get(chan)
        prev = prev() if prev is not None else None
        comm._last_p2p[chan] = weakref.ref(self)    # not keeping its buffer alive
        if (not self.call.watch or prev is None or prev.done or comm.device.type == "cuda"
                or comm.backend == "nccl"):
            return
        if prev._watch is None and prev._work is not None:
            prev._watch = watch(prev._work, prev.call, comm.device, comm.backend)
        self.call.prev = prev.call

    def wait(self):
        if self.done:
            return self.result
        t0 = time.perf_counter()
        self._comm.waiting = self.call
        if self._watch is not None:
            self._watch.wait()        # the watcher waited on the work (gloo allows one wait)
        elif self._work is not None:
            self._work.wait()
        self.result = self._on_done() if self._on_done else None
        self.call.blocked_s = time.perf_counter() - t0
        self._comm.waiting = None
        self._comm._finish(self.call, self._ctxs)
        self.done = True
        return self.result


class Comm:
    """Process groups of one layout on this rank, and every communication op."""

    def __init__(self, dims: ParallelDims, rank: int = 0, backend: str | None = None,
                 device: torch.device | None = None, timeout_s: float = 300.0,
                 strict_order: bool = False):
        self.dims = dims
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.observers: list = []
        self._seq: dict[tuple, int] = {}
        self._size_seq: dict[tuple, int] = {}     # ((dim, op, peer/group, tag), size class) -> n
        self._last_p2p: dict[tuple, weakref.ref] = {}   # (dim, op, peer) -> latest p2p Handle
        self.last_call: CommCall | None = None     # the latest call issued (hang watchdog)
        self.waiting: CommCall | None = None       # the call the caller is blocked on, if any
        self.coords = dims.coords(rank)
        self.groups: dict[str, tuple[int, ...]] = {}
        self._pg: dict[str, object] = {}
        self._object_capacity: dict[tuple, int] = {}   # group's ranks -> gather_objects row width
        self._control_pg = None                        # start_gather_objects' group, once used
        self.initialized = dist.is_available() and dist.is_initialized()
        self.backend = dist.get_backend() if self.initialized else "none"
        # strict order: point-to-point messages of a rank pair pair up in issue order, as on
        # NCCL; on gloo every message then travels with one tag, so gloo matches it the same way
        self.strict_order = strict_order or self.backend == "nccl"
        self.timeout_s = timeout_s
        t0 = time.perf_counter()
        for name in GROUP_DIMS:
            ranks_here = None
            for ranks in dims.groups(name):
                # every rank must create every group, in the same order
                pg = (dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
                      if self.initialized and len(ranks) > 1 and dims.world_size > 1 else None)
                if rank in ranks:
                    ranks_here = tuple(ranks)
                    self._pg[name] = pg
            self.groups[name] = ranks_here
        self.groups_s = time.perf_counter() - t0   # creating the process groups (a new layout's)
        # no expert parallelism until add_groups: every rank holds every expert
        self.groups["ep"], self._pg["ep"] = (rank,), None
        self.groups["edp"], self._pg["edp"] = self.groups["dp_cp"], self._pg["dp_cp"]

    def add_groups(self, dim: str, groups: list[list[int]]) -> None:
        """Make `dim` the group of `groups` that holds this rank (a partition of the world, the
        same list on every rank, which must all call this in the same order)."""
        here = None
        for ranks in groups:
            pg = (dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
                  if self.initialized and len(ranks) > 1 and self.dims.world_size > 1 else None)
            if self.rank in ranks:
                here, self._pg[dim] = tuple(ranks), pg
        if here is None:
            raise ValueError(f"rank {self.rank} is in none of the {dim} groups {groups}")
        self.groups[dim] = here

    # -- sizes and ranks ------------------------------------------------------------------------
    def size(self, dim: str) -> int:
        return self.dims.world_size if dim == "world" else len(self.groups[dim])

    def local_rank(self, dim: str) -> int:
        return self.rank if dim == "world" else self.groups[dim].index(self.rank)

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the same (dp, cp, tp) position on another pipeline stage."""
        c = self.coords
        return self.dims.rank_of(pp=pp_rank, dp=c["dp"], cp=c["cp"], tp=c["tp"])

    # -- observer plumbing ----------------------------------------------------------------------
    def _start(self, dim, op, tensor, group=(), peer=None, tag: int = 0) -> tuple[CommCall, list]:
        key = (dim, op, peer if peer is not None else group, tag)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        nbytes = tensor.numel() * tensor.element_size()
        size_key = (key, nbytes.bit_length())
        size_seq = self._size_seq.get(size_key, 0)
        self._size_seq[size_key] = size_seq + 1
        call = CommCall(dim=dim, op=op, nbytes=nbytes, group=tuple(group), peer=peer, seq=seq,
                        size_class=size_key[1], size_seq=size_seq, dtype=str(tensor.dtype), tag=tag)
        # the observers present now are the ones told of the end, even if the list changes
        pairs = [(o, o.begin(call)) for o in self.observers] if self.observers else []
        call.t_post = time.perf_counter()
        self.last_call = call
        return call, pairs

    def _finish(self, call: CommCall, pairs: list) -> None:
        if not call.t_done:           # a watcher stamps arrival; else completion is now
            call.t_done = time.perf_counter()
        for o, ctx in pairs:
            o.end(ctx, call)

    def _pg_of(self, dim: str):
        return None if dim == "world" else self._pg[dim]

    def process_group(self, dim: str):
        """The torch process group of `dim` (None for the default group, or a size-1 group)
        for torch code that takes one, such as a DeviceMesh (commpipe.train.checkpoint_shards)."""
        return self._pg_of(dim)

    def _group_ranks(self, dim: str) -> tuple[int, ...]:
        return tuple(range(self.dims.world_size)) if dim == "world" else self.groups[dim]

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, dim: str, op: str = "sum",
                   async_op: bool = False) -> Handle | None:
        """In-place all-reduce over `dim`'s group (op: sum | max | min | avg)."""
        if self.size(dim) == 1:
            return _done_handle(self, tensor) if async_op else None
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.SUM}[op]
        call, ctxs = self._start(dim, "all_reduce", tensor, group=self._group_ranks(dim))
        work = dist.all_reduce(tensor, op=red, group=self._pg_of(dim), async_op=True)

        def done():
            if op == "avg":
                tensor.div_(self.size(dim))
            return tensor

        handle = Handle(self, work, call, ctxs, done)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_gather(self, tensor: torch.Tensor, dim: str, async_op: bool = False):
        """Concatenate every rank's `tensor` along dim 0 (returns a new tensor, or a Handle)."""
        n = self.size(dim)
        if n == 1:
            return _done_handle(self, tensor) if async_op else tensor
        tensor = tensor.contiguous()
        out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        call, ctxs = self._start(dim, "all_gather", tensor, group=self._group_ranks(dim))
        work = _all_gather_single(out, tensor, group=self._pg_of(dim), async_op=True)
        handle = Handle(self, work, call, ctxs, lambda: out)
        return handle if async_op else handle.wait()

    def reduce_scatter(self, tensor: torch.Tensor, dim: str, async_op: bool = False):
        """Sum over the group, then keep this rank's 1/n slice along dim 0."""
        n = self.size(dim)
        if n == 1:
            return _done_handle(self, tensor) if async_op else tensor
        tensor = tensor.contiguous()
        out = torch.empty((tensor.shape[0] // n, *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        call, ctxs = self._start(dim, "reduce_scatter", tensor, group=self._group_ranks(dim))
        if self.backend == "gloo":
            # gloo's reduce-scatter costs as much as an all-reduce of the whole tensor (see
            # benchmarks/gloo_reduce_scatter.py); an all-to-all sends each rank the slices it
            # keeps ((n-1)/n of the tensor, as a ring would) and the sum is taken here, in rank
            # order
            slices = torch.empty_like(tensor)
            work = dist.all_to_all_single(slices, tensor, group=self._pg_of(dim), async_op=True)
            handle = Handle(self, work, call, ctxs,
                            lambda: torch.sum(slices.view(n, *out.shape), dim=0, out=out))
        else:
            work = dist.reduce_scatter_tensor(out, tensor, group=self._pg_of(dim), async_op=True)
            handle = Handle(self, work, call, ctxs, lambda: out)
        return handle if async_op else handle.wait()

    def all_to_all_single(self, tensor: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], dim: str, async_op: bool = False,
                          op: str = "all_to_all"):
        """Rows input_splits[i] of `tensor` (dim 0, in group order) go to the group's rank i;
        the result holds output_splits[j] rows from rank j, in group order (a new tensor, or a
        Handle). Splits may differ per rank pair: expert parallelism's token dispatch. `op`
        names the call for observers (the MoE row counts: commpipe.parallel.expert.COUNTS_OP)."""
        if self.size(dim) == 1:
            return _done_handle(self, tensor) if async_op else tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        call, ctxs = self._start(dim, op, tensor, group=self._group_ranks(dim))
        call.extra["output_splits"], call.extra["input_splits"] = output_splits, input_splits
        work = dist.all_to_all_single(out, tensor, output_splits, input_splits,
                                      group=self._pg_of(dim), async_op=True)
        handle = Handle(self, work, call, ctxs, lambda: out)
        return handle if async_op else handle.wait()

    def broadcast(self, tensor: torch.Tensor, dim: str, src_local: int = 0) -> None:
        if self.size(dim) == 1:
            return
        group = self._group_ranks(dim)
        call, ctxs = self._start(dim, "broadcast", tensor, group=group)
        self.waiting = call
        dist.broadcast(tensor, src=group[src_local], group=self._pg_of(dim))
        self.waiting = None
        self._finish(call, ctxs)

    def _blocking(self, dim: str, op: str) -> CommCall:
        """A control call the observers do not see (barrier, object exchange), recorded for the
        hang watchdog as the call this rank is blocked on."""
        key = (dim, op, self._group_ranks(dim), 0)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        call = CommCall(dim=dim, op=op, nbytes=0, group=self._group_ranks(dim), seq=seq,
                        t_post=time.perf_counter())
        self.last_call = self.waiting = call
        return call

    def _unblocked(self, call: CommCall) -> None:
        call.t_done = time.perf_counter()
        self.waiting = None

    def barrier(self, dim: str = "world") -> None:
        if self.size(dim) > 1:
            call = self._blocking(dim, "barrier")
            dist.barrier(group=self._pg_of(dim))
            self._unblocked(call)

    # -- point to point -------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int, dim: str = "pp", tag: int = 0) -> Handle:
        """Asynchronous send. `tag` tells apart messages that travel the same direction
        between the same pair (activations and gradients of a V schedule): gloo matches by
        tag; NCCL ignores tags and matches in issue order, and so does gloo in strict-order
        mode (the wire tag is 0; observers still see `tag`)."""
        tensor = tensor.contiguous()
        call, ctxs = self._start(dim, "send", tensor, peer=peer, tag=tag)
        work = dist.isend(tensor, dst=peer, tag=self._wire_tag(tag))
        return Handle(self, work, call, ctxs, lambda: tensor)

    def irecv(self, tensor: torch.Tensor, peer: int, dim: str = "pp", tag: int = 0) -> Handle:
        call, ctxs = self._start(dim, "recv", tensor, peer=peer, tag=tag)
        work = dist.irecv(tensor, src=peer, tag=self._wire_tag(tag))
        return Handle(self, work, call, ctxs, lambda: tensor)

    def _wire_tag(self, tag: int) -> int:
        return 0 if self.strict_order else tag

    def send(self, tensor: torch.Tensor, peer: int, dim: str = "pp") -> None:
        self.isend(tensor, peer, dim).wait()

    def recv(self, tensor: torch.Tensor, peer: int, dim: str = "pp") -> torch.Tensor:
        return self.irecv(tensor, peer, dim).wait()

    # -- small helpers for metrics and control (tagged dim="world") -----------------------------
    def all_reduce_scalars(self, values: list[float], dim: str = "world", op: str = "sum"):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.all_reduce(t, dim, op)
        return t.tolist()

    def gather_objects(self, obj, dim: str = "world") -> list:
        """Every rank's picklable `obj` on every rank of the group (control data, not tensors)."""
        if self.size(dim) == 1:
            return [obj]
        # one all_gather of fixed-width rows (commpipe.parallel.object_rows), a second, wider
        # one only when some rank's object outgrew the row; the width is kept per group of
        # ranks, so one group under two names (edp is dp_cp without experts) agrees on it
        key = ("world",) if dim == "world" else self.groups[dim]
        return self._gathering(obj, dim, self._pg_of(dim), key, "all_gather_object").result()

    def start_gather_objects(self, obj) -> object_rows.Gathering:
        """`gather_objects(obj, "world")` begun now and read later (`.result()`), on a process
        group of its own, so that no collective of the training queues behind it: the adaptive
        controller posts a step's summary after the step and reads it after the next one, when
        every rank has long posted its own. Every rank starts and reads them in the same order;
        the first call creates the group (collective)."""
        if self.dims.world_size == 1 or not self.initialized:
            return object_rows.Gathering.of([obj])
        if self._control_pg is None:
            self._control_pg = dist.new_group(list(range(self.dims.world_size)),
                                              timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._gathering(obj, "world", self._control_pg, ("control",),
                               "start_gather_objects")

    def _gathering(self, obj, dim: str, group, key: tuple, op: str) -> object_rows.Gathering:
        """`obj`'s rows posted to an all_gather over `group` (`dim`'s ranks); row width kept
        under `key`."""
        def all_gather(rows, row, async_op):
            return dist.all_gather(rows, row, group=group, async_op=async_op)

        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return object_rows.Gathering(self, all_gather, data, key, dim, op)

    def broadcast_object(self, obj, src_rank: int = 0):
        if self.dims.world_size == 1 or not self.initialized:
            return obj
        box = [obj]
        call = self._blocking("world", "broadcast_object")
        dist.broadcast_object_list(box, src=src_rank)
        self._unblocked(call)
        return box[0]


def _done_handle(comm: Comm, result) -> Handle:
    h = Handle(comm, None, CommCall("none", "noop", 0), [], None)
    h.done, h.result = True, result
    return h


def shutdown_distributed() -> None:
    """Wait for every rank, then tear the default group down (a rank leaving early while a
    peer still talks to it makes gloo abort that peer)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
