"""When did a communication call complete? Observed when the data has arrived, not when a
consumer happens to wait for it.

The pipeline runtime posts receives ahead of their consumer and waits on sends at step end, so
the moment `wait()` returns says when the runtime looked, not when the transfer finished. For
the calls an observer asks to time (`CommCall.watch`, set in `observer.begin`), `watch` starts
an independent completion observation right after the op is issued:

- CPU (gloo): a watcher thread blocks in `work.wait()` (which releases the GIL) and stamps
  `call.t_done` the moment it returns. Gloo's point-to-point works never report completion
  through `is_completed()` before someone waits on them, and have no future (torch 2.13:
  "Work::getFuture not implemented"), so polling cannot see them; and a gloo send or receive
  may be waited on only once, so the consumer's `Handle.wait()` then waits for the watcher
  instead of the work. If the consumer comes first (a collective waited at once, while the
  watcher thread has not been scheduled yet), it waits and stamps itself, which is as exact
  there and spares a thread hand-over on a busy host. Threads come from a small process-wide
  pool that grows to the number of watched calls in flight at once (a handful at 10% sampling)
  and stays idle afterwards.
- CUDA (nccl): no thread. A side stream is made to wait for the op (`work.wait()` under that
  stream only orders streams, the host does not block) and the event the observer put in
  `call.ev_done` is recorded there, so it completes when the communication kernel does; the
  consumer's wait is untouched.

Unwatched calls (the common, unsampled case) pay one attribute test.
"""

from __future__ import annotations

import queue
import threading
import time

import torch


class Watch:
    """One watched CPU call: whoever starts waiting on the work first (the watcher thread, or
    the consumer when the watcher has not got a core yet, as for a collective waited at once)
    waits and stamps the completion; `wait()` returns once that is done."""

    __slots__ = ("work", "call", "done", "error", "_claim")

    def __init__(self, work, call):
        self.work, self.call = work, call
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._claim = threading.Lock()

    def run(self) -> None:
        """Wait on the work and stamp its completion, unless the other side already does."""
        if not self._claim.acquire(blocking=False):
            return
        try:
            self.work.wait()
        except BaseException as e:   # raised in the consumer's wait()
            self.error = e
        self.call.t_done = time.perf_counter()
        self.work = None
        self.done.set()

    def wait(self) -> None:
        self.run()
        self.done.wait()
        if self.error is not None:
            raise self.error


class _Pool:
    """Watcher threads; one per watched call in flight, reused once idle."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.threads = 0

    def submit(self, w: Watch) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:   # every thread is blocked on another call: this one must not queue behind it
                self.threads += 1
                threading.Thread(target=self._loop, name=f"commpipe-watch-{self.threads}",
                                 daemon=True).start()
        self._queue.put(w)

    def _loop(self) -> None:
        while True:
            self._queue.get().run()
            with self._lock:
                self._idle += 1


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()
_SIDE_STREAMS: dict = {}


def _pool() -> _Pool:
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = _Pool()
    return _POOL


def watch(work, call, device: torch.device, backend: str = "gloo") -> Watch | None:
    """Start observing `work`'s completion for `call` (see the module docstring). Returns the
    Watch the consumer must wait on instead of the work (gloo), or None (CUDA: wait as usual)."""
    if backend == "nccl" or device.type == "cuda":
        # a watcher thread must never wait on an NCCL work: the consumer's own wait() is what
        # orders its stream after the communication
        if call.ev_done is None or device.type != "cuda":
            return None
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            work.wait()          # stream order only: the side stream waits for the op's end
        call.ev_done.record(stream)
        call.extra["ev_done_recorded"] = True
        return None
    w = Watch(work, call)
    _pool().submit(w)
    return w
