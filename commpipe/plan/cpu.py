"""A CPU as the planner's "GPU": peak FLOP/s and memory bandwidth measured on this machine.

    python -m commpipe.plan.cpu                 # prints the entry as JSON
    commpipe estimate --gpu cpu ...             # measured once per process

A CPU has no datasheet number that its training reaches: commpipe trains on CPU in fp32 with
one thread per rank (torchrun sets OMP_NUM_THREADS=1), so the peak is what one thread's fp32
matmul reaches here (a square GEMM large enough to be compute-bound: 512^3, ~2 ms) and the
"HBM" bandwidth is what one thread's copy of a 256 MB tensor reaches (read + write bytes). The
entry describes one rank's share of the machine when every rank has its own core; more ranks
than cores are `Cluster.host_cores`'s business (commpipe.plan.host). Links come from
`commpipe probe`, not from here: nvlink_gbps and nic_gbps are placeholders (the copy rate, and
1 GB/s) for a cluster built without a probe.
"""

from __future__ import annotations

import json
import os
import time
from functools import lru_cache

from commpipe.plan.gpus import GPU


def _best_seconds(fn, repeats: int) -> float:
    fn()                                           # warm-up: allocation, page faults, caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu(threads: int = 1, gemm: int = 512, copy_mb: int = 256, repeats: int = 5) -> GPU:
    """Measure peak fp32 matmul FLOP/s and copy bandwidth with `threads` threads."""
    import torch

    if threads < 1 or gemm < 16 or copy_mb < 1:
        raise ValueError("measure_cpu needs threads >= 1, gemm >= 16 and copy_mb >= 1")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
        out = torch.empty(gemm, gemm)
        t_mm = _best_seconds(lambda: torch.mm(a, b, out=out), repeats)
        src = torch.ones(copy_mb * (1 << 20) // 4)
        dst = torch.empty_like(src)
        t_copy = _best_seconds(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(previous)
    tflops = 2 * gemm ** 3 / t_mm / 1e12
    copy_gbps = 2 * src.numel() * 4 / t_copy / 1e9          # read + write
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return GPU("cpu", tflops, round(mem_gb, 1), copy_gbps, copy_gbps, 1.0)


@lru_cache(maxsize=1)
def this_cpu() -> GPU:
    """The measured entry, once per process (`--gpu cpu`)."""
    return measure_cpu()


if __name__ == "__main__":
    print(json.dumps(this_cpu().to_dict(), indent=2))
