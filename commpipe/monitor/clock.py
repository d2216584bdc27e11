"""Clocks for the monitor: one time base for all ranks, and device-side timing on GPU.

Host clocks: every rank times with time.perf_counter(), whose origin differs between hosts.
Ranks on the same kernel as rank 0 (same boot id and time namespace, perf_counter backed by
CLOCK_MONOTONIC) read the very same clock: their offset is exactly 0 and is not estimated
(an estimate could only add error). For the others `estimate_offset` measures the offset by
ping-pong with rank 0 through the comm chokepoint (Cristian's algorithm: rank r sends its time
t0, rank 0 answers with its own time s, rank r reads t1; offset = (t0 + t1) / 2 - s, error at
most half the round trip, so the round with the smallest round trip is kept).
Aligned time = local time - offset.

Device clocks: on CUDA a completed host call only means the work was *enqueued*. `CudaEvents`
records pooled timing events on the current stream before the op is issued, and the comm
records the completion event on a side stream made to wait for the op itself (so a consumer
that waits late does not stretch it; commpipe.parallel.completion); both are read only once
`event.query()` reports completion (no device synchronize on the hot path). Event times are
placed on the host clock through an anchor event recorded right after a synchronize at
calibration time (attach and every re-sync), off the hot path.
"""

from __future__ import annotations

import os
import socket
import time

import torch


def clock_identity() -> str | None:
    """Equal on two processes exactly when their perf_counter() reads the same clock."""
    info = time.get_clock_info("perf_counter")
    if "CLOCK_MONOTONIC" not in info.implementation:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.readlink("/proc/self/ns/time") if os.path.exists("/proc/self/ns/time") else "-"
    except OSError:
        return None
    return f"{boot}|{ns}|{info.implementation}"


def machine_identity() -> str:
    """Equal on two processes exactly when they share one machine's cores: the same host name
    and boot id, whatever their network namespace (the emulated cluster's nodes share one)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    return f"{socket.gethostname()}|{boot}"


def node_identity() -> str:
    """Equal on two processes exactly when they run on one node: the same host (name and boot
    id) and the same network namespace. Ranks of one real host share all three, and talk over
    loopback or shared memory; across real hosts the name and boot id differ. The emulated
    cluster (commpipe.cluster.netns) runs every node in its own network namespace of one host,
    so there the namespace tells the nodes apart, as their links do."""
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "-"
    return f"{machine_identity()}|{netns}"


def estimate_offset(comm, rounds: int = 8, trust_shared_clock: bool = True) -> float:
    """Seconds to subtract from this rank's perf_counter() to get rank 0's clock.

    Collective over the world: every rank must call it. The ping-pong runs with the comm's
    observers removed, so no monitor records it as training traffic. trust_shared_clock=False
    ping-pongs even with ranks that share rank 0's clock (to check the estimator).
    """
    world = comm.dims.world_size
    if world == 1 or not comm.initialized:
        return 0.0
    ids = comm.gather_objects(clock_identity(), "world")
    remote = [r for r in range(1, world)
              if not trust_shared_clock or ids[r] is None or ids[r] != ids[0]]
    if comm.rank != 0 and comm.rank not in remote:
        return 0.0
    saved = comm.observers
    comm.observers = []
    cuda = comm.device.type == "cuda"
    try:
        buf = torch.zeros(1, dtype=torch.float64, device=comm.device)
        if comm.rank == 0:
            for peer in remote:
                for _ in range(rounds):
                    comm.recv(buf, peer, dim="world")
                    if cuda:
                        torch.cuda.synchronize(comm.device)  # the data has really arrived
                    buf.fill_(time.perf_counter())
                    comm.send(buf, peer, dim="world")
            return 0.0
        best_rtt, best_offset = float("inf"), 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            buf.fill_(t0)
            comm.send(buf, 0, dim="world")
            comm.recv(buf, 0, dim="world")
            remote = buf.item()             # .item() waits for the data on CUDA
            t1 = time.perf_counter()
            if t1 - t0 < best_rtt:
                best_rtt, best_offset = t1 - t0, (t0 + t1) / 2.0 - remote
        return best_offset
    finally:
        comm.observers = saved


class CudaEvents:
    """Pooled `torch.cuda.Event(enable_timing=True)` placed on the host clock via an anchor."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: list = []
        self.anchor: tuple | None = None   # (event, host perf_counter seconds)

    def calibrate(self) -> None:
        torch.cuda.synchronize(self.device)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        ev.synchronize()
        self.anchor = (ev, time.perf_counter())

    def take(self):
        """A pooled event, not recorded yet (the comm records it on its side stream)."""
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def record(self):
        ev = self.take()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def ready(ev) -> bool:
        return ev.query()

    @staticmethod
    def host_seconds(ev, anchor) -> float:
        """Host perf_counter time at which the device reached `ev` (both must be complete)."""
        return anchor[1] + anchor[0].elapsed_time(ev) / 1e3

    def release(self, *events) -> None:
        self._pool.extend(e for e in events if e is not None)
