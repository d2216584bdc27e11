"""Control objects as fixed-width byte rows, so that gathering them takes one collective.

PyTorch's object gather takes two rounds: the sizes, then the padded payloads. The
adaptive controller gathers a small summary from every rank after every step, so the first round
is half its cost. Here each rank pickles its object into a row of `capacity` bytes behind an
8-byte length; one all_gather of the rows brings every object whose pickle fits. When one does
not, every rank sees that rank's length in the header, and all of them grow the capacity of
that group alike (the next power of two) and gather again: the rare second round.
`Gathering` posts that gather and reads it, at once or a step later.
"""

from __future__ import annotations

import pickle

import torch

HEADER = 8                      # bytes of the little-endian pickle length
START_CAPACITY = 4 << 10        # bytes of payload per rank before any object outgrew it


def pack(data: bytes, capacity: int, device: torch.device) -> torch.Tensor:
    """A pickle `data` as a row: its length, then the bytes if they fit `capacity` (else zeros)."""
    row = torch.zeros(HEADER + capacity, dtype=torch.uint8)
    row[:HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(HEADER, "little")),
                                    dtype=torch.uint8)
    if len(data) <= capacity:
        row[HEADER:HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return row.to(device)


def length(row: torch.Tensor) -> int:
    return int.from_bytes(row[:HEADER].cpu().numpy().tobytes(), "little")


def unpack(row: torch.Tensor, n: int):
    """The object of a row whose pickle is `n` bytes long (`length(row)`)."""
    return pickle.loads(row[HEADER:HEADER + n].cpu().numpy().tobytes())


def grown(capacity: int, needed: int) -> int:
    """The capacity that holds `needed` bytes: doubled from `capacity` until it does."""
    while capacity < needed:
        capacity *= 2
    return capacity


class Gathering:
    """An all_gather of every rank's object in a group, posted now and read by `result`: at
    once (Comm.gather_objects) or later (Comm.start_gather_objects, whose rows travel in the
    background on a process group of their own). A row that outgrew the capacity is gathered
    again, wider, when read (every rank reads the same lengths, so all of them do)."""

    def __init__(self, comm, all_gather, data: bytes, key: tuple, dim: str, op: str):
        """`all_gather(rows, row, async_op)`: Comm's call on `dim`'s group (the chokepoint's);
        `op` names the call the hang watchdog sees a rank blocked on while it waits."""
        self.comm, self.all_gather, self.data, self.key = comm, all_gather, data, key
        self.dim, self.op = dim, op
        self.objects: list | None = None
        self.capacity = comm._object_capacity.get(key, START_CAPACITY)
        row = pack(data, self.capacity, comm.device)
        self.rows = [torch.empty_like(row) for _ in range(comm.size(dim))]
        self.work = all_gather(self.rows, row, async_op=True)

    @classmethod
    def of(cls, objects: list) -> Gathering:
        """One already complete (a world of one rank)."""
        done = cls.__new__(cls)
        done.objects = objects
        return done

    def result(self) -> list:
        """Every rank's object, in rank order (waits for the slowest rank's, if it must)."""
        if self.objects is not None:
            return self.objects
        call = self.comm._blocking(self.dim, self.op)
        self.work.wait()
        lengths = [length(r) for r in self.rows]
        while max(lengths) > self.capacity:
            self.capacity = self.comm._object_capacity[self.key] = grown(self.capacity,
                                                                         max(lengths))
            row = pack(self.data, self.capacity, self.comm.device)
            self.rows = [torch.empty_like(row) for _ in self.rows]
            self.all_gather(self.rows, row, async_op=False)
            lengths = [length(r) for r in self.rows]
        self.comm._unblocked(call)
        self.objects = [unpack(r, n) for r, n in zip(self.rows, lengths)]
        self.rows = self.work = self.data = self.all_gather = None
        return self.objects
