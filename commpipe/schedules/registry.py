"""What each named schedule is, in one place: the generators, `commpipe train`, the planner,
calibration, the sweep and the adaptive controller all read these facts from here.

    >>> info("zbv").chunks(1), info("interleaved").chunks(4), info("stp").braided
    (2, 4, True)
    >>> info("1f1b").problem(pp=4, vpp=1, m=3)
    '1f1b needs micro-batches m=3 >= pp=4 to fill the pipeline; use --microbatches >= 4'

Per schedule: how many model chunks a rank holds (one, two in a V, or `--vpp` looped ones),
which `--vpp` values it accepts, the fewest micro-batches it runs and whether m must be a
multiple of pp, whether its backward is split into input and weight gradients (I/W), and
whether it braids a forward with a backward-side pass (TP collectives hidden by the other
pass's compute). The generators themselves check the same constraints (they are pure functions
callable on their own); tests/test_schedules.py proves the two agree on a grid of (p, m, vpp).

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from commpipe.schedules.braided import dualpipev, stp
from commpipe.schedules.generators import gpipe, interleaved, one_f_one_b, zb_h1, zbv

LOOPED, V = "looped", "v"      # placements: stage s on rank s % pp, or a V (r and 2pp-1-r)


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    build: Callable               # the pure generator: (p, m) or (p, m, v) -> Program
    fixed_chunks: int | None      # model chunks per rank; None: --vpp of them (>= 2)
    placement: str                # LOOPED or V
    min_m: Callable[[int], int]   # fewest micro-batches for pp (pp >= 1)
    m_multiple_of_pp: bool = False
    splits_backward: bool = False  # runs I and W passes (zero-bubble family)
    braided: bool = False         # pairs an F with a B/I/W of another micro-batch, unit by unit
    summary: str = ""

    # -- chunks and vpp ----------------------------------------------------------------------
    @property
    def vpp_free(self) -> bool:
        """Whether --vpp chooses the chunks per rank (interleaved) or the schedule fixes them."""
        return self.fixed_chunks is None

    def chunks(self, vpp: int = 1) -> int:
        """Model chunks (virtual stages) per pipeline rank for --vpp `vpp`."""
        return vpp if self.vpp_free else self.fixed_chunks

    def vpp_problem(self, vpp: int) -> str | None:
        """Why `--vpp vpp` does not go with this schedule, or None. Two-chunk V schedules also
        accept 1, the default everywhere, and mean 2."""
        if self.vpp_free:
            if vpp < 2:
                return (f"{self.name} needs vpp >= 2 model chunks per rank, got vpp={vpp}; use "
                        "--vpp 2 (or more), or --schedule 1f1b for one chunk per rank")
            return None
        if self.fixed_chunks == 1 and vpp != 1:
            return (f"{self.name} places one stage per rank, got vpp={vpp}; drop --vpp or use "
                    f"--schedule {' or '.join(vpp_schedules())}")
        if self.fixed_chunks == 2 and vpp not in (1, 2):
            return (f"{self.name} always uses 2 chunks per rank (V shape), got vpp={vpp}; "
                    "use --vpp 2 or drop --vpp")
        return None

    def vpp_options(self, pp: int, layers: int, max_vpp: int = 8) -> list[int]:
        """The chunks per rank a search tries: the fixed count, or every vpp in [2, max_vpp]
        that leaves each chunk at least one layer."""
        if not self.vpp_free:
            return [self.fixed_chunks] if pp * self.fixed_chunks <= layers else []
        return [v for v in range(2, max_vpp + 1) if pp * v <= layers]

    # -- micro-batches -----------------------------------------------------------------------
    def m_problem(self, pp: int, m: int) -> str | None:
        """Why m micro-batches cannot run on pp ranks, or None."""
        lo = self.min_m(pp)
        if m < lo:
            return (f"{self.name} needs micro-batches m={m} >= {self._min_m_text(pp)} to fill the "
                    f"pipeline; use --microbatches >= {lo}")
        if self.m_multiple_of_pp and m % pp:
            return (f"{self.name} groups micro-batches by pp, so m={m} must be a multiple of "
                    f"pp={pp}; use --microbatches {(m // pp + 1) * pp}")
        return None

    def _min_m_text(self, pp: int) -> str:
        lo = self.min_m(pp)
        for text, value in (("pp", pp), ("2*pp", 2 * pp), ("2*pp-1", 2 * pp - 1)):
            if value == lo and pp > 1:
                return f"{text}={lo}"
        return str(lo)

    def problem(self, pp: int, vpp: int, m: int) -> str | None:
        """Why (pp, vpp, m) cannot run this schedule, or None: the generators' constraints."""
        if pp < 1:
            return f"pp={pp} must be >= 1"
        return self.vpp_problem(vpp) or self.m_problem(pp, m)

    def steady_period(self, pp: int) -> int:
        """Micro-batches after which the steady state repeats its pattern: 1 for the V
        schedules (each adds one round of both chunks), pp for looped ones (interleaved
        groups micro-batches by pp). The planner extrapolates long steps by this period."""
        return 1 if self.placement == V else pp

    def recompute_problem(self, recompute: str) -> str | None:
        """Why a recompute mode does not go with this schedule, or None. A braid runs each layer
        unit by unit and keeps every unit's input, so whole-layer recomputation saves nothing
        there (`commpipe train` refuses it)."""
        if self.braided and recompute == "full":
            return (f"--recompute full with the braided schedule {self.name!r} saves nothing (a "
                    "braid keeps every unit's input); use --recompute selective or none")
        return None

    # -- placement ---------------------------------------------------------------------------
    def stage_to_rank(self, pp: int, vpp: int = 1) -> list[int]:
        """The pipeline rank holding each virtual stage, as the generator places them."""
        if self.placement == V:
            return list(range(pp)) + list(range(pp - 1, -1, -1))
        return [s % pp for s in range(pp * self.chunks(vpp))]

    def rank_chunks(self, pp: int, vpp: int = 1) -> tuple[tuple[int, ...], ...]:
        """The virtual stages of each pipeline rank, in increasing order."""
        where = self.stage_to_rank(pp, vpp)
        return tuple(tuple(s for s, r in enumerate(where) if r == rank) for rank in range(pp))

    def generate(self, pp: int, m: int, vpp: int = 1):
        """The compute-only program; a bad (pp, vpp, m) raises ValueError naming the fix (the
        vpp here, m in the generator, whose messages know the schedule's alternatives)."""
        problem = self.vpp_problem(vpp)
        if problem:
            raise ValueError(problem)
        return self.build(pp, m, vpp) if self.vpp_free else self.build(pp, m)


