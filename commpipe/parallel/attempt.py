"""The keys of one attempt in torchrun's agent store.

Under torchrun's elastic agent (commpipe.elastic.restart) the agent keeps one store across
restarts; a restarted gloo worker reading the addresses the previous attempt left there would
fail to connect. `init_distributed` (commpipe.parallel.world) therefore starts the process group
on a `PrefixStore` whose prefix names this attempt; the hang watchdog (commpipe.elastic.watchdog)
keeps its keys under the same prefix.
"""

from __future__ import annotations

import datetime
import os

_ATTEMPT: dict[str, str] = {}   # this process's attempt prefix, computed once per process


def attempt_store(world: int, timeout_s: float):
    """A client of torchrun's agent store whose keys belong to this attempt only, or None when
    the agent serves no store (not under torchrun, or its static rendezvous)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return PrefixStore(attempt_prefix(store, world), store)


def attempt_prefix(store, world: int) -> str:
    """`commpipe/<restart>/<world>/<generation>/`: the restart count (TORCHELASTIC_RESTART_COUNT)
    changes on a failure, not on a membership change (a node joining restarts the workers at
    the same count), so each worker also counts itself in: all workers of one attempt start
    after every worker of the attempt before has stopped, so the n-th worker to join has
    generation (n - 1) // world, the same for all of them."""
    if "prefix" not in _ATTEMPT:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        n = store.add(f"commpipe/joined/{restart}/{world}", 1)
        _ATTEMPT["prefix"] = f"commpipe/{restart}/{world}/{(n - 1) // world}/"
    return _ATTEMPT["prefix"]


def current_prefix() -> str:
    """This attempt's prefix (after attempt_store); the restart count alone otherwise."""
    return _ATTEMPT.get("prefix") or f"commpipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
