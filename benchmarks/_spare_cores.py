"""What a shared host had to spare for the processes a benchmark starts (planner_rank.py).

Not a benchmark itself: imported as a sibling module. On a machine that other work also uses,
the cores the measured ranks had are the machine's less what every other process used
meanwhile; `CpuMeter` samples both while the ranks run and `spare_cores` reads an interval.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class CpuMeter:
    """Samples twice a second the CPU time the whole host was busy (/proc/stat, steal included)
    and that of this process's descendants (live ones from /proc/PID/stat with their reaped
    children, plus those reaped here): on a shared machine, the cores the measured ranks had
    to themselves are the cores less what every other process used meanwhile."""

    def __init__(self, period_s: float = 0.5):
        import threading

        self.samples: list[tuple[float, float, float]] = []    # (time, host busy s, ours s)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.tick = os.sysconf("SC_CLK_TCK")

    def _busy(self) -> float:
        from commpipe.monitor.host_load import host_busy_s

        return host_busy_s() or 0.0

    def _ours(self) -> float:
        import resource

        parent, cpu = {}, {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d.name)] = int(f[1])
            cpu[int(d.name)] = sum(int(x) for x in f[11:15]) / self.tick   # utime stime cutime cstime
        me, total = os.getpid(), 0.0
        for pid in cpu:
            p = parent.get(pid)
            while p and p != me:
                p = parent.get(p)
            if p == me:
                total += cpu[pid]
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return total + r.ru_utime + r.ru_stime

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._busy(), self._ours()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def spare_cores(samples: list, start: float, end: float, cores: int) -> float:
    """Cores left to our processes between `start` and `end`: `cores` less the busy time of every
    other process over the interval (at least 0.1)."""
    inside = [s for s in samples if start <= s[0] <= end]
    before = [s for s in samples if s[0] < start][-1:]
    after = [s for s in samples if s[0] > end][:1]
    window = before + inside + after
    if len(window) < 2 or window[-1][0] - window[0][0] <= 0:
        return float(cores)
    (t0, busy0, ours0), (t1, busy1, ours1) = window[0], window[-1]
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (t1 - t0)
    return max(0.1, cores - others)
