"""Run a benchmark's per-rank function on local ranks, as torchrun would (adapt_overhead.py,
monitor_overhead.py).

Not a benchmark itself: imported as a sibling module. Under torchrun (WORLD_SIZE set) the
function runs in this process; otherwise `nproc` ranks are spawned on this machine with the
environment torchrun gives them and one intra-op thread each (torchrun sets OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import os
import sys


def _rank(rank: int, world: int, port: int, rank_main, parse_args, argv) -> None:
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    rank_main(parse_args(argv))


def run_ranks(rank_main, parse_args, args, nproc: int, argv=None) -> None:
    """`rank_main(args)` here under torchrun, else `rank_main(parse_args(argv))` on `nproc`
    spawned ranks (the functions must be importable: module-level in the benchmark)."""
    if "WORLD_SIZE" in os.environ:
        rank_main(args)
        return
    import torch.multiprocessing as mp

    from commpipe.cluster.ports import free_port

    mp.spawn(_rank, args=(nproc, free_port(), rank_main, parse_args,
                          sys.argv[1:] if argv is None else argv), nprocs=nproc, join=True)
