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
from commpipe.schedules.braided import dualpipev, stp
from commpipe.schedules.generators import gpipe, interleaved, one_f_one_b, zb_h1, zbv
from commpipe.schedules.validate import ScheduleDeadlock, ScheduleError, check_program, dry_run


def _one_chunk(name, gen):
    """Schedules with one stage per rank reject --vpp > 1 instead of silently ignoring it."""
    def build(p, m, v=1):
        if v != 1:
            raise ValueError(f"{name} places one stage per rank, got vpp={v}; drop --vpp or use "
                             "--schedule interleaved (any vpp >= 2) or zbv (2 chunks per rank)")
        return gen(p, m)
    return build


def _zbv(p, m, v=2):
    # ZB-V always has two chunks per rank; vpp=1 (the default everywhere) is accepted for it
    if v not in (1, 2):
        raise ValueError(f"zbv always uses 2 chunks per rank (V shape), got vpp={v}; "
                         "use --vpp 2 or drop --vpp")
    return zbv(p, m)


def _v2(name, gen):
    """Braided V schedules: always two chunks per rank; vpp 1 (the default) or 2 accepted."""
    def build(p, m, v=2):
        if v not in (1, 2):
            raise ValueError(f"{name} always uses 2 chunks per rank (V shape), got vpp={v}; "
                             "use --vpp 2 or drop --vpp")
        return gen(p, m)
    return build


GENERATORS = {
    "gpipe": _one_chunk("gpipe", gpipe),
    "1f1b": _one_chunk("1f1b", one_f_one_b),
    "interleaved": lambda p, m, v=1: interleaved(p, m, v),
    "zbh1": _one_chunk("zbh1", zb_h1),
    "zbv": _zbv,
    "stp": _v2("stp", stp),
    "dualpipev": _v2("dualpipev", dualpipev),
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
           "generate", "GENERATORS", "gpipe", "one_f_one_b", "interleaved", "zb_h1", "zbv",
           "stp", "dualpipev",
           "check_program", "dry_run", "ScheduleError", "ScheduleDeadlock"]
