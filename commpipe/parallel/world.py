"""The default process group of a run, started from torchrun's environment.

`init_distributed` starts it (gloo on CPUs, NCCL with one GPU per rank), in the store of this
restart attempt (commpipe.parallel.attempt). Ending it takes a barrier, which is communication:
`shutdown_distributed` stays in commpipe.parallel.comm, the one module that communicates, beside
the groups of each parallel dimension.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; (rank, world)."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        # one GPU per rank, chosen before the group starts: object collectives, checkpoint I/O
        # and the monitor's exchange use the current device, which is cuda:0 unless set. No
        # `device_id` (eager init): point-to-point then shares the default communicator and is
        # serialized with every collective, instead of one stream per rank pair
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # under torchrun the agent's store outlives a restart: this attempt's keys are kept apart
    from commpipe.parallel.attempt import attempt_store

    store = attempt_store(world, timeout_s)
    where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                      "world_size": world}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                            **where)
    return dist.get_rank(), dist.get_world_size()