SCHEDULES: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", gpipe, 1, LOOPED, lambda p: 1,
                 summary="all forwards, then all backwards; holds every micro-batch"),
    ScheduleInfo("1f1b", one_f_one_b, 1, LOOPED, lambda p: p,
                 summary="one forward, one backward (PipeDream-Flush)"),
    ScheduleInfo("interleaved", interleaved, None, LOOPED, lambda p: p, m_multiple_of_pp=True,
                 summary="--vpp looped chunks per rank (Megatron-LM); bubble / vpp"),
    ScheduleInfo("zbh1", zb_h1, 1, LOOPED, lambda p: p, splits_backward=True,
                 summary="1F1B with I/W split, W deferred (zero bubble H1)"),
    ScheduleInfo("zbv", zbv, 2, V, lambda p: 2 * p - 1, splits_backward=True,
                 summary="two chunks in a V, I/W split (zero bubble V)"),
    ScheduleInfo("stp", stp, 2, V, lambda p: 2 * p, splits_backward=True, braided=True,
                 summary="braided V: F&I and F&W braids hide TP collectives (STP)"),
    ScheduleInfo("dualpipev", dualpipev, 2, V, lambda p: 2 * p, splits_backward=True, braided=True,
                 summary="braided V: overlapped F&B pairs (DeepSeek DualPipeV)"),
)}
NAMES = tuple(SCHEDULES)
ONE_CHUNK = tuple(n for n, s in SCHEDULES.items() if s.fixed_chunks == 1)


def vpp_schedules() -> list[str]:
    """Schedules with more than one chunk per rank (what to use instead of a one-chunk one)."""
    return [n for n, s in SCHEDULES.items() if s.fixed_chunks != 1]


def info(name: str) -> ScheduleInfo:
    """The facts of a named schedule; an unknown name raises ValueError listing the names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(NAMES)} "
                         "or a path to a schedule .csv") from None


def default_vpp(name: str) -> int:
    """The --vpp a schedule runs with when none is given: its fixed chunk count, else 2."""
    s = info(name)
    return 2 if s.vpp_free else s.fixed_chunks
