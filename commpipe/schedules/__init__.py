"""Pipeline schedules as data (see actions.py for the representation)."""

from commpipe.schedules.actions import (
    COMM_OPS,
    COMPUTE_OPS,
    Action,
    Program,
    dump_csv,
    load_csv,
    lower,
)
from commpipe.schedules.generators import gpipe, one_f_one_b

GENERATORS = {
    "gpipe": lambda p, m, v=1: gpipe(p, m),
    "1f1b": lambda p, m, v=1: one_f_one_b(p, m),
}


def generate(name: str, pp: int, microbatches: int, vpp: int = 1) -> Program:
    """A compute-only program for a named schedule, or a program loaded from a CSV path."""
    if name.endswith(".csv"):
        return load_csv(name)
    if name not in GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(GENERATORS)} "
                         "or a path to a schedule .csv")
    return GENERATORS[name](pp, microbatches, vpp)


__all__ = ["Action", "Program", "COMM_OPS", "COMPUTE_OPS", "dump_csv", "load_csv", "lower",
           "generate", "GENERATORS", "gpipe", "one_f_one_b"]
