"""How much of a host's cores other processes used while a measurement ran.

A measurement on a CPU host (`commpipe probe`'s call times, the planner's pass rates) is what a
training step pays only on a host as idle as the measurement's. Linux counts the time every core
was busy since boot in the first line of /proc/stat (user, nice, system, irq, softirq and steal
ticks); over an interval, that less the CPU time of the measuring processes themselves is the
work of everything else. `Span` records both ends on one process; `other_cores` reads the spans
of the processes that measured together on one host.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BUSY_SHARE = 0.1        # other work above this share of a host's cores is worth a warning


def host_busy_s() -> float | None:
    """CPU seconds this host's cores have been busy since boot, steal included (None where
    /proc/stat cannot be read: not Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass
class Span:
    """One process's view of an interval: wall time, the host's busy CPU time and its own CPU
    time (every thread of the process) at both ends."""

    wall0: float
    busy0: float | None
    own0: float
    wall1: float = 0.0
    busy1: float | None = None
    own1: float = 0.0
    cores: int = 1

    @classmethod
    def start(cls) -> Span:
        return cls(time.time(), host_busy_s(), time.process_time(), cores=os.cpu_count() or 1)

    def stop(self) -> Span:
        self.wall1, self.busy1, self.own1 = time.time(), host_busy_s(), time.process_time()
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def other_cores(spans: list[dict]) -> float | None:
    """Cores that processes other than those of `spans` (Span.to_dict of each process measuring
    on one host, over about the same interval) kept busy on average: the host's busy time over
    the spans' common stretch less every span's own CPU time, per second. None without /proc."""
    if not spans or any(s["busy0"] is None or s["busy1"] is None for s in spans):
        return None
    wall = max(s["wall1"] for s in spans) - min(s["wall0"] for s in spans)
    if wall <= 0:
        return None
    # the ranks read /proc/stat moments apart: the host's busy time from the earliest reading to
    # the latest covers every rank's own time
    busy = max(s["busy1"] for s in spans) - min(s["busy0"] for s in spans)
    own = sum(s["own1"] - s["own0"] for s in spans)
    return max(0.0, busy - own) / wall


def busy_warning(others: float | None, cores: int, what: str) -> str | None:
    """A line for the console when other processes took more than BUSY_SHARE of the host's
    `cores` while `what` was measured; None otherwise."""
    if others is None or others <= BUSY_SHARE * cores:
        return None
    return (f"warning: other processes kept {others:.1f} of this host's {cores} cores busy while "
            f"{what}, so its times read slower than on an idle host; measure again when the "
            "host is idle")
