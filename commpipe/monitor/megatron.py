"""Install the commpipe monitor into Megatron-Core's pipeline point-to-point communication.

    from commpipe.monitor import megatron as cpm
    monitor = cpm.install(out_dir="runs/megatron", sample=0.1)   # after torch.distributed init
    ...  # Megatron training; after every iteration on every rank:
    monitor.end_step(iteration)
    ...
    cpm.uninstall(); monitor.close()

It wraps `megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate`
(keyword-only `tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
wait_on_reqs`; returns `(tensor_recv_prev, tensor_recv_next, reqs)`), the one function every
Megatron pipeline schedule sends activations and gradients through. Each direction becomes a
commpipe `CommCall` (dim "pp") shown to the same Monitor the commpipe runtime uses:
  - sent bytes come from the tensors, received bytes from the requested shape and the
    config's pipeline_dtype (what Megatron allocates for the receive), corrected to the
    returned receive tensor when variable_seq_lengths makes the two differ;
  - with wait_on_reqs=True the ops are complete when the function returns; with
    wait_on_reqs=False (overlapped communication) the returned requests are wrapped so that a
    call is timed when its request's wait() returns, not when the function returned.
"""

from __future__ import annotations

import math
import time

import torch

from commpipe.parallel.comm import CommCall

_TARGET = "megatron.core.pipeline_parallel.p2p_communication"
_installed: dict = {}   # patched class -> its original _communicate


def _megatron_class():
    try:
        import importlib

        return importlib.import_module(_TARGET).P2PCommunicator
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"commpipe.monitor.megatron needs Megatron-Core with {_TARGET}.P2PCommunicator "
            f"({e}); install it (pip install megatron-core) or pass target=<your class>") from e


def _peer(rank):
    # some Megatron versions keep one peer per pipeline group in a list
    return rank[0] if isinstance(rank, list | tuple) else rank


class _TimedReq:
    """A request whose first wait() also completes the monitored call(s) behind it."""

    def __init__(self, req, on_wait):
        self._req, self._on_wait = req, on_wait

    def wait(self, *args, **kwargs):
        out = self._req.wait(*args, **kwargs) if self._req is not None else None
        if self._on_wait is not None:
            on_wait, self._on_wait = self._on_wait, None
            on_wait()
        return out

    def __getattr__(self, name):
        return getattr(self._req, name)


def install(monitor=None, *, target=None, out_dir=None, comm=None, **monitor_kwargs):
    """Patch `target` (default: Megatron-Core's P2PCommunicator) to feed `monitor`.

    With no monitor, one is built over a commpipe Comm spanning the world (torch.distributed
    must be initialised; collective) writing into `out_dir`, with `monitor_kwargs` (sample,
    seed, ema_alpha, trace). Returns the monitor; call its end_step(iteration) after every
    iteration on every rank.
    """
    from commpipe.monitor.monitor import Monitor

    cls = target if target is not None else _megatron_class()
    if cls in _installed:
        raise ValueError(f"{cls.__name__}._communicate is already monitored; uninstall() first")
    if monitor is None:
        if out_dir is None:
            raise ValueError("install() needs a monitor or out_dir= to build one")
        if comm is None:
            comm = _world_comm()
        monitor = Monitor(comm, out_dir, **monitor_kwargs)
    if not monitor._synced:
        monitor.attach(observe=False)  # this adapter feeds it, not the commpipe Comm
    original = cls._communicate
    seqs: dict = {}

    def new_call(op, peer, nbytes, dtype) -> CommCall:
        key = ("pp", op, peer)
        seq = seqs.get(key, 0)
        seqs[key] = seq + 1
        # one size class: with variable_seq_lengths a receive learns its size only after the
        # call, so both ends could not agree on a class up front
        return CommCall(dim="pp", op=op, nbytes=nbytes, peer=peer, seq=seq, size_seq=seq,
                        dtype=str(dtype))

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True, **kwargs):
        dtype = getattr(self.config, "pipeline_dtype", None) or torch.float32
        recv_bytes = math.prod(tensor_shape) * dtype.itemsize if tensor_shape is not None else 0
        calls = []
        if tensor_send_next is not None:
            calls.append(("send_next", new_call("send", _peer(self.next_rank),
                                                tensor_send_next.numel() * tensor_send_next.element_size(),
                                                tensor_send_next.dtype)))
        if tensor_send_prev is not None:
            calls.append(("send_prev", new_call("send", _peer(self.prev_rank),
                                                tensor_send_prev.numel() * tensor_send_prev.element_size(),
                                                tensor_send_prev.dtype)))
        if recv_prev:
            calls.append(("recv_prev", new_call("recv", _peer(self.prev_rank), recv_bytes, dtype)))
        if recv_next:
            calls.append(("recv_next", new_call("recv", _peer(self.next_rank), recv_bytes, dtype)))
        ctxs = [monitor.begin(c) for _, c in calls]
        t_post = time.perf_counter()
        for _, c in calls:
            c.t_post = t_post
        out = original(self, tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                       recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                       wait_on_reqs=wait_on_reqs, **kwargs)
        recv_prev_t, recv_next_t, reqs = out
        # with variable_seq_lengths Megatron exchanges shapes first and allocates what arrives
        got = {"recv_prev": recv_prev_t, "recv_next": recv_next_t}
        for name, c in calls:
            if got.get(name) is not None:
                c.nbytes = got[name].numel() * got[name].element_size()

        def finish(items):
            now = time.perf_counter()
            for (_, c), ctx in items:
                c.t_done = now
                monitor.end(ctx, c)

        pairs = list(zip(calls, ctxs))
        if wait_on_reqs or not reqs:
            finish(pairs)                      # the ops completed before the function returned
            return out
        if isinstance(reqs, dict):
            wrapped = {}
            for name, req in reqs.items():
                mine = [p for p in pairs if p[0][0] == name]
                wrapped[name] = _TimedReq(req, (lambda m=mine: finish(m)) if mine else None)
            finish([p for p in pairs if p[0][0] not in reqs])
            return recv_prev_t, recv_next_t, wrapped
        # a list of requests without names: the calls complete when the last one is waited
        left = [len(reqs)]

        def one_done():
            left[0] -= 1
            if left[0] == 0:
                finish(pairs)
        return recv_prev_t, recv_next_t, [_TimedReq(r, one_done) for r in reqs]

    _communicate.__wrapped__ = original
    _installed[cls] = original
    cls._communicate = _communicate
    return monitor


def uninstall(target=None) -> None:
    """Restore the original `_communicate` (of `target`, or of every patched class)."""
    for cls in ([target] if target is not None else list(_installed)):
        original = _installed.pop(cls, None)
        if original is not None:
            cls._communicate = original


def _world_comm():
    import torch.distributed as dist

    from commpipe.parallel.comm import Comm
    from commpipe.parallel.dims import ParallelDims

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("install() without a monitor builds one over torch.distributed's world; "
                         "call torch.distributed.init_process_group first (Megatron's "
                         "initialize_megatron does)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return Comm(ParallelDims(dp=dist.get_world_size()), dist.get_rank(), device=device)
