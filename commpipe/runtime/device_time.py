"""Accelerator time emulated on a CPU host (`commpipe train --emulate-device FACTOR`).

On a GPU the host issues a kernel and is free while it runs: the threads that move data
(NCCL's proxy, a NIC's DMA) never wait for the compute they overlap. On a CPU host the compute
*is* the host's time, so a transfer in flight competes with it for the cores: on a 2-core
machine an all-to-all between two emulated nodes took 1.28-1.45x as long while the other ranks
computed (docs/moe.md, "Where the transfers' time goes"). To measure how a schedule hides
communication where the compute does not take the host, `DeviceTime(factor)` times every compute
operator of the training step (a TorchDispatchMode on the training thread) and then leaves the
host idle for `factor - 1` times that long, as if a device were still running the kernel.
Collectives (the `c10d` operators) are not stretched: their host time is the host's.

The idle time is owed per operator and paid in sleeps of at least `MIN_SLEEP_S`, so short
operators do not each pay the sleep call's own overshoot; an overshoot is paid back by the next
operators. Values are untouched: the same operators run on the same inputs.
"""

from __future__ import annotations

import time

from torch.utils._python_dispatch import TorchDispatchMode

MIN_SLEEP_S = 0.002
NOT_COMPUTE = ("c10d", "_c10d_functional", "_dtensor")


class DeviceTime(TorchDispatchMode):
    def __init__(self, factor: float):
        super().__init__()
        check_factor(factor)
        self.factor = factor
        self.op_s = 0.0         # compute operators' own host time
        self.idle_s = 0.0       # time left idle for the emulated device
        self._owed = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func.namespace in NOT_COMPUTE:
            return out
        dt = time.perf_counter() - t0
        self.op_s += dt
        self._owed += (self.factor - 1.0) * dt
        if self._owed >= MIN_SLEEP_S:
            t1 = time.perf_counter()
            time.sleep(self._owed)
            slept = time.perf_counter() - t1
            self.idle_s += slept
            self._owed -= slept
        return out


def check_factor(factor: float) -> None:
    """Refuse a factor `--emulate-device` cannot use (`commpipe train`, `commpipe demo`)."""
    import math

    if not (math.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"--emulate-device {factor}: give a finite factor >= 1 "
                         "(3: compute takes 3x its time; 1: off)")


def emulated(factor: float):
    """The mode to run every training step under (entered once per step; it keeps its totals
    and what it owes across steps), or a no-op context at factor 1."""
    from contextlib import nullcontext

    return DeviceTime(factor) if factor > 1.0 else nullcontext()
