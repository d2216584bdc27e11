"""Schedules as data: `Action`, `Program`, their string and CSV forms, and lowering.

An action is a frozen tuple (op, stage, microbatch, unit). `stage` is the *virtual* stage
(model chunk) index in [0, num_stages); a Program maps each stage to the pipeline rank that
holds it, so interleaved and V-shaped schedules are the same data as plain ones.

String form: "<stage><OP><microbatch>[.<unit>]", e.g. "1F3", "0B7", "2SEND_F0", "1I4.attn".

Units: a compute action may address one unit of its stage instead of the whole stage, one of
UNITS = pre_attn, attn, pre_mlp, mlp (the stage's layers cut into four consecutive parts, after
STP; for a one-layer chunk exactly that layer's units). A stage's pass for one micro-batch is
written either whole ("1F3") or as all four units ("1F3.pre_attn" ... "1F3.mlp"); forward units
run in UNITS order, backward (B, I) units in reverse order, a W unit after its own I unit.

Braids: "<forward>&<other>", e.g. "2F5&5B1" or "1F3.attn&1I0.pre_mlp", pairs the forward of one
micro-batch with a B, I or W of another (or the same micro-batch of another stage) on the
same rank. Its op is "F&B", "F&I" or "F&W"; `stage`, `microbatch`, `unit` are the forward's
and `pair` is the other action. A braid is executed unit by unit, alternating forward and
other, so each unit's TP collective is in flight while the other pass's next unit computes;
`parts` gives the two plain actions, which validation and lowering treat like two actions
at one step.

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
BRAID_OPS = ("F&B", "F&I", "F&W")
OPS = COMPUTE_OPS + COMM_OPS + BRAID_OPS
UNITS = ("pre_attn", "attn", "pre_mlp", "mlp")

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:\.(\w+))?$")


@dataclass(frozen=True, order=True)
class Action:
    op: str
    stage: int
    microbatch: int
    unit: str | None = None
    pair: Action | None = None      # a braid's B/I/W side (None for plain actions)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"unknown action op {self.op!r}; use one of {', '.join(OPS)}")
        if self.unit is not None and self.unit not in UNITS:
            raise ValueError(f"action {self.stage}{self.op}{self.microbatch}.{self.unit}: unknown "
                             f"unit {self.unit!r}; use one of {', '.join(UNITS)}")
        if self.unit is not None and self.op in COMM_OPS:
            raise ValueError(f"{self.stage}{self.op}{self.microbatch}.{self.unit}: communication "
                             "actions carry whole-stage tensors and take no unit")
        if (self.op in BRAID_OPS) != (self.pair is not None):
            raise ValueError(f"op {self.op} {'needs' if self.op in BRAID_OPS else 'takes no'} a "
                             "paired action; build braids with braid(forward, other)")
        if self.pair is not None and (self.pair.op != self.op[2] or self.pair.pair is not None):
            raise ValueError(f"braid {self.op} pairs a forward with a plain {self.op[2]} action, "
                             f"got {self.pair!r}")

    def __str__(self) -> str:
        base = f"{self.stage}{'F' if self.pair is not None else self.op}{self.microbatch}"
        base = f"{base}.{self.unit}" if self.unit else base
        return f"{base}&{self.pair}" if self.pair is not None else base

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS or self.op in BRAID_OPS

    @property
    def is_braid(self) -> bool:
        return self.pair is not None

    @property
    def parts(self) -> tuple[Action, ...]:
        """The plain actions this one runs: (forward, other) for a braid, else (self,)."""
        if self.pair is None:
            return (self,)
        return (Action("F", self.stage, self.microbatch, self.unit), self.pair)

    @staticmethod
    def parse(text: str) -> Action:
        text = text.strip()
        if "&" in text:
            left, _, right = text.partition("&")
            return braid(Action.parse(left), Action.parse(right))
        m = _ACTION_RE.match(text)
        if not m:
            raise ValueError(
                f"cannot parse action {text!r}; write <stage><op><microbatch>[.<unit>], e.g. 1F3, "
                f"0B7 or 1F3.attn, or a braid <forward>&<B|I|W action> such as 2F5&5B1 "
                f"(ops: {', '.join(OPS[:8])}; units: {', '.join(UNITS)})"
            )
        return Action(m.group(2), int(m.group(1)), int(m.group(3)), m.group(4))


def braid(forward: Action, other: Action) -> Action:
    """The braided action running `forward` (an F) and `other` (a B, I or W) unit by unit."""
    if forward.op != "F" or other.op not in ("B", "I", "W"):
        raise ValueError(f"a braid pairs a forward with a B, I or W: write e.g. 2F5&5B1, "
                         f"got {forward}&{other}")
    return Action("F&" + other.op, forward.stage, forward.microbatch, forward.unit, other)


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
            after: list[Action] = []
            for part in a.parts:         # a braid: both parts' receives before, sends after
                s, m, u = part.stage, part.microbatch, part.unit
                prev_remote = s > 0 and base.rank_of(s - 1) != rank
                next_remote = s < last and base.rank_of(s + 1) != rank
                # with units, the first unit of a pass receives and the last one sends
                first_f, last_b = u in (None, UNITS[0]), u in (None, UNITS[0])
                first_b, last_f = u in (None, UNITS[-1]), u in (None, UNITS[-1])
                if part.op == "F" and prev_remote and first_f:
                    seq.append(Action("RECV_F", s, m))
                if part.op in ("B", "I") and next_remote and first_b:
                    seq.append(Action("RECV_B", s, m))
                if part.op == "F" and next_remote and last_f:
                    after.append(Action("SEND_F", s, m))
                if part.op in ("B", "I") and prev_remote and last_b:
                    after.append(Action("SEND_B", s, m))
            seq.append(a)
            seq += after
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
        from commpipe.files import read_text

        text = read_text(path, "schedule")
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
