"""Where a rank's piece of a checkpoint's full tensor lives: TP slices and expert rows (and, for
an in-memory switch, the whole tensors gathered over tp and ep: commpipe.adapt.switch).

A checkpoint holds every parameter (and its AdamW moments) under its logical name as the tensor
of a one-device model (commpipe.train.checkpoint). Two placements cut it across ranks:

    TP   `placement(p).tp_dim` (commpipe.parallel.placement): the slice along that dimension. Saving
         all-gathers it over tp through Comm and one rank writes the whole tensor; loading reads
         the whole tensor and keeps this rank's slice. An expert tensor under tp > 1 is cut
         both ways (commpipe.parallel.tensor_moe): its TP slices are put together first, then
         its rows are handled as EP below, and loading keeps the TP slice of the rows read.
    EP   `placement(p).ep_sharded` (commpipe.parallel.expert): rows [ep_rank * E/ep, (ep_rank + 1) * E/ep)
         of an expert weight stacked [E, ...]. Nothing is gathered: each rank of one EP group
         writes its rows as a DCP shard of the [E, ...] tensor at its global row offset (a
         DTensor whose global size is the full tensor's), so the checkpoint holds the full
         tensor in ep chunks. Loading asks DCP for the rows of this rank's experts under the
         layout being loaded, again as a shard at its offset; DCP cuts them from whichever stored
         chunks overlap them, so ep may change between save and load (ep 1 asks for all E rows,
         a plain tensor, and a one-process run reads an expert-parallel checkpoint the same way).

Who writes: a replicated tensor is written by the rank at dp=0, cp=0, tp=0 of the stage holding
it; an expert shard by the ranks at edp=0 (the first EP group of each dp x cp group), tp=0:
one copy of every expert, once.
"""

from __future__ import annotations

import torch

from commpipe.parallel.placement import placement


def ep_sharded(p: torch.Tensor) -> bool:
    return placement(p).ep_sharded


def full_shape(p: torch.Tensor, comm) -> tuple[int, ...]:
    """The shape of p's logical (one-device) tensor (an expert tensor may be cut both ways:
    its rows over ep, its tp_dim over tp)."""
    shape = list(tp_whole_shape(p, comm))
    if ep_sharded(p):
        shape[0] *= comm.size("ep")
    return tuple(shape)


def tp_whole_shape(p: torch.Tensor, comm) -> tuple[int, ...]:
    """p's shape with its TP slices put together (its expert rows still this rank's)."""
    shape = list(p.shape)
    tp_dim = placement(p).tp_dim
    if tp_dim is not None:
        shape[tp_dim] *= comm.size("tp")
    return tuple(shape)


# -- TP: whole tensors -----------------------------------------------------------------------------
def gather_tp(t: torch.Tensor, tp_dim: int | None, comm) -> torch.Tensor:
    """The full tensor from this TP group's shards (all-gather through Comm along tp_dim)."""
    if tp_dim is None or comm.size("tp") == 1:
        return t.detach().clone()
    moved = t.detach().movedim(tp_dim, 0).contiguous()     # Comm gathers along dim 0
    return comm.all_gather(moved, "tp").movedim(0, tp_dim).contiguous()


def shard_tp(full: torch.Tensor, tp_dim: int | None, comm) -> torch.Tensor:
    if tp_dim is None or comm.size("tp") == 1:
        return full
    return full.chunk(comm.size("tp"), dim=tp_dim)[comm.local_rank("tp")]


# -- EP: whole tensors in memory (commpipe.adapt.switch) -------------------------------------------
def gather_ep(t: torch.Tensor, p: torch.Tensor, comm) -> torch.Tensor:
    """The whole [E, ...] tensor of expert parameter p (or of one of its AdamW moments, `t`)
    from this rank's EP group: the rows of its i-th rank at i * E/ep, as apply_ep hands them
    out (an all-gather through Comm along dim 0); other tensors as they are."""
    if not ep_sharded(p) or comm.size("ep") == 1:
        return t.detach().clone()
    return comm.all_gather(t.detach().contiguous(), "ep")


def shard_ep(full: torch.Tensor, p: torch.Tensor, comm) -> torch.Tensor:
    """This rank's rows of the whole [E, ...] tensor of expert parameter p under comm's ep
    group (rows [ep_rank * E/ep, (ep_rank + 1) * E/ep)); other tensors as they are."""
    if not ep_sharded(p) or comm.size("ep") == 1:
        return full
    return full.chunk(comm.size("ep"), dim=0)[comm.local_rank("ep")]


# -- the values DCP reads and writes -----------------------------------------------------------------
def writes_model(p: torch.Tensor, comm, as_dp0: bool = False) -> bool:
    """Does this rank's TP group write p (its tp=0 rank after the gather)? `as_dp0`: as the
    dp=0 replica of these coordinates would (commpipe.train.peer_copies)."""
    c = comm.coords
    if ep_sharded(p):
        return comm.local_rank("edp") == 0 and c["cp"] == 0
    return (c["dp"] == 0 or as_dp0) and c["cp"] == 0


def to_save(value: torch.Tensor, p: torch.Tensor, comm):
    """What DCP writes for `value`, the full tensor (TP already gathered) or this rank's expert
    rows of parameter p or of one of its AdamW moments: a CPU tensor, or for expert rows a
    DTensor placing them at their global offset."""
    value = value.detach().cpu()
    if not ep_sharded(p):
        return value
    return _sharded(value.contiguous(), full_shape(p, comm), comm)


def for_load(p: torch.Tensor, comm, dtype: torch.dtype | None = None):
    """An empty target DCP fills with p's full tensor, or with this rank's expert rows at their
    global offset (a DTensor)."""
    dtype = dtype or p.dtype
    if not ep_sharded(p):
        return torch.empty(full_shape(p, comm), dtype=dtype)
    local = torch.empty(tp_whole_shape(p, comm), dtype=dtype)   # its experts, every TP slice
    return _sharded(local, full_shape(p, comm), comm)


def local_part(loaded, p: torch.Tensor, comm) -> torch.Tensor:
    """This rank's piece of p from what `for_load` made and DCP filled: its TP slice of the
    full tensor, or of its expert rows."""
    if ep_sharded(p):
        loaded = loaded.to_local()
    return shard_tp(loaded, placement(p).tp_dim, comm)


def _sharded(local: torch.Tensor, size: tuple[int, ...], comm):
    """`local` as this rank's rows of a [size] tensor sharded over comm's ep group: a DTensor
    on a one-dimensional mesh of the group's ranks in group order, placed Shard(0), so the rows
    of the group's i-th rank start at i * len(local), as apply_ep hands out the experts."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:     # torch 2.4: DTensor's module before it was made public
        from torch.distributed._tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(comm.process_group("ep"), "cpu", mesh=list(comm.groups["ep"]))
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(size),
                              stride=stride)
