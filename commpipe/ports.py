"""A rendezvous port for processes launched on this host (`commpipe probe`, the test harness).

`bind(("127.0.0.1", 0))` hands out a port from the kernel's ephemeral range, the same range it
gives every outgoing connection; between picking it and rank 0 binding it (seconds later on a
loaded host) another process's connection, or a rank's own connect attempt to it (a TCP
self-connect), may take it. `free_port` picks a free port below that range instead.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, below the ephemeral range where there is room (10000 up to
    it), chosen at random so that concurrent launches differ; else any free port."""
    low = ephemeral_low()
    pick = random.Random()                    # seeded from os.urandom
    for _ in range(200 if low > 12000 else 0):
        port = pick.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# torchrun for a node that joins a rendezvous another agent hosts on this machine: it imports
# torch first and starts only once the store at the port listens, so its join falls within the
# host agent's last call even on a loaded machine (the import alone can take longer than that,
# and a late node then meets a job already running)
JOIN_WHEN_LISTENING = """import socket, sys, time
from torch.distributed.run import main
def listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
while not listening(int(sys.argv[1])):
    time.sleep(0.02)
main(sys.argv[2:])
"""


def torchrun_argv(port: int, join: bool = False) -> list[str]:
    """The interpreter arguments that run torchrun: at once, or (`join`) once 127.0.0.1:port
    listens."""
    return ["-c", JOIN_WHEN_LISTENING, str(port)] if join else ["-m", "torch.distributed.run"]
