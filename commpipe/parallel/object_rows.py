"""Control objects as fixed-width byte rows, so that gathering them takes one collective.

PyTorch's object gather takes two rounds: the sizes, then the padded payloads. The
adaptive controller gathers a small summary from every rank after every step, so the first round
is half its cost. Here each rank pickles its object into a row of `capacity` bytes behind an
8-byte length; one all_gather of the rows brings every object whose pickle fits. When one does
not, every rank sees that rank's length in the header, and all of them grow the capacity of
that group alike (the next power of two) and gather again: the rare second round.
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
