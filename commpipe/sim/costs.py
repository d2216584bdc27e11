"""`CostTable`: what each action costs, for `commpipe.sim.simulate`.

Times are milliseconds. Compute costs are per *stage* (model chunk) and per micro-batch:
`f`, `b` (full backward), and `i`, `w` for a backward split into input and weight gradients
(absent: b/2 each). Point-to-point: `latency_ms` plus `activation_bytes / bandwidth`, where
latency and bandwidth are scalars or maps {(rank_a, rank_b): value} (looked up both ways, with
an optional "default" entry). TP/CP collectives of a stage cost `tp_comm` per F and per B/I;
`tp_mode="exposed"` adds them to the compute time, `"overlapped"` hides them behind the
compute (an action then takes max(compute, collective)). A MoE stage's expert-parallel
all-to-alls (token dispatch and combine, and their adjoints in the backward) cost `ep_comm` per
F and per B/I: blocking, so added to the compute time, except where a braid runs them on the
rank's EP stream beside the other pass's units (commpipe/sim/units.py).

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from commpipe.jsonfile import read_json_object

TP_MODES = ("exposed", "overlapped")


def _per_stage(name: str, value, num_stages: int, scale: float = 1.0) -> list[float] | None:
    """Scalars (per pipeline rank's share of the model) are split evenly over the chunks;
    lists are per stage and taken as given."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return [float(value) * scale] * num_stages
    vals = [float(x) for x in value]
    if len(vals) != num_stages:
        raise ValueError(f"cost {name!r} has {len(vals)} entries but the program has {num_stages} "
                         f"stages; give one value per stage or a single number")
    return vals


@dataclass
class CostTable:
    f: list[float]
    b: list[float]
    i: list[float] | None = None
    w: list[float] | None = None
    latency_ms: float | dict = 0.0
    bandwidth_gbps: float | dict = math.inf      # decimal GB/s = 1e6 bytes per ms
    activation_bytes: float | list = 0.0          # per micro-batch per stage boundary (s -> s+1)
    tp_comm: list[float] | None = None
    tp_mode: str = "exposed"
    ep_comm: list[float] | None = None
    activation_memory_bytes: list[float] | None = None   # stored per micro-batch per stage

    def __post_init__(self):
        n = len(self.f)
        if n < 1 or len(self.b) != n:
            raise ValueError(f"cost table needs f and b with one value per stage, got {len(self.f)} "
                             f"and {len(self.b)}")
        # the I/W split: missing halves default to an even split of b (or to what is left of b)
        if self.i is None and self.w is None:
            self.i = [x / 2 for x in self.b]
            self.w = [x / 2 for x in self.b]
        elif self.i is None:
            self.i = [max(b - w, 0.0) for b, w in zip(self.b, self.w)]
        elif self.w is None:
            self.w = [max(b - i, 0.0) for b, i in zip(self.b, self.i)]
        for name in ("i", "w", "tp_comm", "ep_comm", "activation_memory_bytes"):
            vals = getattr(self, name)
            if vals is not None and len(vals) != n:
                raise ValueError(f"cost {name!r} has {len(vals)} entries for {n} stages")
        for name in ("f", "b", "i", "w", "tp_comm", "ep_comm"):
            if any(x < 0 for x in getattr(self, name) or ()):
                raise ValueError(f"cost {name!r} has a negative time: {getattr(self, name)}")
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode={self.tp_mode!r}; use one of {', '.join(TP_MODES)}")
        if isinstance(self.activation_bytes, int | float):
            self.activation_bytes = [float(self.activation_bytes)] * max(n - 1, 0)
        elif len(self.activation_bytes) != n - 1:
            raise ValueError(f"activation_bytes has {len(self.activation_bytes)} entries; give one "
                             f"per stage boundary ({n - 1}) or a single number")

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @classmethod
    def uniform(cls, num_stages: int, f: float = 1.0, b: float = 2.0, i: float | None = None,
                w: float | None = None, **kw) -> CostTable:
        """Every stage costs the same; f, b, i, w are per stage (per chunk)."""
        return cls(f=[f] * num_stages, b=[b] * num_stages,
                   i=None if i is None else [i] * num_stages,
                   w=None if w is None else [w] * num_stages, **kw)

    @classmethod
    def for_program(cls, program, **values) -> CostTable:
        """A table for `program` from user-facing values (a --costs string or JSON object).

        Scalar compute costs (f, b, i, w, tp_comm, ep_comm, activation_memory_bytes) are for one
        micro-batch through one pipeline rank's whole share of the model, and are split evenly
        over its chunks (num_stages / pp), so 1f1b and interleaved compare at equal model size.
        Lists are per stage and used as given.
        """
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown cost keys {sorted(unknown)}; use {', '.join(sorted(known))}")
        n = program.num_stages
        scale = program.pp / n
        kw = dict(values)
        kw["f"] = _per_stage("f", values.get("f", 1.0), n, scale)
        kw["b"] = _per_stage("b", values.get("b", 2.0), n, scale)
        for name in ("i", "w", "tp_comm", "ep_comm", "activation_memory_bytes"):
            kw[name] = _per_stage(name, values.get(name), n, scale)
        return cls(**kw)

    # -- lookups used by the engine ---------------------------------------------------------
    def link(self, src: int, dst: int) -> tuple[float, float]:
        """(latency_ms, ms per byte) of the link src -> dst."""
        lat = _lookup(self.latency_ms, src, dst, "latency_ms")
        bw = _lookup(self.bandwidth_gbps, src, dst, "bandwidth_gbps")
        if bw <= 0:
            raise ValueError(f"bandwidth of link {src}->{dst} must be > 0, got {bw}")
        return lat, 1.0 / (bw * 1e6)

    def check_fits(self, program) -> None:
        if self.num_stages != program.num_stages:
            raise ValueError(f"cost table has {self.num_stages} stages, program {program.name!r} has "
                             f"{program.num_stages}; build it with CostTable.uniform("
                             f"{program.num_stages}, ...) or CostTable.for_program(program, ...)")


def _lookup(value, src: int, dst: int, name: str) -> float:
    if isinstance(value, int | float):
        return float(value)
    for key in ((src, dst), (dst, src), f"{src}-{dst}", f"{dst}-{src}", "default"):
        if key in value:
            return float(value[key])
    raise ValueError(f"{name} has no entry for link {src}-{dst}; add \"{src}-{dst}\" or \"default\"")


def parse_costs(text: str | None, program) -> CostTable:
    """--costs: a JSON file path or `key=value` pairs ("f=1,b=2,w=1,latency_ms=0.05")."""
    if not text:
        return CostTable.for_program(program)
    if text.endswith(".json"):
        values = read_json_object(text, "cost", '{"f": 1, "b": 2}')
        return CostTable.for_program(program, **values)
    values: dict = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"--costs item {item!r} is not key=value; write e.g. f=1,b=2,w=1")
        key = key.strip()
        if key == "tp_mode":
            values[key] = val.strip()
            continue
        try:
            values[key] = float(val)
        except ValueError:
            raise ValueError(f"--costs {key}={val!r} is not a number") from None
    return CostTable.for_program(program, **values)
