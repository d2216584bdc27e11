"""Schedules as data: `Action`, `Program`, their string and CSV forms, and lowering.

An action is a frozen tuple (op, stage, microbatch, unit). `stage` is the *virtual* stage
(model chunk) index in [0, num_stages); a Program maps each stage to the pipeline rank that
holds it, so interleaved and V-shaped schedules are the same data as plain ones.

String form: "<stage><OP><microbatch>[.<unit>]", e.g. "1F3", "0B7", "2SEND_F0", "1I4.attn".

Compute ops: F (forward), B (full backward), I (input gradient only), W (weight gradient).
Communication ops (inserted by `lower`):
    SEND_F s m   send stage s's output activation of micro-batch m to stage s+1
    RECV_F s m   receive stage s's input activation of micro-batch m from stage s-1
    SEND_B s m   send the gradient of stage s's input to stage s-1
    RECV_B s m   receive the gradient of stage s's output from stage s+1

No torch import here: generators, the validator and the simulator are pure Python.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, replace
from pathlib import Path

COMPUTE_OPS = ("F", "B", "I", "W")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
OPS = COMPUTE_OPS + COMM_OPS

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:\.(\w+))?$")


@dataclass(frozen=True, order=True)
class Action:
    op: str
    stage: int
    microbatch: int
    unit: str | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown action op {self.op!r}; use one of {', '.join(OPS)}")

    def __str__(self) -> str:
        base = f"{self.stage}{self.op}{self.microbatch}"
        return f"{base}.{self.unit}" if self.unit else base

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @staticmethod
    def parse(text: str) -> Action:
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(
                f"cannot parse action {text!r}; write <stage><op><microbatch>, e.g. 1F3 or 0B7 "
                f"(ops: {', '.join(OPS)})"
            )
        return Action(m.group(2), int(m.group(1)), int(m.group(3)), m.group(4))


def F(stage: int, mb: int) -> Action:
    return Action("F", stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action("B", stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: E743 - the op's name in the literature
    return Action("I", stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action("W", stage, mb)


@dataclass(frozen=True)
class Program:
    """Per-rank ordered action lists plus the stage -> rank placement."""

    name: str
    pp: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def vpp(self) -> int:
        return self.num_stages // self.pp

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def is_lowered(self) -> bool:
        return any(a.op in COMM_OPS for rank in self.actions for a in rank)

    def compute_only(self) -> Program:
        return replace(self, actions=tuple(tuple(a for a in r if a.is_compute) for r in self.actions))

    def __str__(self) -> str:
        width = max((len(str(a)) for r in self.actions for a in r), default=3)
        lines = [f"{self.name}: pp={self.pp} m={self.microbatches} stages={self.num_stages}"]
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(str(a).rjust(width) for a in acts))
        return "\n".join(lines)


def make_program(name: str, pp: int, microbatches: int, stage_to_rank, per_rank) -> Program:
    return Program(name, pp, microbatches, tuple(stage_to_rank),
                   tuple(tuple(acts) for acts in per_rank))


def lower(program: Program) -> Program:
    """Insert communication actions into a compute-only program.

    Receive-placement policy: a RECV is placed immediately before the compute action that
    consumes it (posted no earlier than needed, so it never blocks compute queued before it);
    a SEND immediately after the action that produced its tensor (the runtime issues it
    asynchronously and only waits for it when the step ends). Stages on the same rank (the
    turn of a V schedule) pass tensors locally with no communication action.

    A RECV's position is where the receive is waited for; when it is *posted* is a separate
    choice, `commpipe.schedules.order.posting_order`, which gives both sides of every rank
    pair one common sequence of operations (NCCL matches in issue order).
    """
    base = program.compute_only()
    last = base.num_stages - 1
    out = []
    for rank, acts in enumerate(base.actions):
        seq: list[Action] = []
        for a in acts:
            s, m = a.stage, a.microbatch
            prev_remote = s > 0 and base.rank_of(s - 1) != rank
            next_remote = s < last and base.rank_of(s + 1) != rank
            if a.op == "F" and prev_remote:
                seq.append(Action("RECV_F", s, m))
            if a.op in ("B", "I") and next_remote:
                seq.append(Action("RECV_B", s, m))
            seq.append(a)
            if a.op == "F" and next_remote:
                seq.append(Action("SEND_F", s, m))
            if a.op in ("B", "I") and prev_remote:
                seq.append(Action("SEND_B", s, m))
        out.append(tuple(seq))
    return replace(base, actions=tuple(out))


# -- CSV: one row per rank, one action per cell; a header row states the placement ----------
def dump_csv(program: Program) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["#name", program.name, "pp", program.pp, "microbatches", program.microbatches,
                "stage_to_rank", " ".join(map(str, program.stage_to_rank))])
    for acts in program.actions:
        w.writerow([str(a) for a in acts])
    return buf.getvalue()


def load_csv(text_or_path) -> Program:
    """Parse a CSV program. The header row is optional for hand-written files: without it, row
    i is rank i, pp is the row count, stage s lives on rank s (or, with more stages than
    ranks, on rank s % pp), and the micro-batch count is read off the actions."""
    if isinstance(text_or_path, Path) or (isinstance(text_or_path, str)
                                          and "\n" not in text_or_path
                                          and text_or_path.endswith(".csv")):
        path = Path(text_or_path)
        if not path.exists():
            raise FileNotFoundError(f"schedule file {path} does not exist")
        text = path.read_text()
    else:
        text = text_or_path
    rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
    meta: dict[str, str] = {}
    if rows and rows[0] and rows[0][0].startswith("#"):
        head = rows.pop(0)
        head[0] = head[0].lstrip("#")
        meta = {head[i].strip(): head[i + 1].strip() for i in range(0, len(head) - 1, 2)}
    per_rank = []
    for i, row in enumerate(rows):
        try:
            per_rank.append(tuple(Action.parse(c) for c in row if c.strip()))
        except ValueError as e:
            raise ValueError(f"schedule CSV row {i} (rank {i}): {e}") from None
    pp = int(meta.get("pp", len(per_rank)))
    if pp != len(per_rank):
        raise ValueError(f"schedule CSV says pp={pp} but has {len(per_rank)} rank rows")
    all_actions = [a for r in per_rank for a in r]
    if not all_actions:
        raise ValueError("schedule CSV holds no actions")
    if "stage_to_rank" in meta:
        stage_to_rank = tuple(int(x) for x in meta["stage_to_rank"].split())
    else:
        num_stages = max(a.stage for a in all_actions) + 1
        stage_to_rank = tuple(s % pp for s in range(num_stages))
    m = int(meta.get("microbatches", max(a.microbatch for a in all_actions) + 1))
    return Program(meta.get("name", "custom"), pp, m, stage_to_rank, tuple(per_rank))
