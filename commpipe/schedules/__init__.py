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
from commpipe.schedules.registry import SCHEDULES, ScheduleInfo, info
from commpipe.schedules.validate import ScheduleDeadlock, ScheduleError, check_program, dry_run

# name -> (pp, microbatches, vpp=1) -> Program; the facts behind each entry (chunks per rank,
# vpp rules, fewest micro-batches, placement) live in commpipe.schedules.registry
GENERATORS = {name: s.generate for name, s in SCHEDULES.items()}


def generate(name: str, pp: int, microbatches: int, vpp: int = 1) -> Program:
    """A compute-only program for a named schedule, or a program loaded from a CSV path."""
    if name.endswith(".csv"):
        return load_csv(name)
    return info(name).generate(pp, microbatches, vpp)


__all__ = ["Action", "Program", "COMM_OPS", "COMPUTE_OPS", "dump_csv", "load_csv", "lower",
           "generate", "GENERATORS", "gpipe", "one_f_one_b", "interleaved", "zb_h1", "zbv",
           "stp", "dualpipev", "SCHEDULES", "ScheduleInfo", "info",
           "check_program", "dry_run", "ScheduleError", "ScheduleDeadlock"]
